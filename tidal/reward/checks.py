"""What a reward call may return and which of its errors are worth another try: shared by the
per-sample scoring (`tidal.reward.score`) and the per-group one (`tidal.reward.group`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Awaitable, Callable
from typing import Any

from tidal.types import Sample

__all__ = ["RETRYABLE", "GroupRewardFn", "RewardFn", "check_reward", "retryable"]

RewardFn = Callable[[Sample], Awaitable[float | dict]]
GroupRewardFn = Callable[[list[Sample]], Awaitable[list[float | dict]]]


def check_reward(value: Any) -> float | dict:
    """Normalise a reward to float or dict; raise TypeError/ValueError for anything else."""
    if isinstance(value, dict):
        return value
    if isinstance(value, numbers.Real):
        value = float(value)
        # A NaN/inf reward would poison every advantage in its group, so it counts as a failure.
        if not math.isfinite(value):
            raise ValueError(f"reward is not finite: {value}")
        return value
    raise TypeError(f"reward function returned {type(value).__name__}, expected a number or a dict")


RETRYABLE = (TimeoutError, ConnectionError)


def retryable(error: BaseException) -> bool:
    """A timeout, a lost connection, or a reward worker process that died: worth another try. Other
    exceptions come from the reward's own logic and would fail again."""
    return isinstance(error, RETRYABLE) or type(error).__name__ == "ProcessExpired"
