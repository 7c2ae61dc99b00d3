"""RolloutManager against a scripted engine: the Sample contract, seeds and reward failures."""

import re

import pytest

from tidal.contracts import GenerationOutput
from tidal.data.dataset import PromptRecord
from tidal.reward.failures import TooManyFailedSamples
from tidal.reward.options import RewardConfig
from tidal.rollout.manager import RolloutManager, sample_seed
from tidal.rollout.options import RolloutConfig, SamplingConfig
from tidal.types import Status


class ScriptedEngine:
    """Answers its i-th request with tokens [100+i, 101+i] and a finish reason cycling
    stop/length/abort (requests arrive in sample order: each sample's task starts in that order)."""

    weight_version = 7

    def __init__(self):
        self.prompts, self.params, self.groups = [], [], []

    async def generate(self, input_ids, sampling, *, request_id=None, group=None):
        i = len(self.prompts)
        self.prompts.append(list(input_ids))
        self.params.append(sampling)
        self.groups.append(group)
        reasons = ["stop", "length", "abort"]
        return GenerationOutput([100 + i, 101 + i], [-0.5, -1.5], reasons[i % 3], f"answer {i}", self.weight_version)


def records():
    return [
        PromptRecord(index=10, prompt="a", text="A", input_ids=[1, 2, 3], label="0", metadata={"k": 1}),
        PromptRecord(index=11, prompt="b", text="B", input_ids=[4, 5], label="1"),
    ]


def test_samples_follow_the_contract():
    engine = ScriptedEngine()
    cfg = RolloutConfig(n_samples_per_prompt=3, max_new_tokens=5)
    sampling, reward = SamplingConfig(temperature=0.7, seed=4), RewardConfig(fn="exact_match")
    samples = RolloutManager(engine, cfg, sampling=sampling, reward=reward).generate(records(), step=2)
    prompts, params = engine.prompts, engine.params
    assert prompts == [[1, 2, 3]] * 3 + [[4, 5]] * 3
    assert len(set(engine.groups)) == 2 and engine.groups[:3] == [engine.groups[0]] * 3  # a group's key
    assert [p.seed for p in params] == [sample_seed(4, 2, i) for i in range(6)]
    assert len({p.seed for p in params}) == 6
    assert all(p.temperature == 0.7 and p.max_new_tokens == 5 for p in params)
    s = samples[4]
    assert s.tokens == [4, 5, 104, 105] and s.response_length == 2 and s.prompt_length == 2
    assert s.loss_mask == [1, 1] and s.rollout_log_probs == [-0.5, -1.5]
    assert (s.group_index, s.index, s.weight_version, s.label, s.prompt) == (1, 4, 7, "1", "B")
    assert s.metadata == {"prompt_index": 11, "finish_reason": "length"}
    assert samples[0].metadata == {"k": 1, "prompt_index": 10, "finish_reason": "stop"}
    assert [x.status for x in samples[:3]] == [Status.COMPLETED, Status.TRUNCATED, Status.ABORTED]
    assert [x.reward for x in samples] == [0.0] * 6  # "answer i" never equals the label
    for x in samples:
        x.validate()


def test_seeds_depend_on_step_and_index_only():
    assert sample_seed(0, 1, 2) == sample_seed(0, 1, 2)
    assert len({sample_seed(0, st, i) for st in range(20) for i in range(64)}) == 20 * 64
    assert sample_seed(1, 0, 0) != sample_seed(0, 0, 0)
    assert 0 <= sample_seed(2**40, 2**30, 2**20) < 2**63


def test_a_failing_reward_zeroes_the_loss_mask(tmp_path, monkeypatch):
    (tmp_path / "bad_reward.py").write_text("def score(sample):\n    raise ValueError('no label parser')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = RolloutConfig(n_samples_per_prompt=2, max_failed_ratio=1.0)
    samples = RolloutManager(ScriptedEngine(), cfg, reward=RewardConfig(fn="bad_reward:score")).generate(
        records(), step=0
    )
    assert all(s.status == Status.FAILED for s in samples)
    assert all(s.loss_mask == [0, 0] for s in samples)
    assert samples[0].metadata["error"] == "ValueError: no label parser"


def test_a_dict_reward_without_reward_key_is_named_on_the_first_batch(tmp_path, monkeypatch):
    from tidal.options import ConfigError

    (tmp_path / "dict_reward.py").write_text("def score(sample):\n    return {'acc': 1.0, 'format': 0.5}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg, reward = RolloutConfig(n_samples_per_prompt=2), RewardConfig(fn="dict_reward:score")  # key left at 'score'
    with pytest.raises(ConfigError) as err:
        RolloutManager(ScriptedEngine(), cfg, reward=reward).generate(records(), step=0)
    assert str(err.value) == (
        "reward.key: the reward returned a dict without the key 'score' (sample 0: keys ['acc', 'format']); "
        "set reward.key to the entry to train on, e.g. --reward.key=acc"
    )
    reward.key = "format"
    samples = RolloutManager(ScriptedEngine(), cfg, reward=reward).generate(records(), step=0)
    assert [s.reward["format"] for s in samples] == [0.5] * 4


def test_a_reward_failing_everywhere_stops_the_run(tmp_path, monkeypatch, caplog):
    """The new user's case: a reward that raises on every sample is an error naming the share, the
    threshold and the first exception, which the console has shown once."""
    (tmp_path / "bad_reward2.py").write_text("def score(sample):\n    raise ValueError('no label parser')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg, reward = RolloutConfig(n_samples_per_prompt=2), RewardConfig(fn="bad_reward2:score")
    with caplog.at_level("WARNING", logger="tidal"):
        with pytest.raises(TooManyFailedSamples) as err:
            RolloutManager(ScriptedEngine(), cfg, reward=reward).generate(records(), step=0)
    assert str(err.value) == (
        "4 of 4 samples failed (100%), more than rollout.max_failed_ratio 0.5; "
        "first error (sample 0): ValueError: no label parser"
    )
    # the calls run at once: the first to fail is shown, whichever sample it was
    first, summary = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(
        r"reward failed on sample [0-3] \(prompt 1[01]\): ValueError: no label parser "
        r"\(further ValueError errors are counted, not shown\)",
        first,
    )
    assert summary == "reward errors this step: ValueError x4 (run total 4)"
