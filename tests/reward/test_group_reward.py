"""reward.group_fn: one call per prompt's group with exactly its samples, its rewards landing on
them in order, and a wrong answer (length, type, NaN) failing that group with an exact message."""

from __future__ import annotations

import asyncio
import math

import pytest

from tidal.config import Config, validate
from tidal.contracts import GenerationOutput
from tidal.data.dataset import PromptRecord
from tidal.options import ConfigError
from tidal.reward.failures import ErrorLog
from tidal.reward.group import load_group_reward, score_groups
from tidal.reward.options import RewardConfig
from tidal.rollout.manager import RolloutManager
from tidal.rollout.options import RolloutConfig
from tidal.types import Sample, Status

# Group rewards named by dotted path: pytest imports this file as the module `test_group_reward`.
CALLS: list[list[tuple[int, int, str]]] = []
TRIES: dict[int, int] = {}


async def rank(samples: list[Sample]) -> list[float]:
    """Logs which samples it was given; rewards 10 * group + position, so order is visible."""
    CALLS.append([(s.group_index, s.index, s.response) for s in samples])
    await asyncio.sleep(0)  # a real judge awaits; let other groups interleave
    return [10.0 * s.group_index + j for j, s in enumerate(samples)]


def sync_rank(samples: list[Sample]) -> list[float | dict]:
    return [{"score": float(j), "seen": s.reward} for j, s in enumerate(samples)]


def short(samples: list[Sample]) -> list[float]:
    return [1.0] * (len(samples) - 1 if samples[0].group_index == 1 else len(samples))


def as_dict(samples: list[Sample]) -> dict:
    return {"score": 1.0}


def with_nan(samples: list[Sample]) -> list[float]:
    return [0.5, math.nan, 0.5]


async def flaky(samples: list[Sample]) -> list[float]:
    g = samples[0].group_index
    TRIES[g] = TRIES.get(g, 0) + 1
    if TRIES[g] == 1:
        raise ConnectionError("judge hung up")
    return [0.25] * len(samples)


class Engine:
    """Answers its i-th request with the text `answer i`."""

    weight_version = 0

    def __init__(self) -> None:
        self.n = 0

    async def generate(self, input_ids, sampling, *, request_id=None, group=None):
        i, self.n = self.n, self.n + 1
        return GenerationOutput([100 + i], [-0.5], "stop", f"answer {i}", 0)


def group(g: int, n: int = 3) -> list[Sample]:
    return [Sample(response=f"r{g}{j}", group_index=g, index=g * n + j) for j in range(n)]


def test_called_once_per_group_with_exactly_its_samples():
    CALLS.clear()
    records = [PromptRecord(index=i, prompt=p, text=p, input_ids=[i + 1], label="x") for i, p in enumerate("ab")]
    cfg = RolloutConfig(n_samples_per_prompt=3)
    manager = RolloutManager(Engine(), cfg, reward=RewardConfig(group_fn="test_group_reward:rank"))
    try:
        samples = manager.generate(records, step=0)
    finally:
        manager.close()
    assert manager.reward_fn is None  # the group reward scores instead of reward.fn
    assert sorted(CALLS) == [
        [(0, 0, "answer 0"), (0, 1, "answer 1"), (0, 2, "answer 2")],
        [(1, 3, "answer 3"), (1, 4, "answer 4"), (1, 5, "answer 5")],
    ]
    assert [s.reward for s in samples] == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
    assert all(s.status == Status.COMPLETED for s in samples)


def test_overrides_generate_rewards_and_skips_failed_generations():
    samples = group(0)
    samples[0].reward = 5.0  # set by a generate function: the group reward sees it, and replaces it
    samples[2].status, samples[2].reward = Status.FAILED, 0.0  # generation failed: not given to the judge
    failed = asyncio.run(score_groups(samples, load_group_reward("test_group_reward:sync_rank")))
    assert failed == 0
    assert [s.reward for s in samples] == [{"score": 0.0, "seen": 5.0}, {"score": 1.0, "seen": None}, 0.0]


def test_wrong_length_fails_that_group_only():
    samples = group(0) + group(1)
    errors = ErrorLog()
    failed = asyncio.run(score_groups(samples, load_group_reward("test_group_reward:short"), errors=errors))
    assert failed == 3
    assert [s.status for s in samples] == [Status.COMPLETED] * 3 + [Status.FAILED] * 3
    assert [s.reward for s in samples] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    for s in samples[3:]:
        assert s.metadata["error"] == (
            "ValueError: group reward test_group_reward:short returned 2 rewards for a group of 3 samples; "
            "expected one per sample, in order"
        )
    assert errors.total == {"ValueError": 3}


def test_wrong_type_and_non_finite_rewards():
    samples = group(0)
    asyncio.run(score_groups(samples, load_group_reward("test_group_reward:as_dict")))
    assert samples[0].metadata["error"] == (
        "TypeError: group reward test_group_reward:as_dict returned dict, expected a list of 3 rewards "
        "(numbers or dicts)"
    )
    samples = group(0)
    asyncio.run(score_groups(samples, load_group_reward("test_group_reward:with_nan")))
    assert [s.metadata["error"] for s in samples] == [
        "ValueError: group reward test_group_reward:with_nan, reward 1 of 3: reward is not finite: nan"
    ] * 3
    assert all(s.status == Status.FAILED and s.reward == 0.0 for s in samples)


def test_retryable_errors_retry_the_whole_group():
    TRIES.clear()
    samples = group(0) + group(1)
    fn = load_group_reward("test_group_reward:flaky")
    assert asyncio.run(score_groups(samples, fn, retries=1, backoff=0.0)) == 0
    assert TRIES == {0: 2, 1: 2}
    assert [(s.reward, s.metadata["reward_retries"]) for s in samples] == [(0.25, 1)] * 6


def test_config_refuses_both_rewards_and_a_bad_path():
    cfg = Config()
    cfg.reward.group_fn = "my_judges:rank"
    validate(cfg)  # with reward.fn left at its default
    cfg.reward.fn = "exact_match"
    with pytest.raises(ConfigError) as exc:
        validate(cfg)
    assert str(exc.value).split("\n")[1:] == [
        "  reward.group_fn: scores instead of reward.fn; set one of them, not both (reward.fn is 'exact_match')"
    ]
    cfg.reward.fn, cfg.reward.group_fn = "math", "rank"
    with pytest.raises(ConfigError, match=r"reward.group_fn: a dotted path or file.py:fn, got 'rank'$"):
        validate(cfg)
