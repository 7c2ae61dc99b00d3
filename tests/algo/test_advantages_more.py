"""RLOO, token-level rewards, discounted returns, whitening, REINFORCE++, GAE and distillation
advantages against hand-computed values, serial reference loops and masking invariants."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.algo import (
    discounted_returns,
    distillation_advantages,
    gae,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    token_level_rewards,
    whiten,
)

NAN = float("nan")
INF = float("inf")


def _f64(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _random_mask(b: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """Right-padded rows with random holes in the middle (tool output), plus one empty row."""
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[0] = 0
    lengths[1] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    holes = torch.rand(b, t, generator=gen) < 0.3
    return mask & ~holes


def _garbage(x: torch.Tensor, mask: torch.Tensor, fill: float = NAN) -> torch.Tensor:
    """x with `fill` (NaN by default) written at every masked position."""
    return torch.where(mask.bool(), x, torch.full_like(x, fill))


# ---------------------------------------------------------------------------------------------
# rloo_advantages


def test_rloo_hand_values():
    # Group [1, 0, 0, 1]: sum 2. A_0 = 1 - (2 - 1)/3 = 2/3, A_1 = 0 - (2 - 0)/3 = -2/3.
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    # Groups [3, 1, 2] and [5, 5, 5]: sum 6 -> 3 - 3/2 = 1.5, 1 - 5/2 = -1.5, 2 - 4/2 = 0; equal -> 0.
    adv = rloo_advantages(torch.tensor([3.0, 1.0, 2.0, 5.0, 5.0, 5.0]), group_size=3)
    torch.testing.assert_close(adv, torch.tensor([1.5, -1.5, 0.0, 0.0, 0.0, 0.0]))


def test_rloo_is_scaled_group_centering():
    # A_i = n/(n-1) * (r_i - mean): for n = 4 that is 4/3 of the Dr. GRPO advantage.
    from tidal.algo import grpo_advantages

    r = torch.randn(12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.testing.assert_close(rloo_advantages(r, 4), 4 / 3 * grpo_advantages(r, 4, std_normalize=False))


def test_rloo_valid_mask_ignores_nan():
    # Valid members 1, 0, 4 (sum 5): 1 - (0+4)/2 = -1, 0 - (1+4)/2 = -2.5, 4 - (1+0)/2 = 3.5.
    rewards = torch.tensor([1.0, NAN, 0.0, 4.0])
    valid = torch.tensor([True, False, True, True])
    adv = rloo_advantages(rewards, 4, valid=valid)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, -2.5, 3.5]))
    assert adv[1].item() == 0.0


def test_rloo_degenerate_groups_are_zero():
    # one valid member in the first group, none in the second, group_size 1 everywhere
    valid = torch.tensor([False, True, False, False])
    assert torch.equal(rloo_advantages(torch.tensor([NAN, 3.0, INF, 1.0]), 2, valid=valid), torch.zeros(4))
    assert torch.equal(rloo_advantages(torch.tensor([0.3, -2.0, 9.0]), 1), torch.zeros(3))


def test_rloo_dtype_detached_and_errors():
    assert rloo_advantages(torch.tensor([1, 0]), 2).dtype == torch.float32
    r = torch.tensor([1.0, 0.0], requires_grad=True)
    assert not rloo_advantages(r, 2).requires_grad
    with pytest.raises(ValueError, match="divisible"):
        rloo_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="1-D"):
        rloo_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="valid"):
        rloo_advantages(torch.zeros(4), 2, valid=torch.ones(3, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------
# token_level_rewards


def test_token_level_rewards_hand_values():
    rewards = _f64([2.0, -1.0, NAN])  # the NaN belongs to a row with no response tokens
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    kl = _garbage(torch.full((3, 4), 0.1, dtype=torch.float64), mask)
    out = token_level_rewards(rewards, mask, kl)
    # row 0: last kept position 2 -> [-0.1, -0.1, 2 - 0.1, 0]
    # row 1: the hole at 1 is skipped, last kept position 2 -> [-0.1, 0, -1 - 0.1, 0]
    # row 2: nothing kept -> all 0 (its NaN reward is ignored)
    expected = _f64([[-0.1, -0.1, 1.9, 0.0], [-0.1, 0.0, -1.1, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)
    # without a KL term only the reward remains
    out = token_level_rewards(rewards, mask)
    torch.testing.assert_close(out, _f64([[0, 0, 2, 0], [0, 0, -1, 0], [0, 0, 0, 0]]))


def test_token_level_rewards_gradients_and_masked_zero():
    rewards = _f64([2.0, -1.0, NAN]).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.float32)
    kl = _garbage(torch.full((3, 4), 0.1, dtype=torch.float64), mask).requires_grad_(True)
    out = token_level_rewards(rewards, mask, kl)
    assert (out[mask == 0] == 0).all()
    out.sum().backward()
    # each kept row's reward appears once; the empty row gets no gradient (not NaN)
    torch.testing.assert_close(rewards.grad, _f64([1.0, 1.0, 0.0]))
    torch.testing.assert_close(kl.grad, -mask.to(torch.float64))


def test_token_level_rewards_dtype_and_errors():
    out = token_level_rewards(torch.tensor([1, 0]), torch.ones(2, 2, dtype=torch.bool))
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match="rewards"):
        token_level_rewards(torch.zeros(3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="token_kl"):
        token_level_rewards(torch.zeros(2), torch.ones(2, 4), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="mask"):
        token_level_rewards(torch.zeros(2), torch.ones(8))


# ---------------------------------------------------------------------------------------------
# discounted_returns


def _returns_reference(r: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Plain Python loop over each row's kept positions, last to first."""
    out = torch.zeros_like(r)
    for i in range(r.shape[0]):
        g = 0.0
        for t in reversed(range(r.shape[1])):
            if mask[i, t]:
                g = r[i, t].item() + gamma * g
                out[i, t] = g
    return out


def test_discounted_returns_hand_values():
    r = _f64([[1.0, 2.0, NAN, 3.0]])
    mask = torch.tensor([[1, 1, 0, 1]])
    # gamma 0.5, the masked position is skipped: G3 = 3, G1 = 2 + 0.5*3 = 3.5, G0 = 1 + 0.5*3.5 = 2.75
    torch.testing.assert_close(discounted_returns(r, mask, 0.5), _f64([[2.75, 3.5, 0.0, 3.0]]))
    # gamma 1: suffix sums 1+2+3 = 6, 2+3 = 5, 3
    torch.testing.assert_close(discounted_returns(r, mask, 1.0), _f64([[6.0, 5.0, 0.0, 3.0]]))
    # gamma 0: just the kept rewards
    torch.testing.assert_close(discounted_returns(r, mask, 0.0), _f64([[1.0, 2.0, 0.0, 3.0]]))


def test_discounted_returns_gradient():
    r = _f64([[1.0, 2.0, NAN, 3.0]]).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0, 1]])
    discounted_returns(r, mask, 0.5).sum().backward()
    # d(sum_t G_t)/d r_s = sum over kept t <= s of 0.5^(kept steps between t and s):
    # r0: 1; r1: 1 + 0.5 = 1.5; r3: 1 + 0.5 + 0.25 = 1.75; masked r2: 0
    torch.testing.assert_close(r.grad, _f64([[1.0, 1.5, 0.0, 1.75]]))


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_discounted_returns_match_serial_loop(gamma):
    gen = torch.Generator().manual_seed(3)
    mask = _random_mask(6, 9, gen)
    r = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    out = discounted_returns(_garbage(r, mask), mask, gamma)
    torch.testing.assert_close(out, _returns_reference(r, mask, gamma))
    assert (out[~mask] == 0).all()


def test_discounted_returns_errors_and_dtype():
    assert discounted_returns(torch.ones(1, 2, dtype=torch.bfloat16), torch.ones(1, 2)).dtype == torch.float32
    with pytest.raises(ValueError, match="gamma"):
        discounted_returns(torch.zeros(1, 2), torch.ones(1, 2), gamma=1.5)
    with pytest.raises(ValueError, match="token_rewards"):
        discounted_returns(torch.zeros(1, 3), torch.ones(1, 2))


# ---------------------------------------------------------------------------------------------
# whiten


def test_whiten_hand_values():
    x = _f64([[1.0, 2.0, NAN], [3.0, 4.0, INF]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # kept 1, 2, 3, 4: mean 2.5, deviations -1.5, -0.5, 0.5, 1.5, squares sum 5,
    # unbiased var 5/3, std 1.2909944; -1.5/1.2909944 = -1.1618950, -0.5/1.2909944 = -0.3872983
    out = whiten(x, mask, eps=0.0)
    expected = _f64([[-1.1618950, -0.3872983, 0.0], [0.3872983, 1.1618950, 0.0]])
    torch.testing.assert_close(out, expected, atol=1e-7, rtol=0)
    # shift_mean=False keeps the mean 2.5 at the kept positions, masked stay 0
    out = whiten(x, mask, eps=0.0, shift_mean=False)
    torch.testing.assert_close(out, expected + 2.5 * mask, atol=1e-7, rtol=0)
    # eps is added to the std: -1.5 / (1.2909944 + 1) = -0.6547375
    assert whiten(x, mask, eps=1.0)[0, 0].item() == pytest.approx(-0.6547375, abs=1e-7)


def test_whiten_degenerate_cases():
    mask = torch.tensor([[0, 1, 0]])
    x = _f64([[NAN, 7.0, INF]])
    # a single entry is its own mean, std taken as 0 -> 0 (or the mean when shift_mean=False)
    assert torch.equal(whiten(x, mask), _f64([[0.0, 0.0, 0.0]]))
    assert torch.equal(whiten(x, mask, shift_mean=False), _f64([[0.0, 7.0, 0.0]]))
    # nothing kept -> all 0
    assert torch.equal(whiten(x, torch.zeros(1, 3)), torch.zeros(1, 3, dtype=torch.float64))
    # zero spread with eps = 0: 0, not 0/0, and a finite (zero) gradient
    y = torch.full((2, 2), 0.3, dtype=torch.float64, requires_grad=True)
    out = whiten(y, torch.ones(2, 2), eps=0.0)
    assert torch.equal(out, torch.zeros(2, 2, dtype=torch.float64))
    out.sum().backward()
    assert torch.isfinite(y.grad).all()


def test_whiten_statistics_and_gradient():
    gen = torch.Generator().manual_seed(5)
    mask = _random_mask(5, 7, gen)
    x = torch.randn(5, 7, generator=gen, dtype=torch.float64) * 3 + 1
    out = whiten(_garbage(x, mask), mask, eps=0.0)
    kept = out[mask]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert kept.std().item() == pytest.approx(1.0, abs=1e-12)
    assert (out[~mask] == 0).all()
    # gradient against finite differences (finite fill: gradcheck perturbs every entry)
    xg = torch.where(mask, x, 100.0).requires_grad_(True)
    w = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda z: (whiten(z, mask) * w).sum(), (xg,))
    # with NaN at the masked positions the gradient is the same and 0 there
    xn = _garbage(x, mask).requires_grad_(True)
    (whiten(xn, mask) * w).sum().backward()
    xg.grad = None
    (whiten(xg, mask) * w).sum().backward()
    assert torch.equal(xn.grad, xg.grad)
    assert (xn.grad[~mask] == 0).all()


def test_whiten_errors():
    with pytest.raises(ValueError, match="eps"):
        whiten(torch.zeros(1, 2), torch.ones(1, 2), eps=-1.0)
    with pytest.raises(ValueError, match="x has shape"):
        whiten(torch.zeros(1, 3), torch.ones(1, 2))


# ---------------------------------------------------------------------------------------------
# REINFORCE++


def test_reinforce_pp_hand_values():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # token rewards [0, 1, -], [0, 0, 0]; returns (gamma 1) [1, 1, -], [0, 0, 0]
    # kept 1, 1, 0, 0, 0: mean 0.4, deviations 0.6 x2, -0.4 x3, squares 0.72 + 0.48 = 1.2,
    # unbiased var 1.2/4 = 0.3, std 0.5477226: 0.6/0.5477226 = 1.0954451, -0.4/0.5477226 = -0.7302967
    adv = reinforce_pp_advantages(rewards, mask, eps=0.0)
    expected = torch.tensor([[1.0954451, 1.0954451, 0.0], [-0.7302967, -0.7302967, -0.7302967]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_reinforce_pp_with_kl_hand_values():
    rewards = _f64([1.0])
    mask = torch.ones(1, 3)
    kl = _f64([[0.1, 0.2, 0.3]])
    # token rewards [-0.1, -0.2, 1 - 0.3 = 0.7]; returns [0.4, 0.5, 0.7]; mean 1.6/3 = 0.5333333,
    # deviations -0.1333333, -0.0333333, 0.1666667, squares sum 0.0466667, var /2 = 0.0233333,
    # std 0.1527525 -> [-0.8728716, -0.2182179, 1.0910895]
    adv = reinforce_pp_advantages(rewards, mask, kl, eps=0.0)
    torch.testing.assert_close(adv, _f64([[-0.8728716, -0.2182179, 1.0910895]]), atol=1e-6, rtol=0)
    # gamma 0.5: returns G2 = 0.7, G1 = -0.2 + 0.35 = 0.15, G0 = -0.1 + 0.075 = -0.025
    # mean 0.825/3 = 0.275, deviations -0.3, -0.125, 0.425, squares 0.09 + 0.015625 + 0.180625 = 0.28625,
    # var 0.143125, std 0.3783186 -> [-0.7929823, -0.3304093, 1.1233916]
    adv = reinforce_pp_advantages(rewards, mask, kl, gamma=0.5, eps=0.0)
    torch.testing.assert_close(adv, _f64([[-0.7929823, -0.3304093, 1.1233916]]), atol=1e-6, rtol=0)


def test_reinforce_pp_composes_building_blocks_and_is_detached():
    gen = torch.Generator().manual_seed(7)
    mask = _random_mask(6, 8, gen)
    rewards = torch.randn(6, generator=gen, requires_grad=True)
    kl = torch.rand(6, 8, generator=gen) * 0.05
    adv = reinforce_pp_advantages(rewards, mask, _garbage(kl, mask), gamma=0.9)
    ref = whiten(discounted_returns(token_level_rewards(rewards, mask, kl), mask, 0.9), mask)
    torch.testing.assert_close(adv, ref.detach())
    assert not adv.requires_grad
    assert (adv[~mask] == 0).all()


def test_reinforce_pp_baseline_hand_values():
    rewards = torch.tensor([1.0, 0.0, 3.0, NAN])
    valid = torch.tensor([True, True, True, False])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    kl = torch.tensor([[0.0, 0.0], [0.0, NAN], [0.0, 0.0], [NAN, NAN]])  # NaN only where unused
    # group 0 [1, 0]: mean 0.5 -> [0.5, -0.5]; group 1: only 3 is valid -> [0, invalid]
    # token rewards / returns: row 0 [0.5, 0.5], row 1 [-0.5, -], row 2 [0, 0], row 3 excluded
    # kept 0.5, 0.5, -0.5, 0, 0: mean 0.1, deviations 0.4, 0.4, -0.6, -0.1, -0.1, squares 0.7,
    # var 0.7/4 = 0.175, std 0.4183300: 0.4/0.41833 = 0.9561829, -0.6/.. = -1.4342743, -0.1/.. = -0.2390457
    adv = reinforce_pp_baseline_advantages(rewards, 2, mask, kl, valid=valid, eps=0.0)
    expected = torch.tensor([[0.9561829, 0.9561829], [-1.4342743, 0.0], [-0.2390457, -0.2390457], [0.0, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_reinforce_pp_baseline_kl_and_errors():
    # one group of 2, rewards [1, 1] -> centered 0; only the KL shaping is left:
    # token rewards [[-0.1, -0.3]] and [[-0.2, 0]] (mask), returns [-0.4, -0.3] and [-0.2, -]
    # kept -0.4, -0.3, -0.2: mean -0.3, deviations -0.1, 0, 0.1, var 0.02/2 = 0.01, std 0.1 -> [-1, 0, 1]
    adv = reinforce_pp_baseline_advantages(
        _f64([1.0, 1.0]), 2, torch.tensor([[1, 1], [1, 0]]), _f64([[0.1, 0.3], [0.2, 7.0]]), eps=0.0
    )
    torch.testing.assert_close(adv, _f64([[-1.0, 0.0], [1.0, 0.0]]))
    with pytest.raises(ValueError, match="rewards"):
        reinforce_pp_baseline_advantages(torch.zeros(3), 1, torch.ones(2, 2))
    with pytest.raises(ValueError, match="divisible"):
        reinforce_pp_baseline_advantages(torch.zeros(3), 2, torch.ones(3, 2))


# ---------------------------------------------------------------------------------------------
# GAE


def _gae_reference(r, v, mask, gamma, lam):
    """Serial loop over each row's kept positions, last to first."""
    adv = torch.zeros_like(r)
    for i in range(r.shape[0]):
        next_v, next_a = 0.0, 0.0
        for t in reversed(range(r.shape[1])):
            if not mask[i, t]:
                continue
            delta = r[i, t].item() + gamma * next_v - v[i, t].item()
            a = delta + gamma * lam * next_a
            adv[i, t] = a
            next_v, next_a = v[i, t].item(), a
    returns = torch.where(mask, adv + v, torch.zeros_like(v))
    return adv, returns


def test_gae_three_tokens_by_hand():
    r = _f64([[0.0, 0.0, 1.0]])
    v = _f64([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    # gamma = lam = 0.5:
    # t2: delta = 1 + 0 - 0.7 = 0.3, A2 = 0.3
    # t1: delta = 0 + 0.5*0.7 - 0.6 = -0.25, A1 = -0.25 + 0.25*0.3 = -0.175
    # t0: delta = 0 + 0.5*0.6 - 0.5 = -0.2, A0 = -0.2 + 0.25*(-0.175) = -0.24375
    # returns = A + V = [0.25625, 0.425, 1.0]
    adv, ret = gae(r, v, mask, gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, _f64([[-0.24375, -0.175, 0.3]]))
    torch.testing.assert_close(ret, _f64([[0.25625, 0.425, 1.0]]))
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t = [0.5, 0.4, 0.3], returns all 1
    adv, ret = gae(r, v, mask)
    torch.testing.assert_close(adv, _f64([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(ret, _f64([[1.0, 1.0, 1.0]]))
    # lam = 0: one-step TD errors [-0.2, -0.25, 0.3]
    adv, _ = gae(r, v, mask, gamma=0.5, lam=0.0)
    torch.testing.assert_close(adv, _f64([[-0.2, -0.25, 0.3]]))


def test_gae_skips_holes_and_ignores_nan_there():
    # Same as the hand case above with a masked position (NaN reward and value) inserted at t=1.
    r = _f64([[0.0, NAN, 0.0, 1.0, NAN]])
    v = _f64([[0.5, NAN, 0.6, 0.7, INF]])
    mask = torch.tensor([[1, 0, 1, 1, 0]])
    adv, ret = gae(r, v, mask, gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, _f64([[-0.24375, 0.0, -0.175, 0.3, 0.0]]))
    torch.testing.assert_close(ret, _f64([[0.25625, 0.0, 0.425, 1.0, 0.0]]))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7)])
def test_gae_matches_serial_loop(gamma, lam):
    gen = torch.Generator().manual_seed(11)
    mask = _random_mask(7, 10, gen)
    r = torch.randn(7, 10, generator=gen, dtype=torch.float64)
    v = torch.randn(7, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    adv, ret = gae(_garbage(r, mask), _garbage(v, mask), mask, gamma, lam)
    ref_adv, ref_ret = _gae_reference(r, v.detach(), mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    assert not adv.requires_grad and not ret.requires_grad
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_errors_and_dtype():
    adv, ret = gae(torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(1, 2), torch.ones(1, 2))
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    with pytest.raises(ValueError, match="lam"):
        gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), lam=-0.1)
    with pytest.raises(ValueError, match="gamma"):
        gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), gamma=2.0)
    with pytest.raises(ValueError, match="values"):
        gae(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))


# ---------------------------------------------------------------------------------------------
# distillation


def test_distillation_advantages_hand_values():
    student = torch.tensor([[-1.0, -2.0, NAN]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -3.0, -INF]])
    mask = torch.tensor([[1, 1, 0]])
    # coef * (teacher - student): 2 * 0.5 = 1, 2 * (-1) = -2, masked 0
    adv = distillation_advantages(student, teacher, mask, coef=2.0)
    assert torch.equal(adv, torch.tensor([[1.0, -2.0, 0.0]]))
    assert not adv.requires_grad
    # the expected advantage under the student is minus the reverse KL: here log ratios of 1 -> -1 per token
    s = torch.log(torch.tensor([[0.5, 0.5]]))
    t = s - 1.0
    assert torch.equal(distillation_advantages(s, t, torch.ones(1, 2)), torch.full((1, 2), -1.0))
    with pytest.raises(ValueError, match="teacher_log_probs"):
        distillation_advantages(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))
    assert math.isfinite(adv.sum().item())
