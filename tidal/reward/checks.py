"""What a reward call may return and which of its errors are worth another try: shared by the
per-sample scoring (`tidal.reward.score`) and the per-group one (`tidal.reward.group`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from tidal.types import Sample

__all__ = ["RETRYABLE", "GroupRewardFn", "GroupScoreFn", "RewardFn", "ScoreFn", "check_reward", "retryable"]


class RewardFn(Protocol):
    """A reward function of your own, named by `reward.fn` (`pkg.module:fn`, or `path/to/file.py:fn`):

        def reward(sample: Sample) -> float | dict          # or `async def`

    It is called once per sample whose generation did not fail, after the whole rollout step was
    sampled. What it reads of the `tidal.Sample` (treat it as read-only: a sync reward runs in a
    worker process, `reward.workers`, and gets a copy):

        prompt            str   the exact prompt text the model saw, after the chat template
        response          str   the response text (special tokens removed)
        label             Any   the row's `data.label_key` field, as the file has it (None if absent)
        metadata          dict  the row's `data.metadata_key` dict, plus `prompt_index` (the row's
                                position) and what the generate function added (`finish_reason`;
                                the tool loop's conversation; the agent door's `agent_calls`)
        status            Status  completed (stopped at eos or a stop string) | truncated (hit
                                `rollout.max_new_tokens`) | aborted
        response_length   int   number of response tokens; `response_tokens` lists them
        tokens            list[int]  prompt then response token ids
        group_index       int   the prompt's position in this step: samples of one prompt share it
        index             int   the sample's position in this step
        reward            float | dict | None  set by a generate function or an agent, else None

    It returns a finite number, or a dict of them whose `reward.key` entry (default "score")
    is trained on; every numeric entry is logged as `rewards/<key>`. A reward that raises, times
    out (`reward.timeout`, tried `reward.retries` more times on TimeoutError/ConnectionError) or
    returns anything else fails its sample (status failed, reward 0, `metadata["error"]`, not
    trained on); the run goes on until more than `rollout.max_failed_ratio` of a step fails.
    """

    def __call__(self, sample: Sample, /) -> float | dict | Awaitable[float | dict]: ...


class GroupRewardFn(Protocol):
    """A group reward of your own, named by `reward.group_fn` instead of `reward.fn`:

        def group_reward(samples: list[Sample]) -> list[float | dict]     # or `async def`

    Called once per prompt with the samples of its group that generated (the fields a `RewardFn`
    reads), in order; returns one reward per sample, in the same order. A sync one runs in a
    thread. Errors, timeouts and a wrong count fail every sample of that group (`tidal.reward.group`).
    """

    def __call__(self, samples: list[Sample], /) -> list[float | dict] | Awaitable[list[float | dict]]: ...


# a reward as the rollout calls it, whatever its flavour: `get_reward_fn` / `load_group_reward` wrap
# a sync user function (in a thread or a worker process) so that every call is awaited
ScoreFn = Callable[[Sample], Awaitable[float | dict]]
GroupScoreFn = Callable[[list[Sample]], Awaitable[list[float | dict]]]


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
