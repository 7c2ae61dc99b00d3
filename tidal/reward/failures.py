"""Failed samples made visible: the first error of each kind on the console, and a stop when too
large a share of a rollout failed (a reward that raises on every sample must not train on nothing
and exit 0)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from tidal.types import RunStopped, Sample, Status

__all__ = ["ErrorLog", "TooManyFailedSamples", "check_failed_ratio"]

log = logging.getLogger("tidal")


class TooManyFailedSamples(RunStopped):
    """A rollout step had more failed samples than `rollout.max_failed_ratio` allows."""


class ErrorLog:
    """Counts errors by kind (the exception type); the first of each kind is logged at WARNING with
    its message and the sample it hit, later ones only counted (`flush` logs the counts)."""

    def __init__(self, what: str = "reward") -> None:
        self.what = what
        self.total: Counter[str] = Counter()  # over the run
        self.pending: Counter[str] = Counter()  # since the last flush

    def record(self, sample: Sample, error: BaseException) -> None:
        kind = type(error).__name__
        if kind not in self.total:
            log.warning(
                "%s failed on sample %d (prompt %s): %s: %s (further %s errors are counted, not shown)",
                self.what,
                sample.index,
                sample.metadata.get("prompt_index", sample.group_index),
                kind,
                error,
                kind,
            )
        self.total[kind] += 1
        self.pending[kind] += 1

    def flush(self) -> None:
        """Log the errors counted since the last flush, one line, most frequent first."""
        if self.pending:
            parts = ", ".join(f"{kind} x{n}" for kind, n in self.pending.most_common())
            log.warning("%s errors this step: %s (run total %d)", self.what, parts, sum(self.total.values()))
            self.pending.clear()


def check_failed_ratio(samples: Sequence[Sample], max_ratio: float) -> None:
    """Raise `TooManyFailedSamples` when more than `max_ratio` of `samples` FAILED, naming the share,
    the threshold and the first error; 1.0 never raises."""
    failed = [s for s in samples if s.status == Status.FAILED]
    if not samples or len(failed) / len(samples) <= max_ratio:
        return
    first = failed[0]
    raise TooManyFailedSamples(
        f"{len(failed)} of {len(samples)} samples failed ({len(failed) / len(samples):.0%}), more than "
        f"rollout.max_failed_ratio {max_ratio:g}; first error (sample {first.index}): "
        f"{first.metadata.get('error', 'no error recorded')}"
    )
