"""compute_advantages: the configured estimator applied to a scored rollout, checked against
numbers worked out by hand.

Four samples in two groups of two; R = 4 response positions with ragged lengths and a masked span:

    sample  mask       reward  group
    0       1 1 1 .    1       0
    1       1 1 . .    0       0
    2       1 0 0 1    3       1      (positions 1-2: a masked, tool-output-like span)
    3       1 . . .    1       1      (. = past the end of the response)
"""

import math
import re
import statistics

import pytest
import torch

from tidal.algo.options import AlgoConfig
from tidal.train.estimate import compute_advantages
from tidal.types import Sample

MASKS = [[1, 1, 1], [1, 1], [1, 0, 0, 1], [1]]
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 1], [1, 0, 0, 0]], dtype=torch.float32)
REWARDS = torch.tensor([1.0, 0.0, 3.0, 1.0])
VALID = torch.ones(4, dtype=torch.bool)
GROUP = 2


def make_samples():
    return [
        Sample(tokens=[1, 5, 6] + [7] * len(m), response_length=len(m), loss_mask=m, rollout_log_probs=[-1.0] * len(m))
        for m in MASKS
    ]


def advantages(algo, rewards=REWARDS, valid=VALID, **kw):
    return compute_advantages(algo, make_samples(), rewards, valid, GROUP, **kw)


def per_sample(values):
    """[N] per-sample values spread over each sample's mask-true tokens, 0 elsewhere."""
    return torch.tensor(values, dtype=torch.float32)[:, None] * MASK


def assert_close(got, want, atol=1e-6):
    torch.testing.assert_close(got, torch.as_tensor(want, dtype=torch.float32), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------
# group estimators


def test_grpo_normalises_within_each_group():
    # group 0: rewards 1, 0: mean 0.5, unbiased std sqrt(0.5); group 1: 3, 1: mean 2, std sqrt(2)
    a0 = 0.5 / (math.sqrt(0.5) + 1e-6)
    a1 = 1.0 / (math.sqrt(2.0) + 1e-6)
    adv, returns, metrics = advantages(AlgoConfig(advantage="grpo"))
    assert returns is None
    assert metrics == {}
    assert_close(adv, per_sample([a0, -a0, a1, -a1]))
    assert adv.dtype == torch.float32


def test_dr_grpo_only_centres():
    adv, returns, _ = advantages(AlgoConfig(advantage="dr_grpo"))
    assert returns is None
    assert_close(adv, per_sample([0.5, -0.5, 1.0, -1.0]))


def test_rloo_subtracts_the_other_members_mean():
    adv, returns, _ = advantages(AlgoConfig(advantage="rloo"))
    assert returns is None
    assert_close(adv, per_sample([1.0, -1.0, 2.0, -2.0]))


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_gspo_and_cispo_estimators_are_grpo(name):
    assert_close(advantages(AlgoConfig(advantage=name))[0], advantages(AlgoConfig(advantage="grpo"))[0], atol=0)


def kl_inputs():
    """log_probs - ref_log_probs = d, with huge values at masked positions (never read)."""
    d = torch.tensor(
        [
            [0.2, 0.4, 0.6, 100.0],  # sum 1.2
            [1.0, -0.2, 100.0, 100.0],  # sum 0.8
            [0.5, 100.0, 100.0, 0.5],  # sum 1.0
            [2.0, 100.0, 100.0, 100.0],  # sum 2.0
        ]
    )
    ref = torch.full((4, 4), -1.0)
    return ref + d, ref


@pytest.mark.parametrize(
    "name, want",
    [
        # shaped rewards r - 0.5 * sum_t KL_t = 1 - 0.6, 0 - 0.4, 3 - 0.5, 1 - 1.0 = 0.4, -0.4, 2.5, 0
        ("dr_grpo", [0.4, -0.4, 1.25, -1.25]),  # group means 0 and 1.25
        ("rloo", [0.8, -0.8, 2.5, -2.5]),
    ],
)
def test_kl_in_reward_lowers_the_reward_before_grouping(name, want):
    log_probs, ref = kl_inputs()
    algo = AlgoConfig(advantage=name, kl_coef=0.5, kl_kind="k1", kl_in_reward=True)
    adv, _, metrics = advantages(algo, log_probs=log_probs, ref_log_probs=ref)
    assert_close(adv, per_sample(want), atol=1e-5)
    assert metrics["reward/kl_penalty"] == pytest.approx((0.6 + 0.4 + 0.5 + 1.0) / 4, abs=1e-6)


def test_kl_in_reward_needs_both_log_probs():
    log_probs, _ = kl_inputs()
    algo = AlgoConfig(advantage="grpo", kl_coef=0.5, kl_in_reward=True)
    with pytest.raises(ValueError, match="kl_in_reward needs the policy and reference log-probs"):
        advantages(algo, log_probs=log_probs)


def test_kl_off_ignores_log_probs():
    log_probs, ref = kl_inputs()
    adv, _, metrics = advantages(AlgoConfig(advantage="dr_grpo", kl_coef=0.5), log_probs=log_probs, ref_log_probs=ref)
    assert_close(adv, per_sample([0.5, -0.5, 1.0, -1.0]))
    assert "reward/kl_penalty" not in metrics


# ---------------------------------------------------------------------------------------------
# token-level estimators


def whitened(values):
    """Batch whitening of the mask-true values, listed row by row: (x - mean) / (stdev + 1e-8)."""
    mean, std = statistics.mean(values), statistics.stdev(values)
    return [(v - mean) / (std + 1e-8) for v in values]


def spread(rows):
    """Lists of mask-true values, row by row, placed at the mask-true positions."""
    out = torch.zeros(4, 4)
    for i, row in enumerate(rows):
        cols = MASK[i].nonzero()[:, 0].tolist()
        assert len(cols) == len(row)
        out[i, cols] = torch.tensor(row, dtype=torch.float32)
    return out


def test_reinforce_plus_plus_whitens_the_returns_over_the_batch():
    # gamma 1: every mask-true token's return is its sample's reward
    flat = whitened([1, 1, 1, 0, 0, 3, 3, 1])  # mean 1.25, stdev sqrt(9.5 / 7)
    adv, returns, _ = advantages(AlgoConfig(advantage="reinforce_plus_plus", gamma=1.0))
    assert returns is None
    assert_close(adv, spread([flat[0:3], flat[3:5], flat[5:7], flat[7:8]]), atol=1e-5)


def test_reinforce_plus_plus_discounts_over_mask_true_tokens_only():
    # gamma 0.5: returns r * 0.5^(mask-true tokens after t); the masked span is no discount step
    flat = whitened([0.25, 0.5, 1, 0, 0, 1.5, 3, 1])
    adv, _, _ = advantages(AlgoConfig(advantage="reinforce_plus_plus", gamma=0.5))
    assert_close(adv, spread([flat[0:3], flat[3:5], flat[5:7], flat[7:8]]), atol=1e-5)


def test_reinforce_plus_plus_baseline_centres_in_the_group_first():
    # group-centred rewards 0.5, -0.5, 1, -1, then returns (gamma 1) and batch whitening
    flat = whitened([0.5, 0.5, 0.5, -0.5, -0.5, 1, 1, -1])
    adv, returns, _ = advantages(AlgoConfig(advantage="reinforce_plus_plus_baseline"))
    assert returns is None
    assert_close(adv, spread([flat[0:3], flat[3:5], flat[5:7], flat[7:8]]), atol=1e-5)


def test_ppo_with_zero_values_gives_the_reward_at_every_token():
    # GAE with V = 0, gamma = lam = 1 and the reward only at the last token: A_t = R
    algo = AlgoConfig(advantage="ppo", gamma=1.0, lam=1.0)
    adv, returns, _ = advantages(algo, values=torch.zeros(4, 4))
    assert_close(adv, per_sample([1.0, 0.0, 3.0, 1.0]))
    assert returns is not None
    assert_close(returns, adv, atol=0)


def test_ppo_with_constant_values():
    values = torch.full((4, 4), 0.25)
    # lam 1: Monte-Carlo return minus V; the returns are the rewards
    adv, returns, _ = advantages(AlgoConfig(advantage="ppo", gamma=1.0, lam=1.0), values=values)
    assert_close(adv, per_sample([0.75, -0.25, 2.75, 0.75]))
    assert_close(returns, per_sample([1.0, 0.0, 3.0, 1.0]))
    # lam 0: one-step TD errors, r_t + V_next - V_t: 0 before the last mask-true token, R - V on it
    adv, returns, _ = advantages(AlgoConfig(advantage="ppo", gamma=1.0, lam=0.0), values=values)
    last = spread([[0, 0, 1], [0, 1], [0, 1], [1]])
    assert_close(adv, last * (REWARDS - 0.25)[:, None])
    assert_close(returns, adv + 0.25 * MASK)


def test_ppo_needs_values():
    with pytest.raises(ValueError, match="ppo needs critic values"):
        advantages(AlgoConfig(advantage="ppo"))


# ---------------------------------------------------------------------------------------------
# distillation


def test_distillation_adds_the_teacher_minus_student_log_prob_per_token():
    student = torch.tensor(
        [[-1.0, -2.0, -0.5, 9.0], [-1.0, -1.0, 9.0, 9.0], [-3.0, 9.0, 9.0, -1.0], [-2.0, 9.0, 9.0, 9.0]]
    )
    teacher = torch.tensor(
        [[-0.5, -2.5, -0.5, 0.0], [-2.0, -0.8, 0.0, 0.0], [-1.0, 0.0, 0.0, -1.5], [-2.0, 0.0, 0.0, 0.0]]
    )
    algo = AlgoConfig(advantage="dr_grpo", distill_coef=0.5)
    adv, _, metrics = advantages(algo, log_probs=student, teacher_log_probs=teacher)
    distill = 0.5 * torch.tensor(
        [[0.5, -0.5, 0.0, 0.0], [-1.0, 0.2, 0.0, 0.0], [2.0, 0.0, 0.0, -0.5], [0.0, 0.0, 0.0, 0.0]]
    )
    assert_close(adv, per_sample([0.5, -0.5, 1.0, -1.0]) + distill)
    assert metrics["distill/teacher_minus_student"] == pytest.approx(float(distill.sum()) / 8, abs=1e-6)


def test_distillation_needs_the_student_log_probs():
    with pytest.raises(ValueError, match="distillation needs the policy log-probs"):
        advantages(AlgoConfig(), teacher_log_probs=torch.zeros(4, 4))


# ---------------------------------------------------------------------------------------------
# a user estimator given by path

USER_ESTIMATORS = """
import torch


def per_sample(rewards, mask, group_size, samples):
    # uses every argument: [N]
    return rewards * group_size + torch.tensor([float(s.response_length) for s in samples])


def per_token(rewards, mask, group_size, samples):
    return torch.arange(mask.numel(), dtype=torch.float32).view(mask.shape) + 1


def wrong_width(rewards, mask, group_size, samples):
    return torch.zeros(mask.shape[0], mask.shape[1] + 1)


def wrong_length(rewards, mask, group_size, samples):
    return torch.zeros(mask.shape[0] + 1)
"""


@pytest.fixture
def user_file(tmp_path):
    file = tmp_path / "my_estimators.py"
    file.write_text(USER_ESTIMATORS)
    return file


def test_user_estimator_returning_one_value_per_sample_is_broadcast(user_file):
    adv, returns, _ = advantages(AlgoConfig(advantage=f"{user_file}:per_sample"))
    assert returns is None
    # rewards * 2 + response length
    assert_close(adv, per_sample([2.0 + 3, 0.0 + 2, 6.0 + 4, 2.0 + 1]))


def test_user_estimator_returning_per_token_values_is_used_as_is(user_file):
    adv, _, _ = advantages(AlgoConfig(advantage=f"{user_file}:per_token"))
    assert_close(adv, (torch.arange(16.0).view(4, 4) + 1) * MASK, atol=0)


def test_user_estimator_of_the_wrong_shape_is_rejected(user_file):
    name = f"{user_file}:wrong_width"
    msg = f"advantage function {name} returned shape (4, 5); expected [N] = [4] or [N, R] = [4, 4]"
    with pytest.raises(ValueError, match=re.escape(msg)):
        advantages(AlgoConfig(advantage=name))


def test_user_estimator_of_the_wrong_length_is_rejected(user_file):
    name = f"{user_file}:wrong_length"
    msg = f"advantage function {name} returned shape (5,); expected [N] = [4] or [N, R] = [4, 4]"
    with pytest.raises(ValueError, match=re.escape(msg)):
        advantages(AlgoConfig(advantage=name))


# ---------------------------------------------------------------------------------------------
# failed samples


@pytest.mark.parametrize(
    "name, kw",
    [
        ("grpo", {}),
        ("dr_grpo", {}),
        ("rloo", {}),
        ("reinforce_plus_plus", {}),
        ("reinforce_plus_plus_baseline", {}),
        ("ppo", {"values": torch.zeros(4, 4)}),
    ],
)
def test_failed_samples_get_no_advantage(name, kw):
    rewards = torch.tensor([1.0, float("nan"), 3.0, 1.0])  # a failed sample's reward is never read
    valid = torch.tensor([True, False, True, True])
    adv, returns, _ = advantages(AlgoConfig(advantage=name, lam=1.0), rewards=rewards, valid=valid, **kw)
    assert torch.isfinite(adv).all()
    assert not adv[1].any()
    assert (adv[2] * MASK[2]).abs().sum() > 0  # the others still learn
    if returns is not None:
        assert not returns[1].any()
    if name in ("grpo", "dr_grpo", "rloo"):
        assert not adv[0].any()  # the lone valid member of its group equals its group mean


def test_failed_samples_with_a_zeroed_loss_mask_get_no_advantage_under_ppo():
    """What the rollout manager does: a FAILED sample's loss mask is all 0, so nothing of it is
    trained on whatever the critic says about it."""
    samples = make_samples()
    samples[1].loss_mask = [0] * samples[1].response_length
    valid = torch.tensor([True, False, True, True])
    algo = AlgoConfig(advantage="ppo", gamma=1.0, lam=1.0)
    adv, returns, _ = compute_advantages(algo, samples, REWARDS, valid, GROUP, values=torch.full((4, 4), 0.25))
    assert not adv[1].any() and not returns[1].any()


def test_failed_samples_get_no_advantage_under_ppo_with_non_zero_values():
    valid = torch.tensor([True, False, True, True])
    algo = AlgoConfig(advantage="ppo", gamma=1.0, lam=1.0)
    adv, _, _ = advantages(algo, valid=valid, values=torch.full((4, 4), 0.25))
    assert not adv[1].any()
