"""Group rewards (`reward.group_fn`): one call per prompt's group, for judges that compare the
samples of a prompt with each other (pairwise preference, ranking) rather than score each alone.

The function gets the group's samples that generated (a sample whose generation failed has nothing
to compare and keeps its FAILED status) and returns one reward per sample, in order. Its rewards
replace any a generate function set: the group reward sees those on ``sample.reward`` and can
return them unchanged to keep them. A call that raises, times out past every retry, or returns the
wrong number or kind of rewards fails every sample it was given, as a failed per-sample reward
fails its sample; other groups are still scored.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from tidal.reward.checks import GroupRewardFn, GroupScoreFn, check_reward, retryable
from tidal.reward.failures import ErrorLog
from tidal.reward.pool import is_async_callable
from tidal.types import Sample, Status
from tidal.utils import load_object

__all__ = ["GroupRewardFn", "load_group_reward", "score_groups"]


def load_group_reward(spec: str) -> GroupScoreFn:
    """The group reward at `spec` (``pkg.mod:fn``, ``pkg.mod.fn`` or ``file.py:fn``) as an async
    function. A sync function runs in a thread so it does not block the rollout's event loop (a
    timeout then marks the group failed but cannot stop the call)."""
    fn = load_object(spec, callable_required=True)
    is_async = is_async_callable(fn)

    async def group_reward(samples: list[Sample]) -> Any:
        result = fn(samples) if is_async else await asyncio.to_thread(fn, samples)
        if inspect.isawaitable(result):
            result = await result
        return result

    group_reward.__name__ = getattr(fn, "__name__", "group_reward")
    group_reward.spec = spec  # type: ignore[attr-defined]  # named in error messages
    return group_reward


def _check_group(value: Any, n: int, name: str) -> list[float | dict]:
    """One checked reward per sample, or TypeError/ValueError saying what was expected."""
    if not isinstance(value, list | tuple):
        raise TypeError(
            f"group reward {name} returned {type(value).__name__}, expected a list of {n} rewards (numbers or dicts)"
        )
    if len(value) != n:
        raise ValueError(
            f"group reward {name} returned {len(value)} rewards for a group of {n} samples; "
            "expected one per sample, in order"
        )
    out = []
    for i, v in enumerate(value):
        try:
            out.append(check_reward(v))
        except (TypeError, ValueError) as e:
            raise type(e)(f"group reward {name}, reward {i} of {n}: {e}") from None
    return out


async def score_groups(
    samples: list[Sample],
    group_fn: GroupScoreFn,
    timeout: float | None = None,
    max_concurrency: int = 64,
    retries: int = 0,
    backoff: float = 1.0,
    errors: ErrorLog | None = None,
) -> int:
    """Score `samples` group by group (by ``group_index``) with `group_fn` and store each reward on
    its sample. Limits and retries as in `tidal.reward.score.score_samples`, per group call; the
    retry count is kept in ``metadata["reward_retries"]`` of the group's samples.

    Returns:
        The number of samples this call marked FAILED.
    """
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        if s.status != Status.FAILED:  # generation failed: nothing to judge
            groups.setdefault(s.group_index, []).append(s)
    name = getattr(group_fn, "spec", getattr(group_fn, "__name__", "group_reward"))
    semaphore = asyncio.Semaphore(max_concurrency)

    async def call(group: list[Sample]) -> list[float | dict]:
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                value = await group_fn(list(group))  # a copy: the function may reorder its argument
        except TimeoutError as e:
            if not deadline.expired():
                raise
            raise TimeoutError(f"group reward {name} did not finish within {timeout} s") from e
        return _check_group(value, len(group), name)

    async def score_one(group: list[Sample]) -> int:
        attempt = 0
        while True:
            try:
                async with semaphore:
                    rewards = await call(group)
                for s, r in zip(group, rewards, strict=True):
                    s.reward = r
                return 0
            except Exception as e:
                if attempt < retries and retryable(e):
                    attempt += 1
                    for s in group:
                        s.metadata["reward_retries"] = attempt
                    await asyncio.sleep(backoff * 2 ** (attempt - 1))
                    continue
                for s in group:
                    s.status = Status.FAILED
                    s.reward = 0.0
                    s.metadata["error"] = f"{type(e).__name__}: {e}"
                    if errors is not None:
                        errors.record(s, e)
                return len(group)

    failed = await asyncio.gather(*(score_one(g) for g in groups.values()))
    return sum(failed)
