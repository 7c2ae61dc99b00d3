"""Reward functions: built-in answer checkers, user functions by dotted path, and concurrent scoring."""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import re
from collections.abc import Awaitable, Callable
from decimal import Decimal
from fractions import Fraction
from typing import Any

from tidal.config import RolloutConfig
from tidal.rollout.failures import ErrorLog, check_failed_ratio
from tidal.rollout.reward_pool import RewardPool, is_async_callable
from tidal.types import Sample, Status
from tidal.utils import load_object

__all__ = [
    "BUILTIN_REWARDS",
    "BUILTIN_SAMPLE_REWARDS",
    "GroupRewardFn",
    "RewardFn",
    "check_reward_key",
    "exact_match",
    "extract_answer",
    "get_reward_fn",
    "math_verify",
    "parse_number",
    "scalar_reward",
    "score_rollout",
    "score_samples",
]

RewardFn = Callable[[Sample], Awaitable[float | dict]]
GroupRewardFn = Callable[[list[Sample]], Awaitable[list[float | dict]]]

# A number in free text. The look-behind keeps us from starting inside a word ("x2", "H2O") or
# after a decimal point, and makes "8-3" read as 8 and 3 rather than 8 and -3. Alternatives are
# tried in order: fraction, comma-grouped thousands, plain integer/decimal, bare ".5".
_TEXT_NUMBER_RE = re.compile(
    r"(?<![\w.])(?P<sign>-)?"
    r"(?P<body>\d+/\d+|\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
_PLAIN_NUMBER_RE = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)")
_LATEX_FRAC_RE = re.compile(r"(?P<sign>[+-]?)\s*\\[dt]?frac\s*\{(?P<num>[^{}]*)\}\s*\{(?P<den>[^{}]*)\}")
_SLASH_FRAC_RE = re.compile(r"(?P<num>[^/]+)/(?P<den>[^/]+)")


def _last_boxed(text: str) -> str | None:
    """Contents of the last complete ``\\boxed{...}``, matching nested braces; None if there is none.

    A truncated final ``\\boxed{`` with no closing brace is skipped in favour of an earlier complete
    one, since a cut-off answer is not an answer.
    """
    end = len(text)
    while True:
        start = text.rfind("\\boxed", 0, end)
        if start < 0:
            return None
        i = start + len("\\boxed")
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j]
        end = start


def extract_answer(text: str) -> str | None:
    """The final answer in a model response.

    The contents of the last ``\\boxed{...}`` (nested braces handled) if there is one, else the last
    number in the text: integers, decimals, negatives, thousands-grouped numbers such as ``1,234``
    (returned without commas) and simple fractions such as ``3/4`` or ``-3/4``. None if neither.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    last = None
    for last in _TEXT_NUMBER_RE.finditer(text):  # noqa: B007 - only the final match is wanted
        pass
    if last is None:
        return None
    return (last.group("sign") or "") + last.group("body").replace(",", "")


def _parse_plain(s: str) -> Fraction | None:
    s = s.strip()
    if not _PLAIN_NUMBER_RE.fullmatch(s):
        return None
    return Fraction(s.replace(",", "").rstrip("."))


def _parse_ratio(num: str, den: str) -> Fraction | None:
    a, b = _parse_plain(num), _parse_plain(den)
    if a is None or b is None or b == 0:
        return None
    return a / b


def parse_number(s: str) -> Fraction | None:
    """Parse `s` exactly as a rational number, or return None if it is not a plain number.

    Accepts integers, decimals (``0.25``, ``.5``), ``a/b``, ``\\frac{a}{b}``, ``\\dfrac{a}{b}``
    (and ``\\tfrac``), with an optional sign (a leading ``+`` included), thousands commas
    (``1,234`` or LaTeX ``1{,}234``), surrounding ``$`` and whitespace and a trailing period.
    Fractions with a zero denominator give None. Exact: ``parse_number("0.1") == Fraction(1, 10)``.
    """
    if not isinstance(s, str):
        return None
    t = s.strip().rstrip(".").strip().strip("$").strip().rstrip(".").strip()
    t = t.replace("{,}", ",")
    if not t:
        return None
    m = _LATEX_FRAC_RE.fullmatch(t)
    if m:
        value = _parse_ratio(m.group("num"), m.group("den"))
        if value is None:
            return None
        return -value if m.group("sign") == "-" else value
    m = _SLASH_FRAC_RE.fullmatch(t)
    if m:
        return _parse_ratio(m.group("num"), m.group("den"))
    return _parse_plain(t)


def _label_number(label: Any) -> Fraction | None:
    """An exact number from a dataset label, or None when the label is not numeric."""
    if isinstance(label, bool):
        return None  # True/False are answers like "yes"/"no", not 1/0
    if isinstance(label, numbers.Rational):
        return Fraction(int(label.numerator), int(label.denominator))
    if isinstance(label, Decimal):
        return Fraction(label) if label.is_finite() else None
    if isinstance(label, numbers.Real):
        value = float(label)
        if not math.isfinite(value):
            return None
        # Via repr, so the label 0.1 means the decimal 0.1 and not its binary approximation.
        return Fraction(repr(value))
    if isinstance(label, str):
        return parse_number(label)
    return None


def math_verify(response: str, label: Any) -> float:
    """1.0 if the response's final answer (see `extract_answer`) equals `label`, else 0.0.

    When both the answer and the label parse as numbers they are compared exactly as fractions,
    so "0.5", "1/2" and "\\frac{1}{2}" all match the label 0.5. When neither is numeric and the
    label is a string, the stripped texts are compared. A numeric answer never matches a
    non-numeric label or vice versa.
    """
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    got, want = parse_number(answer), _label_number(label)
    if got is not None and want is not None:
        return float(got == want)
    if got is None and want is None and isinstance(label, str):
        return float(answer.strip() == label.strip())
    return 0.0


def exact_match(response: str, label: Any) -> float:
    """1.0 if ``response.strip() == str(label).strip()``, else 0.0."""
    return float(response.strip() == str(label).strip())


BUILTIN_REWARDS: dict[str, Callable[[str, Any], float]] = {
    "math": math_verify,
    "exact_match": exact_match,
}

# Built-in rewards that take the whole sample and are async (they run code), by dotted path;
# imported on first use.
BUILTIN_SAMPLE_REWARDS: dict[str, str] = {
    "code_tests": "tidal.rollout.code_reward:code_reward",
}


def get_reward_fn(spec: str, workers: int = 0) -> RewardFn:
    """Resolve a reward spec into an async function ``sample -> float | dict``.

    `spec` is either a name in `BUILTIN_REWARDS` (called as ``fn(sample.response, sample.label)``),
    a name in `BUILTIN_SAMPLE_REWARDS` (``code_tests``), or a dotted path (``pkg.mod:fn`` or
    ``pkg.mod.fn``) to a user function ``reward(sample)`` that returns a float or a dict and may be
    sync or async.

    Async functions run on the event loop. Sync ones would block it (one sample at a time, and a
    timeout could not interrupt them), so they run elsewhere: with `workers` > 0 in that many
    worker processes (`tidal.rollout.reward_pool`: a call past its timeout has its process
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


def _check_reward(value: Any) -> float | dict:
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


def _retryable(error: BaseException) -> bool:
    """A timeout, a lost connection, or a reward worker process that died: worth another try. Other
    exceptions come from the reward's own logic and would fail again."""
    return isinstance(error, RETRYABLE) or type(error).__name__ == "ProcessExpired"


async def score_samples(
    samples: list[Sample],
    reward_fn: RewardFn | str,
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
        return _check_reward(value)

    async def score_one(sample: Sample) -> bool:
        attempt = 0
        while True:
            try:
                async with semaphore:  # not held while backing off
                    sample.reward = await call(sample)
                return False
            except Exception as e:  # CancelledError is a BaseException and still propagates
                if attempt < retries and _retryable(e):
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
    reward_fn: RewardFn | None,
    cfg: RolloutConfig,
    errors: ErrorLog,
    group_fn: GroupRewardFn | None = None,
) -> int:
    """Score a rollout step's samples under the `RolloutConfig` limits (timeout, retries, backoff);
    then log the step's error summary and apply `rollout.max_failed_ratio` to all of `samples`
    (raises `TooManyFailedSamples`). Returns the number of samples the reward marked FAILED.

    With `group_fn` (`rollout.group_reward`) every group is scored by one call of it
    (`tidal.rollout.group_reward.score_groups`), over rewards a generate function set; otherwise
    `reward_fn` scores, with `score_samples`, the samples that have no reward yet (a generate
    function may have set one). A reward that bounds its own calls (``own_limits``: the judge, with
    its own timeout and retries per request) is not wrapped in `rollout.reward_timeout` and retries.
    """
    limits = {"timeout": cfg.reward_timeout, "retries": cfg.reward_retries, "backoff": cfg.reward_backoff}
    if group_fn is not None:
        from tidal.rollout.group_reward import score_groups

        failed = await score_groups(samples, group_fn, errors=errors, **limits)
    else:
        if reward_fn is None:
            raise ValueError("score_rollout needs a reward_fn or a group_fn")
        if getattr(reward_fn, "own_limits", False):
            limits.update(timeout=None, retries=0)
        failed = await score_samples([s for s in samples if s.reward is None], reward_fn, errors=errors, **limits)
    errors.flush()
    check_failed_ratio(samples, cfg.max_failed_ratio)
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
    """Raise ConfigError when a scored sample's dict reward lacks `key` (`rollout.reward_key`).

    A reward's return type is only known once it has run, so the rollout calls this on every scored
    batch: the first one comes before any training, and the message names the setting to change and
    the keys the reward does return, where `scalar_reward` would fail later with a bare KeyError."""
    from tidal.config import ConfigError

    for s in samples:
        if isinstance(s.reward, dict) and key not in s.reward:
            raise ConfigError(
                f"rollout.reward_key: the reward returned a dict without the key {key!r} (sample {s.index}: keys "
                f"{sorted(s.reward)}); set rollout.reward_key to the entry to train on, e.g. "
                f"--rollout.reward_key={sorted(s.reward)[0] if s.reward else 'KEY'}"
            )
