"""GRPO advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.algo import grpo_advantages


def test_grpo_unbiased_std_two_groups():
    # Group 1: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735;
    # 0.5 / 0.57735 = 0.8660. Group 2: all equal -> all 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, group_size=4, eps=0.0)
    expected = torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_grpo_eps_is_added_to_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    adv = grpo_advantages(rewards, group_size=4, eps=1e-6)
    # 0.5 / (sqrt(1/3) + 1e-6)
    assert adv[0].item() == pytest.approx(0.8660239037870365, abs=1e-12)


def test_grpo_odd_values():
    # mean 2, deviations [1, -1, 0], unbiased var = 2 / 2 = 1, std = 1.
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 2.0]), group_size=3, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0]))


def test_dr_grpo_without_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, group_size=4, std_normalize=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))


def test_valid_mask_excludes_entries_even_nan():
    # Valid members 1, 0, 0.5: mean 0.5, deviations [0.5, -0.5, 0], unbiased var 0.5/2 = 0.25, std 0.5.
    rewards = torch.tensor([1.0, 0.0, float("nan"), 0.5])
    valid = torch.tensor([True, True, False, True])
    adv = grpo_advantages(rewards, group_size=4, eps=0.0, valid=valid)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))
    adv = grpo_advantages(rewards, group_size=4, std_normalize=False, valid=valid)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_groups_with_fewer_than_two_valid_members_are_zero():
    rewards = torch.tensor([5.0, 1.0, 2.0, 3.0, 7.0, 0.0])
    valid = torch.tensor([True, False, False, False, False, False])  # 1 valid, then 0 valid
    adv = grpo_advantages(rewards, group_size=3, valid=valid)
    assert torch.equal(adv, torch.zeros(6))
    # group_size 1: every group has one member
    adv = grpo_advantages(torch.tensor([0.3, -2.0, 9.0]), group_size=1)
    assert torch.equal(adv, torch.zeros(3))


def test_integer_rewards_and_shape():
    adv = grpo_advantages(torch.tensor([1, 0]), group_size=2, eps=0.0)
    assert adv.dtype == torch.float32
    # mean 0.5, unbiased std = sqrt(0.5) -> +-0.5/0.70711 = +-0.70711
    torch.testing.assert_close(adv, torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2)]))


@pytest.mark.parametrize(
    "rewards,group_size,match",
    [
        (torch.zeros(6), 4, "divisible"),
        (torch.zeros(4), 0, "group_size"),
        (torch.zeros(2, 2), 2, "1-D"),
    ],
)
def test_grpo_errors(rewards, group_size, match):
    with pytest.raises(ValueError, match=match):
        grpo_advantages(rewards, group_size)


def test_valid_shape_mismatch():
    with pytest.raises(ValueError, match="valid"):
        grpo_advantages(torch.zeros(4), 2, valid=torch.ones(3, dtype=torch.bool))


def test_equal_rewards_give_zero_without_rounding_noise():
    # 0.1 is not exact in binary; the group mean must still cancel to ~0, not (1e-9)/(1e-9 + eps).
    adv = grpo_advantages(torch.full((3,), 0.1), group_size=3)
    assert adv.abs().max().item() < 1e-9
    # eps=0 on a zero-spread group is 0, not 0/0
    assert torch.equal(grpo_advantages(torch.ones(4), group_size=4, eps=0.0), torch.zeros(4))
