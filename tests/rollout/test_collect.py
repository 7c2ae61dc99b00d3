"""Dynamic sampling in `collect`: the built-in rule (rewards not all equal) and a user
`algo.dynamic_sampling_filter` that replaces it."""

from __future__ import annotations

import pytest

from tidal.algo.options import AlgoConfig
from tidal.config import Config, validate
from tidal.contracts import GenerationOutput
from tidal.data.dataset import PromptRecord
from tidal.options import ConfigError
from tidal.reward.options import RewardConfig
from tidal.rollout.collect import collect
from tidal.rollout.manager import RolloutManager
from tidal.rollout.options import RolloutConfig
from tidal.types import Sample

LABELS = ["0.9", "0.2", "0.7", "0.4", "0.8", "0.1"]
SEEN: list[list[str]] = []


async def label_reward(sample: Sample) -> float:
    """Every sample of a prompt gets the prompt's label: no group has a signal by the built-in rule."""
    return float(sample.label)


def first_above_half(group: list[Sample]) -> bool:
    SEEN.append([s.label for s in group])
    return group[0].reward > 0.5


def not_a_bool(group: list[Sample]) -> int:
    return 1


class Engine:
    weight_version = 0

    async def generate(self, input_ids, sampling, *, request_id=None, group=None):
        return GenerationOutput([7], [-0.5], "stop", "x", 0)


class Source:
    """Prompts in order, one per label."""

    def __init__(self) -> None:
        self.records = [
            PromptRecord(index=i, prompt=str(i), text=str(i), input_ids=[i + 1], label=label)
            for i, label in enumerate(LABELS)
        ]
        self.taken = 0

    def next_batch(self, n: int | None = None) -> list[PromptRecord]:
        out = self.records[self.taken : self.taken + n]
        self.taken += n
        return out


def run(algo: AlgoConfig) -> tuple[list[Sample], dict[str, float]]:
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2)
    manager = RolloutManager(Engine(), cfg, reward=RewardConfig(fn="test_collect:label_reward"))
    try:
        return collect(Source(), manager, 0, algo, "score")
    finally:
        manager.close()


def test_builtin_rule_drops_groups_whose_rewards_are_equal():
    samples, metrics = run(AlgoConfig(dynamic_sampling=True))
    assert [s.label for s in samples] == ["0.9", "0.9", "0.2", "0.2"]  # topped up with dropped groups
    assert metrics == {
        "dynamic_sampling/rounds": 3.0,
        "dynamic_sampling/groups_sampled": 6.0,
        "dynamic_sampling/groups_kept": 0.0,
        "dynamic_sampling/filled_without_signal": 2.0,
    }


def test_user_filter_replaces_the_builtin_rule():
    SEEN.clear()
    samples, metrics = run(AlgoConfig(dynamic_sampling=True, dynamic_sampling_filter="test_collect:first_above_half"))
    assert SEEN == [["0.9", "0.9"], ["0.2", "0.2"], ["0.7", "0.7"]]  # each group once, scored, in order
    assert [(s.label, s.reward, s.group_index, s.index) for s in samples] == [
        ("0.9", 0.9, 0, 0),
        ("0.9", 0.9, 0, 1),
        ("0.7", 0.7, 1, 2),
        ("0.7", 0.7, 1, 3),
    ]
    assert metrics == {
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/groups_sampled": 3.0,
        "dynamic_sampling/groups_kept": 2.0,
        "dynamic_sampling/filled_without_signal": 0.0,
    }


def test_a_filter_must_answer_a_bool():
    algo = AlgoConfig(dynamic_sampling=True, dynamic_sampling_filter="test_collect:not_a_bool")
    with pytest.raises(TypeError) as exc:
        run(algo)
    assert str(exc.value) == (
        "algo.dynamic_sampling_filter: test_collect:not_a_bool returned int, expected a bool (True keeps the group)"
    )


def test_config_needs_dynamic_sampling():
    cfg = Config()
    cfg.algo.dynamic_sampling_filter = "my_filters:keep"
    with pytest.raises(ConfigError) as exc:
        validate(cfg)
    assert str(exc.value).split("\n")[1:] == [
        "  algo.dynamic_sampling_filter: only used by dynamic sampling; set algo.dynamic_sampling true"
    ]
    cfg.algo.dynamic_sampling = True
    validate(cfg)
