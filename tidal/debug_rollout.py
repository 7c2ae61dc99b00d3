"""Debug modes (`debug` config group): save each step's rollout, replay saved rollouts with no
engine at all, or roll out without training.

A saved rollout is the step's samples exactly as the trainer receives them (`Sample.to_dict`,
token ids and rollout log-probs included) in `DIR/step_000012.jsonl.gz`, and the rollout's own
metrics (dynamic sampling counts) in `DIR/step_000012.metrics.json`. Replaying them from the same
starting weights and seed repeats the run's updates, so a loss bug reproduces in seconds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from tidal.samples_log import read_jsonl_gz, saved_steps, step_path, write_jsonl_gz
from tidal.types import Sample
from tidal.utils import atomic_write_json

__all__ = ["NoEngines", "NoSync", "load_rollout", "rollout_for_step", "save_rollout"]

log = logging.getLogger("tidal")


def _metrics_path(directory: str | Path, step: int) -> Path:
    return step_path(directory, step).with_name(f"step_{step:06d}.metrics.json")


def save_rollout(directory: str | Path, step: int, samples: list[Sample], metrics: dict[str, float]) -> Path:
    """Write step `step`'s samples and rollout metrics under `directory`; returns the samples file.

    Raises TypeError naming the step when a sample holds a value JSON cannot keep exactly
    (a replay from a lossy copy would not be the same run)."""
    path = step_path(directory, step)
    try:
        write_jsonl_gz(path, (s.to_dict() for s in samples), strict=True)
    except TypeError as e:
        raise TypeError(f"debug.save_rollout: step {step}: a sample field is not JSON-serialisable: {e}") from None
    atomic_write_json(_metrics_path(directory, step), metrics)
    return path


def load_rollout(directory: str | Path, step: int) -> tuple[list[Sample], dict[str, float]]:
    """The samples and rollout metrics `save_rollout` wrote for `step`.

    Raises FileNotFoundError naming the folder and the steps it does hold."""
    path = step_path(directory, step)
    if not path.exists():
        have = saved_steps(directory)
        held = f"steps {have[0]}..{have[-1]} ({len(have)} files)" if have else "no saved steps"
        raise FileNotFoundError(f"debug.load_rollout: {path} does not exist; {directory} holds {held}")
    samples = []
    for i, row in enumerate(read_jsonl_gz(path), 1):
        try:
            samples.append(Sample.from_dict(row))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}:{i}: not a saved Sample ({e})") from None
    metrics_file = _metrics_path(directory, step)
    metrics = json.loads(metrics_file.read_text(encoding="utf-8")) if metrics_file.exists() else {}
    return samples, metrics


def rollout_for_step(
    debug, step: int, collect: Callable[[], tuple[list[Sample], dict[str, float]]]
) -> tuple[list[Sample], dict[str, float]]:
    """Step `step`'s rollout (numbered as in metrics.jsonl): loaded from `debug.load_rollout` when
    set, else `collect()`ed and, with `debug.save_rollout`, written there before training sees it."""
    if debug.load_rollout:
        samples, metrics = load_rollout(debug.load_rollout, step)
        log.info("debug: step %d replays %d saved samples from %s", step, len(samples), debug.load_rollout)
        return samples, metrics
    samples, metrics = collect()
    if debug.save_rollout:
        save_rollout(debug.save_rollout, step, samples, metrics)
    return samples, metrics


class NoEngines:
    """The rollout role when `debug.load_rollout` replays saved samples: no engine to run."""

    engine = None

    def __init__(self) -> None:
        from tidal.aio import LoopThread

        self.loop = LoopThread()  # the rollout manager's rewards still run on it

    def health(self) -> bool:
        return True

    def recover(self) -> bool:
        return False

    def live_urls(self) -> list[str]:
        return []

    def stats(self) -> dict:
        return {}

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        self.loop.close()


class NoSync:
    """Weight sync with no engine to receive the weights."""

    transport = "none"

    def push(self, version: int) -> dict[str, float]:
        return {}

    def before_train(self) -> None:
        pass

    def close(self) -> None:
        pass
