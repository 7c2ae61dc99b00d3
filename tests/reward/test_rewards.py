"""Answer extraction, number parsing, built-in checkers, user reward functions and concurrent scoring."""

from __future__ import annotations

import asyncio
import itertools
import sys
import textwrap
import time
from fractions import Fraction

import pytest

from tidal.reward.score import get_reward_fn, scalar_reward, score_samples
from tidal.reward.verifiers import BUILTIN_REWARDS, exact_match, extract_answer, math_verify, parse_number
from tidal.types import Sample, Status


@pytest.mark.parametrize(
    "text,expected",
    [
        ("So the total is \\boxed{42}.", "42"),
        ("We get $\\boxed{\\frac{3}{4}}$", "\\frac{3}{4}"),
        ("First guess \\boxed{1}, but correcting: \\boxed{2}", "2"),
        ("\\boxed{x^{2} + \\sqrt{y_{1}}}", "x^{2} + \\sqrt{y_{1}}"),
        ("Final: \\boxed { 7 }", "7"),
        ("\\boxed{12} is my answer, not 99", "12"),
        ("earlier \\boxed{3} then cut off \\boxed{4", "3"),
        ("8 + 7 = 15.", "15"),
        ("She has 1,234,567 apples in total", "1234567"),
        ("The temperature dropped to -5 degrees.", "-5"),
        ("It costs $18.50 in total.", "18.50"),
        ("The probability is 3/4", "3/4"),
        ("a change of -3/4 per step", "-3/4"),
        ("Step 1: 12 * 3 = 36\nStep 2: 36 - 6 = 30\nThe answer is 30", "30"),
        ("5-3=2", "2"),
        ("half is .5", ".5"),
        ("I cannot determine the answer.", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "s,expected",
    [
        ("42", Fraction(42)),
        ("+7", Fraction(7)),
        ("-3", Fraction(-3)),
        ("0.25", Fraction(1, 4)),
        (".5", Fraction(1, 2)),
        ("0.1", Fraction(1, 10)),
        ("3/4", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        ("3 / 4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{-1}{2}", Fraction(-1, 2)),
        ("-\\frac{1}{2}", Fraction(-1, 2)),
        ("$\\frac{7}{2}$.", Fraction(7, 2)),
        ("$12$", Fraction(12)),
        (" 15. ", Fraction(15)),
        ("1,234", Fraction(1234)),
        ("1{,}234", Fraction(1234)),
        ("1/0", None),
        ("1,23", None),
        ("x = 3", None),
        ("\\frac{\\sqrt{2}}{2}", None),
        ("abc", None),
        ("", None),
        ("$", None),
    ],
)
def test_parse_number(s, expected):
    assert parse_number(s) == expected


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("The answer is \\boxed{0.5}", "1/2", 1.0),
        ("\\boxed{\\frac{1}{2}}", 0.5, 1.0),
        ("\\boxed{-3/4}", "-0.75", 1.0),
        ("so she has 1,234 apples", 1234, 1.0),
        ("\\boxed{72}", "72", 1.0),
        ("\\boxed{72}", 72.0, 1.0),
        ("\\boxed{0.1}", 0.1, 1.0),
        ("\\boxed{$42$}", Fraction(42), 1.0),
        ("8 + 7 = 15.", 15, 1.0),
        ("\\boxed{Monday}", " Monday ", 1.0),
        ("The answer is 41", 42, 0.0),
        ("\\boxed{0.33}", "1/3", 0.0),
        ("no answer here", 42, 0.0),
        ("\\boxed{Monday}", "Tuesday", 0.0),
        ("\\boxed{Monday}", 3, 0.0),
        ("\\boxed{3}", "three", 0.0),
        ("\\boxed{3}", float("nan"), 0.0),
    ],
)
def test_math_verify(response, label, expected):
    assert math_verify(response, label) == expected


def test_exact_match():
    assert exact_match("  Paris\n", "Paris") == 1.0
    assert exact_match("42", 42) == 1.0
    assert exact_match("paris", "Paris") == 0.0
    assert exact_match("The answer is Paris", "Paris") == 0.0


def _sample(response: str = "", label=None, **kw) -> Sample:
    return Sample(response=response, label=label, **kw)


def test_builtin_reward_fns():
    assert set(BUILTIN_REWARDS) == {"math", "exact_match"}
    fn = get_reward_fn("math")
    assert asyncio.run(fn(_sample("so \\boxed{1/2}", 0.5))) == 1.0
    assert asyncio.run(get_reward_fn("exact_match")(_sample("yes ", "yes"))) == 1.0


def test_unknown_reward_name():
    with pytest.raises(ValueError, match="unknown reward 'mathh'.*exact_match, math"):
        get_reward_fn("mathh")


_counter = itertools.count()

USER_MODULE = """
import asyncio


def sync_reward(sample):
    return 1.0 if sample.label in sample.response else 0.0


async def async_reward(sample):
    await asyncio.sleep(0)
    return float(len(sample.response))


def dict_reward(sample):
    return {"score": 0.5, "length": len(sample.response)}


def raising_reward(sample):
    if sample.label == "bad":
        raise RuntimeError("grader crashed on " + sample.response)
    return 1.0


async def slow_reward(sample):
    if sample.label == "slow":
        await asyncio.sleep(30)
    return 1.0


def string_reward(sample):
    return "1.0"


def nan_reward(sample):
    return float("nan")


async def own_timeout_reward(sample):
    raise TimeoutError("remote grader timed out")


NOT_CALLABLE = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A fresh, uniquely named module of reward functions importable from sys.path."""
    name = f"tidal_test_user_rewards_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_user_sync_and_async_functions(user_module):
    sync_fn = get_reward_fn(f"{user_module}:sync_reward")
    assert asyncio.run(sync_fn(_sample("the answer is cat", "cat"))) == 1.0
    async_fn = get_reward_fn(f"{user_module}.async_reward")
    assert asyncio.run(async_fn(_sample("abcd"))) == 4.0


def test_user_function_errors(user_module):
    with pytest.raises(ImportError, match="no attribute 'missing'"):
        get_reward_fn(f"{user_module}:missing")
    with pytest.raises(ValueError, match="not callable"):
        get_reward_fn(f"{user_module}:NOT_CALLABLE")


def test_score_samples_sync_async_dict(user_module):
    samples = [_sample("a cat", "cat"), _sample("a dog", "cat")]
    assert asyncio.run(score_samples(samples, get_reward_fn(f"{user_module}:sync_reward"))) == 0
    assert [s.reward for s in samples] == [1.0, 0.0]

    samples = [_sample("xyz"), _sample("")]
    assert asyncio.run(score_samples(samples, f"{user_module}:async_reward")) == 0
    assert [s.reward for s in samples] == [3.0, 0.0]

    s = _sample("hello")
    assert asyncio.run(score_samples([s], get_reward_fn(f"{user_module}:dict_reward"))) == 0
    assert s.reward == {"score": 0.5, "length": 5}
    assert s.status == Status.COMPLETED
    assert scalar_reward(s) == 0.5
    assert scalar_reward(s, key="length") == 5.0
    with pytest.raises(KeyError, match="'acc'.*available keys: \\['length', 'score'\\]"):
        scalar_reward(s, key="acc")


def test_raising_reward_marks_failed_and_continues(user_module):
    samples = [_sample("ok", "good"), _sample("oops", "bad"), _sample("fine", "good")]
    failures = asyncio.run(score_samples(samples, get_reward_fn(f"{user_module}:raising_reward")))
    assert failures == 1
    assert [s.status for s in samples] == [Status.COMPLETED, Status.FAILED, Status.COMPLETED]
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    assert samples[1].metadata["error"] == "RuntimeError: grader crashed on oops"
    assert "error" not in samples[0].metadata


def test_timeout_marks_failed(user_module):
    samples = [_sample("a", "slow"), _sample("b", "fast")]
    start = time.monotonic()
    failures = asyncio.run(score_samples(samples, get_reward_fn(f"{user_module}:slow_reward"), timeout=0.2))
    assert time.monotonic() - start < 10  # generous: the slow reward would take 30 s
    assert failures == 1
    assert samples[0].status == Status.FAILED and samples[0].reward == 0.0
    assert samples[0].metadata["error"].startswith("TimeoutError:")
    assert "0.2 s" in samples[0].metadata["error"]
    assert samples[1].status == Status.COMPLETED and samples[1].reward == 1.0


def test_reward_function_own_timeout_error_is_kept(user_module):
    s = _sample("a")
    assert asyncio.run(score_samples([s], f"{user_module}:own_timeout_reward", timeout=5)) == 1
    assert s.metadata["error"] == "TimeoutError: remote grader timed out"


def test_bad_return_types_fail(user_module):
    s = _sample("a")
    assert asyncio.run(score_samples([s], get_reward_fn(f"{user_module}:string_reward"))) == 1
    assert s.status == Status.FAILED and s.reward == 0.0
    assert s.metadata["error"] == "TypeError: reward function returned str, expected a number or a dict"
    s = _sample("a")
    assert asyncio.run(score_samples([s], get_reward_fn(f"{user_module}:nan_reward"))) == 1
    assert "not finite" in s.metadata["error"]


def test_already_failed_samples_are_skipped():
    calls = []

    async def reward(sample):
        calls.append(sample.index)
        return 1.0

    gen_failed = _sample("", index=0, status=Status.FAILED, metadata={"error": "engine died"})
    gen_failed.reward = None
    ok = _sample("x", index=1)
    assert asyncio.run(score_samples([gen_failed, ok], reward)) == 0
    assert calls == [1]
    assert gen_failed.reward is None and gen_failed.metadata["error"] == "engine died"
    assert ok.reward == 1.0


def test_concurrency_is_bounded():
    active = 0
    peak = 0

    async def reward(sample):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.01)
        active -= 1
        return 1.0

    samples = [_sample(str(i)) for i in range(20)]
    assert asyncio.run(score_samples(samples, reward, max_concurrency=3)) == 0
    assert peak == 3
    assert all(s.reward == 1.0 for s in samples)
    with pytest.raises(ValueError, match="max_concurrency"):
        asyncio.run(score_samples(samples, reward, max_concurrency=0))


def test_scalar_reward_plain_and_missing():
    assert scalar_reward(_sample(reward=1)) == 1.0
    assert isinstance(scalar_reward(_sample(reward=1)), float)
    with pytest.raises(ValueError, match="no reward"):
        scalar_reward(_sample())
    # generation failed -> never scored -> 0.0 (it is excluded from advantages by the valid mask)
    assert scalar_reward(_sample(status=Status.FAILED), key="score") == 0.0
