"""Ragged groups: prompts with different numbers of samples, from the estimators to the optimizer
batches, dynamic sampling and the loop. Every expected value is worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.algo import group_ids, groups_with_signal, grpo_advantages, reinforce_pp_baseline_advantages, rloo_advantages
from tidal.algo.options import AlgoConfig
from tidal.contracts import GenerationOutput
from tidal.data.dataset import PromptRecord
from tidal.reward.options import RewardConfig
from tidal.rollout.collect import collect, rollout_metrics
from tidal.rollout.manager import RolloutManager, group_size, group_sizes
from tidal.rollout.options import RolloutConfig
from tidal.train.update import batch_normalizers, optimizer_batches
from tidal.types import Sample

NAN = float("nan")
R2 = math.sqrt(2.0)

# groups of 1, 2 and 3 samples: [5] [1, 3] [0, 2, 4]
SIZES = [1, 2, 3]
REWARDS = torch.tensor([5.0, 1.0, 3.0, 0.0, 2.0, 4.0])
# the same, with the middle sample of the 3-group invalid (NaN reward) and a 2-group [7, NaN]
# whose second sample is invalid: it has one valid member left
SIZES_INVALID = [1, 2, 3, 2]
REWARDS_INVALID = torch.tensor([5.0, 1.0, 3.0, 0.0, NAN, 4.0, 7.0, NAN])
VALID = torch.tensor([True, True, True, True, False, True, True, False])


def test_group_ids_for_equal_and_ragged_groups():
    ids, g = group_ids(SIZES, 6)
    assert (ids.tolist(), g) == ([0, 1, 1, 2, 2, 2], 3)
    ids, g = group_ids(2, 6)
    assert (ids.tolist(), g) == ([0, 0, 1, 1, 2, 2], 3)


def test_grpo_over_groups_of_one_two_and_three():
    # [5]: lone member, 0. [1, 3]: mean 2, std sqrt(2). [0, 2, 4]: mean 2, std sqrt(8 / 2) = 2.
    adv = grpo_advantages(REWARDS, SIZES, eps=0.0)
    assert adv.tolist() == pytest.approx([0.0, -1 / R2, 1 / R2, -1.0, 0.0, 1.0], abs=1e-7)


def test_grpo_with_invalid_samples():
    # [0, x, 4]: valid {0, 4}, mean 2, std sqrt((4 + 4) / 1) = 2 sqrt(2); [7, x]: one valid, 0
    adv = grpo_advantages(REWARDS_INVALID, SIZES_INVALID, eps=0.0, valid=VALID)
    assert adv.tolist() == pytest.approx([0.0, -1 / R2, 1 / R2, -1 / R2, 0.0, 1 / R2, 0.0, 0.0], abs=1e-7)


def test_dr_grpo_is_the_centred_reward_per_group():
    assert grpo_advantages(REWARDS, SIZES, std_normalize=False).tolist() == [0.0, -1.0, 1.0, -2.0, 0.0, 2.0]
    adv = grpo_advantages(REWARDS_INVALID, SIZES_INVALID, std_normalize=False, valid=VALID)
    assert adv.tolist() == [0.0, -1.0, 1.0, -2.0, 0.0, 2.0, 0.0, 0.0]


def test_rloo_leaves_one_out_within_each_group():
    # [1, 3]: 1 - 3, 3 - 1. [0, 2, 4]: 0 - (2 + 4) / 2, 2 - (0 + 4) / 2, 4 - (0 + 2) / 2.
    assert rloo_advantages(REWARDS, SIZES).tolist() == [0.0, -2.0, 2.0, -3.0, 0.0, 3.0]
    # [0, x, 4]: the others of 0 are {4}, of 4 are {0}; [7, x] has no other valid member
    assert rloo_advantages(REWARDS_INVALID, SIZES_INVALID, valid=VALID).tolist() == [
        0.0,
        -2.0,
        2.0,
        -4.0,
        0.0,
        4.0,
        0.0,
        0.0,
    ]


def test_reinforce_pp_baseline_centres_per_group_then_whitens_the_batch():
    # one token per row: G = R' = [0, -1, 1, -2, 0, 2], mean 0, unbiased var 10 / 5 = 2
    adv = reinforce_pp_baseline_advantages(REWARDS, SIZES, torch.ones(6, 1))
    assert adv[:, 0].tolist() == pytest.approx([0.0, -1 / R2, 1 / R2, -R2, 0.0, R2], abs=1e-7)


def test_a_list_of_equal_sizes_is_the_int_case():
    r = torch.tensor([1.0, 0.0, 0.5, 0.25, 1.0, 1.0])
    assert torch.equal(grpo_advantages(r, [3, 3]), grpo_advantages(r, 3))
    assert torch.equal(rloo_advantages(r, [2, 2, 2]), rloo_advantages(r, 2))


def test_groups_with_signal_on_ragged_groups():
    # [5]: one member; [1, 1]: equal; [0, x, 4]: spread; [7, x]: one valid member
    r = torch.tensor([5.0, 1.0, 1.0, 0.0, NAN, 4.0, 7.0, NAN])
    assert groups_with_signal(r, SIZES_INVALID, VALID).tolist() == [False, False, True, False]


@pytest.mark.parametrize(
    "sizes,match",
    [([2, 3], "sum to 5, not to the 6"), ([0, 6], "must be >= 1"), ([7], "sum to 7")],
)
def test_sizes_must_split_the_batch(sizes, match):
    with pytest.raises(ValueError, match=match):
        grpo_advantages(REWARDS, sizes)


def samples_in(groups: list[int]) -> list[Sample]:
    return [
        Sample(tokens=[1, 2], response_length=1, loss_mask=[1], group_index=g, index=i) for i, g in enumerate(groups)
    ]


def test_group_size_and_sizes_of_a_batch():
    ragged = samples_in([0, 0, 1, 2, 2, 2])
    assert group_sizes(ragged) == [2, 1, 3]
    assert group_size(ragged) == [2, 1, 3]
    assert group_size(samples_in([0, 0, 1, 1])) == 2  # equal groups: the int, as before
    assert group_sizes([]) == [] and group_size([]) == 0
    with pytest.raises(ValueError, match="samples of group 0 are not contiguous"):
        group_sizes(samples_in([0, 1, 0]))


def test_equal_reward_groups_counts_groups_of_any_size():
    # [1]: one sample, never counted; [1, 1]: equal; [0, 1, 1]: not
    metrics = rollout_metrics(samples_in([0, 1, 1, 2, 2, 2]), torch.tensor([1.0, 1, 1, 0, 1, 1]), [1, 2, 3])
    assert metrics["reward/equal_reward_groups"] == pytest.approx(1 / 3)
    equal = rollout_metrics(samples_in([0, 0, 1, 1]), torch.tensor([1.0, 1, 0, 1]), 2)
    assert equal["reward/equal_reward_groups"] == 0.5


def test_optimizer_batches_equal_groups_are_runs_of_the_batch_size():
    assert optimizer_batches([4, 4, 4, 4], 8) == [list(range(8)), list(range(8, 16))]
    assert optimizer_batches([4, 4], 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # as before: groups may span
    with pytest.raises(ValueError, match="7 samples is not a multiple of global_batch_size 8"):
        optimizer_batches([7], 8)


def test_optimizer_batches_ragged_groups_are_whole_prompts():
    assert optimizer_batches([1, 2, 3], 3) == [[0, 1, 2], [3, 4, 5]]
    # 3 + 1 fit in 4; then 2 + 2
    assert optimizer_batches([3, 1, 2, 2], 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # a group of 5 > 4 is a batch alone; 1 + 2 then fit; 1 + 2 + 3 would not
    assert optimizer_batches([5, 1, 2, 3], 4) == [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10]]


def test_normalizers_count_what_each_ragged_batch_holds():
    # groups [1, 2] | [3, 1] with gbs 4; response lengths 2, 1, 3, 2, 0 (nothing trained), 1, 2
    lengths = [2, 1, 3, 2, 0, 1, 2]
    mask = torch.tensor([[1.0] * n + [0.0] * (3 - n) for n in lengths])
    first, second = optimizer_batches([1, 2, 3, 1], 4)
    assert (first, second) == ([0, 1, 2], [3, 4, 5, 6])
    assert batch_normalizers(mask[first], "token_mean", 8) == {"num_tokens": 6.0, "num_seqs": 3.0}
    assert batch_normalizers(mask[second], "token_mean", 8) == {"num_tokens": 5.0, "num_seqs": 3.0}
    # Dr. GRPO's constant: the batch's own samples (3, then 4, the empty one included) times L
    assert batch_normalizers(mask[first], "seq_mean_token_sum_norm", 8) == {"num_seqs": 3.0, "max_len": 8}
    assert batch_normalizers(mask[second], "seq_mean_token_sum_norm", 8) == {"num_seqs": 4.0, "max_len": 8}


# ---------------------------------------------------------------------------------------------
# Dynamic sampling keeps whole groups of any size


async def fan_out(ctx, sample: Sample, sampling) -> list[Sample]:
    """Prompt k becomes k % 3 + 1 samples (1, 2 or 3), each one engine call."""
    out = []
    for _ in range(sample.metadata["prompt_index"] % 3 + 1):
        s = Sample(tokens=list(sample.tokens), label=sample.label, metadata=dict(sample.metadata))
        o = await ctx.generate(s.tokens, sampling)
        s.append_policy(o.token_ids, o.log_probs, o.weight_version)
        out.append(s)
    return out


async def position_reward(sample: Sample) -> float:
    """Prompt 2's samples differ (their batch positions 3, 4, 5); every other prompt's are all equal.
    (async: runs on the rollout's loop, not in a reward worker process)"""
    k = sample.metadata["prompt_index"]
    return float(sample.index) if k == 2 else float(k)


class Engine:
    weight_version = 0

    async def generate(self, input_ids, sampling, *, request_id=None, group=None):
        return GenerationOutput([7], [-0.5], "stop", "x", 0)


class Source:
    def __init__(self, n: int) -> None:
        self.records = [PromptRecord(index=i, prompt=str(i), text=str(i), input_ids=[i + 1]) for i in range(n)]
        self.taken = 0

    def next_batch(self, n: int | None = None) -> list[PromptRecord]:
        out = self.records[self.taken : self.taken + n]
        self.taken += n
        return out


def test_dynamic_sampling_keeps_whole_ragged_groups():
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=1, generate="test_ragged_groups:fan_out")
    manager = RolloutManager(Engine(), cfg, reward=RewardConfig(fn="test_ragged_groups:position_reward"))
    try:
        algo = AlgoConfig(dynamic_sampling=True, max_sampling_rounds=2, oversample=1.5)
        samples, metrics = collect(Source(6), manager, 0, algo, "score")
    finally:
        manager.close()
    # round 1: prompts 0, 1, 2 (1, 2, 3 samples): only prompt 2's group has a signal. Round 2:
    # prompts 3, 4 (1, 2 samples): none. Kept: prompt 2; topped up with prompt 0's dropped group.
    assert [(s.metadata["prompt_index"], s.group_index, s.index) for s in samples] == [
        (2, 0, 0),
        (2, 0, 1),
        (2, 0, 2),
        (0, 1, 3),
    ]
    assert group_sizes(samples) == [3, 1]
    assert metrics == {
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/groups_sampled": 5.0,
        "dynamic_sampling/groups_kept": 1.0,
        "dynamic_sampling/filled_without_signal": 1.0,
    }
