"""Scoring a rollout's samples: the reward `reward.fn` names (a built-in or a user function by
dotted path) called concurrently under the reward group's limits, or a group reward per prompt."""

from __future__ import annotations

import asyncio
import inspect

from tidal.reward.checks import GroupScoreFn, ScoreFn, check_reward, retryable
from tidal.reward.failures import ErrorLog, check_failed_ratio
from tidal.reward.group import score_groups
from tidal.reward.options import RewardConfig
from tidal.reward.pool import RewardPool, is_async_callable
from tidal.reward.verifiers import BUILTIN_REWARDS
from tidal.types import Sample, Status
from tidal.utils import load_object

__all__ = [
    "BUILTIN_SAMPLE_REWARDS",
    "check_reward_key",
    "get_reward_fn",
    "scalar_reward",
    "score_rollout",
    "score_samples",
]

# Built-in rewards that take the whole sample and are async (they run code), by dotted path;
# imported on first use.
BUILTIN_SAMPLE_REWARDS: dict[str, str] = {
    "code_tests": "tidal.reward.code_tests:code_reward",
}


def get_reward_fn(spec: str, workers: int = 0) -> ScoreFn:
    """Resolve a reward spec into an async function ``sample -> float | dict``.

    `spec` is either a name in `BUILTIN_REWARDS` (called as ``fn(sample.response, sample.label)``),
    a name in `BUILTIN_SAMPLE_REWARDS` (``code_tests``), or a dotted path (``pkg.mod:fn`` or
    ``pkg.mod.fn``) to a user function ``reward(sample)`` that returns a float or a dict and may be
    sync or async.

    Async functions run on the event loop. Sync ones would block it (one sample at a time, and a
    timeout could not interrupt them), so they run elsewhere: with `workers` > 0 in that many
    worker processes (`tidal.reward.pool`: a call past its timeout has its process
    terminated); with 0 in threads, where a timeout marks the sample failed but cannot stop the
    call, which keeps its thread until it returns. The builtins are cheap and run inline.

    Raises:
        ValueError: `spec` is neither a builtin name nor a well-formed dotted path.
        ImportError: the dotted path cannot be imported.
    """
    spec = BUILTIN_SAMPLE_REWARDS.get(spec, spec)
    builtin = BUILTIN_REWARDS.get(spec)
    if builtin is not None:

        async def builtin_reward(sample: Sample) -> float:
            return builtin(sample.response, sample.label)

        builtin_reward.__name__ = f"reward_{spec}"
        return builtin_reward

    if ":" not in spec and "." not in spec:
        raise ValueError(
            f"unknown reward {spec!r}: expected one of "
            f"{', '.join(sorted([*BUILTIN_REWARDS, *BUILTIN_SAMPLE_REWARDS]))} "
            "or a dotted path such as 'my_pkg.rewards:score'"
        )
    fn = load_object(spec, callable_required=True)
    name = getattr(fn, "__name__", "user_reward")
    if not is_async_callable(fn) and workers > 0:
        pool = RewardPool(spec, workers)
        pool.__name__ = name
        return pool

    # One wrapper for the other flavours: coroutine functions, callables that return an awaitable
    # (objects with an async __call__), and sync functions (in a thread).
    is_async = is_async_callable(fn)

    async def user_reward(sample: Sample) -> float | dict:
        result = fn(sample) if is_async else await asyncio.to_thread(fn, sample)
        if inspect.isawaitable(result):
            result = await result
        return result

    user_reward.__name__ = name
    return user_reward


async def score_samples(
    samples: list[Sample],
    reward_fn: ScoreFn | str,
    timeout: float | None = None,
    max_concurrency: int = 64,
    retries: int = 0,
    backoff: float = 1.0,
    errors: ErrorLog | None = None,
) -> int:
    """Score every sample concurrently and store the result in ``sample.reward``.

    At most `max_concurrency` reward calls run at once. Samples whose status is already FAILED
    (generation failed) are skipped. A call that exceeds `timeout` seconds or raises a retryable
    error (`TimeoutError`, `ConnectionError`, a reward worker that died) is tried again up to
    `retries` times, after ``backoff * 2**k`` seconds before retry k + 1 (the count is kept in
    ``metadata["reward_retries"]``). A call that still fails, raises anything else, or returns
    something other than a finite number or a dict marks its sample FAILED with reward 0.0 and
    ``metadata["error"] = "<ExceptionType>: <message>"``; the other samples are still scored. Each
    such error is given to `errors` (the console shows the first of each kind).
    `reward_fn` may also be a spec string, resolved with `get_reward_fn`.

    Returns:
        The number of samples this call marked FAILED.
    """
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
    if retries < 0 or backoff < 0:
        raise ValueError(f"retries and backoff must be >= 0, got {retries} and {backoff}")
    if isinstance(reward_fn, str):
        reward_fn = get_reward_fn(reward_fn)
    semaphore = asyncio.Semaphore(max_concurrency)

    async def call(sample: Sample) -> float | dict:
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                value = await reward_fn(sample)
        except TimeoutError as e:
            if not deadline.expired():
                raise  # a TimeoutError raised by the reward function itself
            # asyncio's own TimeoutError has an empty message; say which limit was hit.
            raise TimeoutError(f"reward did not finish within {timeout} s") from e
        return check_reward(value)

    async def score_one(sample: Sample) -> bool:
        attempt = 0
        while True:
            try:
                async with semaphore:  # not held while backing off
                    sample.reward = await call(sample)
                return False
            except Exception as e:  # CancelledError is a BaseException and still propagates
                if attempt < retries and retryable(e):
                    attempt += 1
                    sample.metadata["reward_retries"] = attempt
                    await asyncio.sleep(backoff * 2 ** (attempt - 1))
                    continue
                sample.status = Status.FAILED
                sample.reward = 0.0
                sample.metadata["error"] = f"{type(e).__name__}: {e}"
                if errors is not None:
                    errors.record(sample, e)
                return True

    todo = [s for s in samples if s.status != Status.FAILED]
    failed = await asyncio.gather(*(score_one(s) for s in todo))
    return sum(failed)


async def score_rollout(
    samples: list[Sample],
    reward_fn: ScoreFn | None,
    cfg: RewardConfig,
    max_failed_ratio: float,
    errors: ErrorLog,
    group_fn: GroupScoreFn | None = None,
) -> int:
    """Score a rollout step's samples under the reward group's limits (timeout, retries, backoff);
    then log the step's error summary and apply `max_failed_ratio` (`rollout.max_failed_ratio`) to
    all of `samples` (raises `TooManyFailedSamples`). Returns the number of samples the reward
    marked FAILED.

    With `group_fn` (`reward.group_fn`) every group is scored by one call of it
    (`tidal.reward.group.score_groups`), over rewards a generate function set; otherwise
    `reward_fn` scores, with `score_samples`, the samples that have no reward yet (a generate
    function may have set one). A reward that bounds its own calls (``own_limits``: the judge, with
    its own timeout and retries per request) is not wrapped in `reward.timeout` and retries.
    """
    limits = {"timeout": cfg.timeout, "retries": cfg.retries, "backoff": cfg.backoff}
    if group_fn is not None:
        failed = await score_groups(samples, group_fn, errors=errors, **limits)
    else:
        if reward_fn is None:
            raise ValueError("score_rollout needs a reward_fn or a group_fn")
        if getattr(reward_fn, "own_limits", False):
            limits.update(timeout=None, retries=0)
        failed = await score_samples([s for s in samples if s.reward is None], reward_fn, errors=errors, **limits)
    errors.flush()
    check_failed_ratio(samples, max_failed_ratio)
    return failed


def scalar_reward(sample: Sample, key: str = "score") -> float:
    """The sample's reward as a float: the number itself, or ``reward[key]`` for a dict reward.

    A FAILED sample that never got a reward (generation failed, so scoring skipped it) gives 0.0:
    callers build reward tensors over whole batches and exclude failed samples via a valid mask.

    Raises:
        ValueError: a non-failed sample has no reward yet.
        KeyError: the reward is a dict without `key` (the message lists the keys it has).
    """
    reward = sample.reward
    if reward is None and sample.status == Status.FAILED:
        return 0.0
    if reward is None:
        raise ValueError(f"sample {sample.index} has no reward; score it first")
    if isinstance(reward, dict):
        if key not in reward:
            raise KeyError(f"reward of sample {sample.index} has no key {key!r}; available keys: {sorted(reward)}")
        return float(reward[key])
    return float(reward)


def check_reward_key(samples: list[Sample], key: str) -> None:
    """Raise ConfigError when a scored sample's dict reward lacks `key` (`reward.key`).

    A reward's return type is only known once it has run, so the rollout calls this on every scored
    batch: the first one comes before any training, and the message names the setting to change and
    the keys the reward does return, where `scalar_reward` would fail later with a bare KeyError."""
    from tidal.options import ConfigError

    for s in samples:
        if isinstance(s.reward, dict) and key not in s.reward:
            raise ConfigError(
                f"reward.key: the reward returned a dict without the key {key!r} (sample {s.index}: keys "
                f"{sorted(s.reward)}); set reward.key to the entry to train on, e.g. "
                f"--reward.key={sorted(s.reward)[0] if s.reward else 'KEY'}"
            )
