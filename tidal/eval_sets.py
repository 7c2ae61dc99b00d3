"""The `eval` option group: held-out sets (files or `env:` tasks, each with its own sampling) and
when to score them; `EvalConfig.sets` resolves each entry against the data and rollout groups."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

from tidal.data.options import DataConfig
from tidal.options import ConfigError, Need, coerce, opt, unknown_name
from tidal.rollout.options import RolloutConfig, SamplingConfig

EVAL_SET_KEYS = {
    "name": "the metric prefix eval/<name>/ (default: the file's stem or the env's name)",
    "path": "a .jsonl/.json/.parquet file or env:<name>, read like data.path",
    "env_args": "keyword arguments of the env (default: data.env_args when path is data.path)",
    "n": "samples per prompt (default: rollout.n_samples_per_prompt)",
    "temperature": "sampling temperature (default: sampling.temperature)",
    "top_p": "nucleus mass (default: sampling.top_p)",
    "max_new_tokens": "longest response (default: rollout.max_new_tokens)",
    "num_prompts": "score only the first N prompts in file order (default: 0 = all)",
    "input_key": "as data.input_key",
    "label_key": "as data.label_key",
    "metadata_key": "as data.metadata_key",
    "apply_chat_template": "as data.apply_chat_template",
    "system_prompt": "as data.system_prompt",
    "max_prompt_length": "as data.max_prompt_length",
}


@dataclass
class EvalSet:
    """One entry of `eval.datasets`, its sampling filled in from the rollout group."""

    name: str
    data: DataConfig  # the prompt file or env, read exactly as data.path is
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    num_prompts: int = 0


@dataclass
class EvalConfig:
    datasets: list = opt(
        [],
        "eval sets: a list of {path: FILE or env:NAME, name, n, temperature, top_p, max_new_tokens, num_prompts, "
        "env_args, input_key, label_key, ...}; sampling defaults to the rollout group's, prompt options to data's",
    )
    interval: int = opt(0, "evaluate eval.datasets every N steps with the current weights (0 = off)")
    at_start: bool = opt(True, "with eval.interval set, also evaluate the initial weights (logged as step 0)")
    pass_k: list = opt([1], "k of the unbiased pass@k (Chen et al. 2021); a k above a set's n is skipped")
    correct_threshold: float = opt(1.0, "a sample is correct (for pass@k) when its reward is >= this")
    seed: int = opt(0, "base seed of the eval samples: the same seeds at every eval, so steps compare fairly")

    def sets(self, data: DataConfig, rollout: RolloutConfig, sampling: SamplingConfig) -> list[EvalSet]:
        """`datasets` checked and resolved; ValueError names the entry, the key and what was expected."""
        out: list[EvalSet] = []
        for i, entry in enumerate(self.datasets):
            where = f"eval.datasets[{i}]"
            if isinstance(entry, str):
                entry = {"path": entry}
            if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
                raise ValueError(f"{where}: expected {{path: FILE or env:NAME, ...}}, got {entry!r}")
            unknown = sorted(set(entry) - set(EVAL_SET_KEYS))
            if unknown:
                raise ValueError(f"{where}: {unknown_name('key', unknown[0], list(EVAL_SET_KEYS))}")
            path = entry["path"]
            name = entry.get("name") or (path[len("env:") :] if path.startswith("env:") else Path(path).stem)
            if not isinstance(name, str) or "/" in name:
                raise ValueError(f"{where}.name: a string without '/', got {name!r}")
            if any(s.name == name for s in out):
                raise ValueError(f"{where}.name: {name!r} is used twice; give each set its own name")
            try:
                # the run's own env keeps its arguments; another source starts from none
                d = dataclasses.replace(data, path=path, env_args=data.env_args if path == data.path else {})
                hints = typing.get_type_hints(DataConfig)
                for k in entry.keys() & hints.keys() - {"path"}:  # the prompt options, as in data.*
                    setattr(d, k, coerce(f"{where}.{k}", entry[k], hints[k]))
                s = EvalSet(
                    name=name,
                    data=d,
                    n=coerce(f"{where}.n", entry.get("n", rollout.n_samples_per_prompt), int),
                    temperature=coerce(f"{where}.temperature", entry.get("temperature", sampling.temperature), float),
                    top_p=coerce(f"{where}.top_p", entry.get("top_p", sampling.top_p), float),
                    max_new_tokens=coerce(
                        f"{where}.max_new_tokens", entry.get("max_new_tokens", rollout.max_new_tokens), int
                    ),
                    num_prompts=coerce(f"{where}.num_prompts", entry.get("num_prompts", 0), int),
                )
            except ConfigError as e:
                raise ValueError(str(e)) from None
            for key, ok, want in (
                ("n", s.n >= 1, ">= 1"),
                ("max_new_tokens", s.max_new_tokens >= 1, ">= 1"),
                ("num_prompts", s.num_prompts >= 0, ">= 0 (0 = all)"),
                ("temperature", s.temperature >= 0, ">= 0"),
                ("top_p", 0 < s.top_p <= 1, "in (0, 1]"),
            ):
                if not ok:
                    raise ValueError(f"{where}.{key}: must be {want}, got {getattr(s, key)}")
            if not path.startswith("env:") and not Path(path).exists():
                raise ValueError(f"{where}.path: file {path!r} does not exist")
            out.append(s)
        return out

    def check(self, need: Need, data: DataConfig, rollout: RolloutConfig, sampling: SamplingConfig) -> None:
        need(self.interval >= 0, f"eval.interval: must be >= 0 (0 = off), got {self.interval}")
        need(
            bool(self.pass_k) and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in self.pass_k),
            f"eval.pass_k: a non-empty list of integers >= 1, got {self.pass_k}",
        )
        try:
            sets = self.sets(data, rollout, sampling)
        except ValueError as err:
            need(False, str(err))
        else:
            need(not self.interval or sets, "eval.interval: needs eval.datasets (a list of {path: FILE or env:NAME})")
