"""tidal from Python: build a config in code, train it, evaluate a model (docs/python-api.md).

    import tidal

    cfg = tidal.make_config("examples/quickstart/config.yaml", train={"num_steps": 2})
    history = tidal.run(cfg)                     # one dict of metrics per step
    print([row["reward/mean"] for row in history])

`make_config` builds the config `tidal train --config FILE --train.num_steps 2` builds (the same
defaults, files, checks and error messages) and `run` runs the loop `tidal train` runs. The
function is `run`, not `train`: `tidal.train` is the package of the trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidal.config import GROUPS, Config, build_config
from tidal.options import ConfigError

__all__ = ["OVERRIDES_SOURCE", "evaluate", "make_config", "run"]

OVERRIDES_SOURCE = "make_config"  # how errors name the values given in code (a file names itself)


def make_config(
    *config_files: str | Path,
    overrides: Mapping[str, Any] | None = None,
    for_training: bool = True,
    **groups: Any,
) -> Config:
    """The run's config: the defaults, then each YAML file in order, then `groups`, then
    `overrides`; validated as `tidal train` validates it.

    Args:
        config_files: YAML files of config groups, as `--config` takes them (a later file's
            values over an earlier one's).
        overrides: options by dotted key, `{"train.lr": 1e-5, "rollout.n_samples_per_prompt": 8}`,
            as `--train.lr 1e-5` gives them; applied last.
        for_training: False for a config that only evaluates (`evaluate`): the checks that only
            training needs (a group advantage's samples per prompt, batch divisibility) are skipped.
        **groups: options by group, `train={"num_steps": 2, "lr": 1e-5}`, `data={"path": "my.jsonl"}`.

    Raises:
        ConfigError: an unknown group or option (with the nearest real one), a value of the wrong
            type, or values that do not fit together; every problem at once, each line naming the
            field and the fix, as `tidal train` prints them.
    """
    values: dict[str, Any] = {}
    for group, body in groups.items():
        if isinstance(body, Mapping):
            values.update({f"{group}.{key}": value for key, value in body.items()})
        elif group in GROUPS:
            raise ConfigError(
                f"{OVERRIDES_SOURCE}: {group}= takes a dict of the {group} group's options, "
                f"e.g. {group}={{'<option>': value}}; got {type(body).__name__}"
            )
        else:  # an unknown group: the config names it with the nearest real one
            values[group] = body
    values.update(overrides or {})
    return build_config(list(config_files), values, for_training, source=OVERRIDES_SOURCE)


def run(config: Config, *, resume: bool = False, allow_config_change: bool = False) -> list[dict[str, Any]]:
    """Train as `tidal train` does: `config.train.num_steps` steps into `config.train.output_dir`
    (its console lines, metrics.jsonl, checkpoints), continuing from the newest complete
    checkpoint when `resume`. Logging is set up as the command sets it unless the program has
    configured it already.

    A script that calls this must guard its entry point (`if __name__ == "__main__":`): a sync
    reward runs in worker processes, and each imports the script afresh.

    Returns:
        One dict per step, in order, as metrics.jsonl holds them: `step` and every metric
        (`reward/mean`, `actor/pg_loss`, `time/step`, ...; docs/runs.md lists them).

    Raises:
        ConfigError: the run folder or the reward's output do not fit the config.
        RunStopped: the run stopped itself (too many failed samples, bad optimizer steps).
        InputError: a data file or checkpoint is not what it must be; the message names it.
    """
    from tidal.log import setup_logging
    from tidal.loop import train

    setup_logging()
    return train(config, resume=resume, allow_config_change=allow_config_change)


def evaluate(
    config: Config,
    model: str | Path,
    num_prompts: int | None = None,
    *,
    n: int | None = None,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
) -> dict[str, Any]:
    """Score `model` as `tidal eval MODEL` does: every set of `config.eval.datasets` (else the
    first 100 prompts of `config.data.path`) sampled with the config's generate function and
    scored with its reward; `n`, `temperature` and `max_new_tokens` replace every set's own.

    Returns:
        `{"model": folder, "datasets": {name: {"mean_reward", "pass@1", ..., "response_length",
        "truncated_ratio", "failed_ratio", "prompts", "samples"}}}`.
    """
    from tidal.eval import evaluate as evaluate_model
    from tidal.log import setup_logging

    setup_logging()
    given = {"n": n, "temperature": temperature, "max_new_tokens": max_new_tokens}
    return evaluate_model(config, str(model), num_prompts, **{k: v for k, v in given.items() if v is not None})
