"""Evaluation: score a policy on held-out prompt sets with the run's reward, during training
(`eval.interval`) or standalone (`tidal eval MODEL`), through one function, `evaluate_set`.

`tidal eval` takes a run folder (its newest checkpoint), a checkpoint (full or LoRA, merged on
load), a model folder or smollm2 (`tidal.model_source`). On a run or one of its checkpoints it
starts from the run's own settings (`eval_config`: its reward, eval sets, sampling, prompt
format, engine, from the run's config.json), with `--config` files and flags over them, so
`tidal eval RUN` scores what the run's own eval scored.

Per set the metrics are the mean reward, the unbiased pass@k of Chen et al. (2021) for every k
in `eval.pass_k` that is at most the set's n (pass@1 always), the mean response length and the
truncated / failed shares. A sample is *correct* when its reward is >= `eval.correct_threshold`
(default 1.0: the built-in math and exact_match rewards give 1.0 for a right answer and 0.0
otherwise, and a partial-credit reward does not count as solved); a failed sample is never correct.

Eval samples are drawn with seeds from (`eval.seed`, the set's name, the sample's index), never
from the step, so every eval of a run, and `tidal eval` on any of its checkpoints, draws with the
same seeds: a change between two evals is the weights', not the dice's. Evaluation reads no
training data and leaves the global RNGs as it found them, so a run's training is the same with
and without it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import statistics
import time
import zlib
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from tidal.aio import LoopThread
from tidal.config import Config
from tidal.contracts import Engine
from tidal.data.dataset import PromptRecord
from tidal.data.images import ImageReader
from tidal.data.load import image_reader, load_data
from tidal.eval_sets import EvalSet
from tidal.model_source import ModelSource, locate_model, model_folder
from tidal.options import ConfigError
from tidal.reward.score import scalar_reward
from tidal.rollout.manager import RolloutManager, group_sizes
from tidal.types import Sample, Status

log = logging.getLogger("tidal")

PROMPTS_PER_CALL = 256  # prompts handed to the engine at once: bounds memory, not results


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of `k` samples is correct, given `c`
    correct among `n` samples of the prompt: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021).
    Computed exactly, so large n loses no precision."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    # in exact rationals, so 1 - (nearly 1) keeps its digits: pass@1 of 1 in 2000 is 1/2000 exactly
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def set_seed_step(name: str) -> int:
    """The `step` the eval set's seeds are derived from: negative, so never a training step's,
    and from the name, so a set keeps its seeds whatever else is evaluated beside it."""
    return -1 - zlib.crc32(name.encode())


def evaluate_set(
    rollout: RolloutManager,
    records: list[PromptRecord],
    name: str,
    pass_k: list[int],
    threshold: float,
    reward_key: str,
) -> dict[str, float]:
    """Sample `rollout.rollout.n_samples_per_prompt` responses to each record (through the run's
    generate function) and score them; returns the set's metrics (unprefixed: `mean_reward`,
    `pass@k`, `response_length`, ...). pass@k's n is each prompt's group size (groups may differ in size)."""
    step = set_seed_step(name)
    samples: list[Sample] = []
    per_prompt: list[tuple[int, int]] = []  # (samples, correct samples) of each prompt
    for i in range(0, len(records), PROMPTS_PER_CALL):
        # seeds index samples by their prompt's position, so chunking changes no sample
        chunk = rollout.generate(
            records[i : i + PROMPTS_PER_CALL], step, first_index=i * rollout.rollout.n_samples_per_prompt
        )
        correct = [s.status != Status.FAILED and scalar_reward(s, reward_key) >= threshold for s in chunk]
        start = 0
        for size in group_sizes(chunk):  # one group per prompt, of any size (a fan-out generate)
            per_prompt.append((size, sum(correct[start : start + size])))
            start += size
        samples += chunk
    rewards = [scalar_reward(s, reward_key) for s in samples]
    metrics = {
        "prompts": float(len(records)),
        "samples": float(len(samples)),
        "mean_reward": statistics.fmean(rewards),
    }
    # pass@k is estimated per prompt from its own n; reported only when every prompt has k samples
    fewest = min((n for n, _ in per_prompt), default=0)
    for k in sorted({1, *pass_k}):
        if k <= fewest:
            metrics[f"pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for n, c in per_prompt)
    metrics["response_length"] = statistics.fmean(s.response_length for s in samples)
    metrics["truncated_ratio"] = sum(s.status == Status.TRUNCATED for s in samples) / len(samples)
    metrics["failed_ratio"] = sum(s.status == Status.FAILED for s in samples) / len(samples)
    metrics["weight_version"] = float(min(s.weight_version for s in samples))  # the oldest weights used
    return metrics


def set_manager(
    cfg: Config, s: EvalSet, engine: Engine, tokenizer: Any, loop: LoopThread, images: ImageReader | None = None
) -> RolloutManager:
    """The run's rollout (generate function, reward, stop strings) with the eval set's sampling and
    the eval seed (`eval.seed`); `images`: a vision-language model's processor (the agent door's)."""
    rollout = dataclasses.replace(cfg.rollout, n_samples_per_prompt=s.n, max_new_tokens=s.max_new_tokens)
    sampling = dataclasses.replace(cfg.sampling, temperature=s.temperature, top_p=s.top_p, seed=cfg.eval.seed)
    return RolloutManager(
        engine,
        rollout,
        tokenizer,
        loop,
        sampling=sampling,
        reward=cfg.reward,
        judge=cfg.judge,
        rm=cfg.rm,
        tools=cfg.tools,
        agent=cfg.agent,
        images=images,
    )


def close_rewards(manager: RolloutManager) -> None:
    """Stop the reward worker processes of a set's manager (a sync user reward runs in a pool)
    now, while the process is whole: left to exit, workers still starting print tracebacks."""
    for fn in (manager.reward_fn, manager.group_reward_fn):
        close = getattr(fn, "close", None)
        if close is not None:
            close()


def load_set(s: EvalSet, tokenizer: Any, images: ImageReader | None = None) -> list[PromptRecord]:
    """The set's prompts in file order (the first `num_prompts` when set), their images read by a
    vision-language model's `images`."""
    records = load_data(s.data, tokenizer, images)
    return records[: s.num_prompts] if s.num_prompts else records


class Evaluator:
    """The loop's evaluation: `due(step)` says whether `step` (steps done) is an eval point,
    `run(step)` scores every set with the engine's current weights and returns
    `eval/<name>/<metric>` entries. Sets are read once, up front."""

    def __init__(
        self,
        run: Config,
        tokenizer: Any,
        engine: Engine,
        loop: LoopThread | None = None,
        model_dir: str | Path | None = None,
    ) -> None:
        """`model_dir`: the trained model's folder (a vision-language model's processor reads the
        sets' images)."""
        self.cfg = cfg = run.eval
        self.reward_key = run.reward.key
        self.sets = []
        self.engine = engine
        self.loop = loop if loop is not None else LoopThread("tidal-eval")
        if cfg.interval:
            for s in cfg.sets(run.data, run.rollout, run.sampling):
                images = image_reader(s.data, model_dir) if model_dir is not None else None
                manager = set_manager(run, s, engine, tokenizer, self.loop, images)
                self.sets.append((s.name, manager, load_set(s, tokenizer, images)))

    def due(self, step: int) -> bool:
        """Whether the weights after `step` steps (0: the initial ones) are to be evaluated."""
        if not self.cfg.interval:
            return False
        return self.cfg.at_start if step == 0 else step % self.cfg.interval == 0

    def run(self, step: int, overlapped: Any = None) -> dict[str, float]:
        """Every set's metrics as `eval/<name>/<metric>`, plus `time/eval`. With an overlapped
        rollout (`overlap.mode`), its worker is held while eval has the engine (it holds the
        trainer's latest weights: pushes finish before the loop goes on);
        `eval/<name>/weight_version` records the version used."""
        t0 = time.perf_counter()
        out: dict[str, float] = {}
        if overlapped is not None:  # the engine serves one caller at a time
            overlapped.pause()
        # The engine's sampler draws from torch's global generator even for seeded rows, and a
        # user's reward may use `random`: put both back so training's draws are untouched.
        py_state = random.getstate()
        try:
            with torch.random.fork_rng(devices=[]):
                for name, manager, records in self.sets:
                    c = self.cfg
                    metrics = evaluate_set(manager, records, name, c.pass_k, c.correct_threshold, self.reward_key)
                    out.update({f"eval/{name}/{k}": v for k, v in metrics.items() if k not in ("prompts", "samples")})
            # Eval prompts left in the prefix cache would let the next rollout reuse K/V computed
            # in another batch; drop them so a run's rollouts are the same with and without eval.
            self.loop.run(self.engine.flush_cache(), 60, "flushing the engine's prefix cache after eval")
        finally:
            random.setstate(py_state)
            if overlapped is not None:
                overlapped.resume()
        out["time/eval"] = time.perf_counter() - t0
        log.info(
            "eval at step %d: %s",
            step,
            ", ".join(f"{name} reward {out[f'eval/{name}/mean_reward']:.3f}" for name, _, _ in self.sets),
        )
        return out


def standalone_sets(cfg: Config, num_prompts: int | None = None, **sampling: Any) -> list[EvalSet]:
    """`eval.datasets`, or when there are none the run's `data.path` (its first 100 prompts by
    default, as `tidal eval` always scored); `num_prompts` caps every set and `sampling` (n,
    temperature, max_new_tokens given on the command line) overrides every set's own."""
    sets = cfg.eval.sets(cfg.data, cfg.rollout, cfg.sampling)
    if not sets:
        r, sp = cfg.rollout, cfg.sampling
        name = cfg.data.path[len("env:") :] if cfg.data.path.startswith("env:") else Path(cfg.data.path).stem
        sets = [EvalSet(name, cfg.data, r.n_samples_per_prompt, sp.temperature, sp.top_p, r.max_new_tokens, 100)]
    if num_prompts is not None:
        sampling["num_prompts"] = num_prompts
    return [dataclasses.replace(s, **sampling) for s in sets]


# The groups a standalone eval takes from a run's config.json: what samples, scores and formats the
# prompts. Training, placement, overlap, logging and debugging are the run's own business: taken
# over, they would change nothing here and could fail validation on another machine (a debug
# folder, a Ray address); `cluster.device` is taken as the run asked for it (`auto` stays `auto`).
EVAL_GROUPS = ("data", "rollout", "sampling", "engine", "reward", "judge", "rm", "tools", "agent", "eval", "sandbox")


def run_values(path: Path) -> dict[str, Any]:
    """A run's `config.json` as flat `group.key` values for a standalone eval of its checkpoints:
    the `EVAL_GROUPS`, and `cluster.device`, `engine.dtype` as requested before the run resolved
    them (`resolved` records both); masked secrets are left out (read again from their file or
    the environment), as are keys this tidal does not know (logged)."""
    import typing

    from tidal.config import REDACTED, SECRET_FIELDS, upgrade

    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the run's config ({e})") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path}: expected the run's config as a JSON object of config groups")
    saved = upgrade(saved)
    values: dict[str, Any] = {}
    unknown = []
    for group in EVAL_GROUPS:
        body = saved.get(group)
        known = typing.get_type_hints(type(getattr(Config(), group)))
        for key, value in (body if isinstance(body, dict) else {}).items():
            name = f"{group}.{key}"
            if key not in known:
                unknown.append(name)
            elif not (name in SECRET_FIELDS and value == REDACTED):
                values[name] = value
    if unknown:
        log.warning("%s: left out %s, which this tidal does not know", path, ", ".join(unknown))
    resolved = saved.get("resolved") if isinstance(saved.get("resolved"), dict) else {}
    cluster = saved.get("cluster") if isinstance(saved.get("cluster"), dict) else {}
    for name, value in (("cluster.device", cluster.get("device")), ("engine.dtype", values.get("engine.dtype"))):
        record = resolved.get(name)
        requested = record.get("requested") if isinstance(record, dict) else None
        if requested is not None or value is not None:
            values[name] = requested if requested is not None else value
    return values


def eval_config(run_config: Path | None, files: list[str] | None, values: dict[str, Any]) -> Config:
    """`tidal eval`'s config: the defaults, then the run's settings when MODEL is a run or one of
    its checkpoints (`run_values` of its `config.json`), then each `--config` file, then the
    command line; validated for evaluation. A run whose engines were servers at `engine.urls`
    (which hold their own weights) is evaluated in tidal's engine unless a file or the command
    line names `engine.kind` or `engine.urls`."""
    from tidal.config import apply_overrides, load_yaml, read_secrets, validate

    layers = [(load_yaml(path), str(path)) for path in files or []]
    layers.append((values, "command line"))
    cfg = Config()
    if run_config is not None:
        apply_overrides(cfg, run_values(run_config), str(run_config))
        chosen = any(k in flat for flat, _ in layers for k in ("engine.kind", "engine.urls"))
        if cfg.engine_kind.servers and not chosen:
            default = Config().engine
            log.info(
                "engine.kind: the run's %s reaches servers that hold their own weights; loading the checkpoint in "
                "engine.kind %s instead (--engine.kind chooses another)",
                cfg.engine.kind,
                default.kind,
            )
            cfg.engine.kind, cfg.engine.urls = default.kind, default.urls
    for flat, where in layers:
        apply_overrides(cfg, flat, where)
    try:
        validate(cfg, for_training=False)
    except ConfigError as e:
        if run_config is None:
            raise
        where = f"(the run's settings come from {run_config}; --config and flags go over them)"
        raise ConfigError(f"{e}\n{where}") from None
    read_secrets(cfg)
    return cfg


def evaluate(cfg: Config, model: str | ModelSource, num_prompts: int | None = None, **sampling: Any) -> dict[str, Any]:
    """`tidal eval`: score `model` (what `tidal.model_source.locate_model` takes: a run folder, a
    checkpoint, full or LoRA, a model folder or smollm2) on every set of `standalone_sets`.
    Returns `{"model": folder, "datasets": {name: metrics}}`, with `"step"` for a checkpoint."""
    from tidal.adapters.factory import make_engine
    from tidal.convert import load_tokenizer
    from tidal.hardware import resolve_device
    from tidal.hooks import check_user_code
    from tidal.reward.sandbox import check_run, set_default_backend

    source = model if isinstance(model, ModelSource) else locate_model(model)
    if cfg.sandbox.backend is not None:  # the code sandbox of a code_tests reward
        set_default_backend(cfg.sandbox.backend)
    check_run(cfg.runs_model_code, cfg.sandbox.backend)
    check_user_code(cfg)  # the reward and generate functions, before the model loads
    results = {}
    with model_folder(source) as model_dir:
        log.info("evaluating %s", source.describe())
        tokenizer = load_tokenizer(model_dir)
        sets = standalone_sets(cfg, num_prompts, **sampling)
        readers = [image_reader(s.data, model_dir) for s in sets]  # a vision-language model's
        loaded = [(s, load_set(s, tokenizer, r)) for s, r in zip(sets, readers, strict=True)]
        # KV cache sized for the largest call of any set; bigger calls still run, just queued
        longest = dataclasses.replace(cfg.rollout, max_new_tokens=max(s.max_new_tokens for s in sets))
        kv_tokens = cfg.engine.cache_tokens(
            min(PROMPTS_PER_CALL, max(len(r) for _, r in loaded)),
            max(s.n for s in sets),
            longest.response_budget,
            max(s.data.max_prompt_length for s in sets),
        )
        device = resolve_device(cfg.cluster.device).device
        engine = make_engine(cfg.engine, model_dir, tokenizer, kv_tokens, device)
        with LoopThread("tidal-eval") as loop:
            try:
                for (s, records), images in zip(loaded, readers, strict=True):
                    manager = set_manager(cfg, s, engine, tokenizer, loop, images)
                    try:
                        metrics = evaluate_set(
                            manager, records, s.name, cfg.eval.pass_k, cfg.eval.correct_threshold, cfg.reward.key
                        )
                    finally:
                        close_rewards(manager)
                    metrics.pop("weight_version")  # a model loaded from a folder is version 0, whatever it is
                    results[s.name] = metrics
            finally:
                loop.run(engine.aclose(), 60, "closing the engine")
    out: dict[str, Any] = {"model": str(source.folder or model_dir)}
    if source.step is not None:
        out["step"] = source.step
    return {**out, "datasets": results}


def results_table(results: dict[str, dict[str, float]]) -> str:
    """One row per set, one column per metric (any set's), plain text for a terminal or a log."""
    columns = list(dict.fromkeys(k for m in results.values() for k in m))
    rows = [["dataset", *columns]]
    for name, m in results.items():
        cells = [name]
        for c in columns:
            v = m.get(c)
            cells.append("-" if v is None else f"{v:.0f}" if c in ("prompts", "samples") else f"{v:.4f}")
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    )
