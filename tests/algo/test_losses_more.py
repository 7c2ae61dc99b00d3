"""policy_loss (masking, dual-clip, GSPO sequence level, metrics), cispo_loss and value_loss against
hand-computed values, with masking and gradient invariants."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.algo import aggregate, cispo_loss, policy_loss, value_loss

NAN = float("nan")
INF = float("inf")


def _ratios(*values: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log_probs / old_log_probs [1, T] whose ratio exp(lp - old) is `values`."""
    lp = torch.tensor([[math.log(v) for v in values]], dtype=torch.float64)
    return lp, torch.zeros_like(lp)


def _random_case(seed: int, b: int = 5, t: int = 6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[0], lengths[1] = t, 0
    mask = (torch.arange(t)[None, :] < lengths[:, None]) & ~(torch.rand(b, t, generator=gen) < 0.2)
    lp = torch.randn(b, t, generator=gen, dtype=torch.float64) - 1.0
    old = lp + 0.4 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    return lp, old, adv, mask


def _poison(x: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(mask, x, torch.full_like(x, fill))


def _check_masking_invariance(fn, lp, old, adv, mask):
    """fn(lp, old, adv, mask) -> (per_token, metrics): NaN/inf at masked positions change nothing."""
    clean_lp = lp.clone().requires_grad_(True)
    loss, metrics = fn(clean_lp, old, adv, mask)
    loss.sum().backward()
    dirty_lp = _poison(lp, mask, NAN).requires_grad_(True)
    dirty_loss, dirty_metrics = fn(dirty_lp, _poison(old, mask, INF), _poison(adv, mask, NAN), mask)
    dirty_loss.sum().backward()
    assert torch.equal(loss, dirty_loss)
    assert (loss[~mask] == 0).all()
    assert torch.equal(clean_lp.grad, dirty_lp.grad)
    assert (dirty_lp.grad[~mask] == 0).all()
    assert metrics.keys() == dirty_metrics.keys()
    for key in metrics:
        assert torch.equal(metrics[key], dirty_metrics[key]), key
        assert not metrics[key].requires_grad and metrics[key].dim() == 0


# ---------------------------------------------------------------------------------------------
# policy_loss


def test_policy_loss_masks_and_reports_metrics_over_kept_tokens():
    lp, old = _ratios(1.5, 1.1, 0.5, 9.0)
    adv = torch.tensor([[1.0, 2.0, -1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = policy_loss(lp, old, adv, mask)
    # 1.5 with A=1 -> -1.2 (clipped); 1.1 with A=2 -> -2.2; 0.5 with A=-1 -> 0.8 (clipped); masked 0
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -2.2, 0.8, 0.0]], dtype=torch.float64))
    # over the 3 kept tokens only: 2 clipped; ratio mean (1.5 + 1.1 + 0.5)/3 = 1.0333333
    assert m["clip_frac"].item() == pytest.approx(2 / 3)
    assert m["dual_clip_frac"].item() == 0.0
    assert m["ratio_mean"].item() == pytest.approx(3.1 / 3)
    # approx_kl = mean 0.5*log(r)^2: ln1.5 = 0.4054651, ln1.1 = 0.0953102, ln0.5 = -0.6931472
    # squares 0.1644019 + 0.0090840 + 0.4804530 = 0.6539389 -> 0.5 * 0.6539389 / 3 = 0.1089898
    assert m["approx_kl"].item() == pytest.approx(0.1089898, abs=1e-7)


def test_policy_loss_all_masked_metrics_are_zero():
    loss, m = policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    assert torch.equal(loss, torch.zeros(2, 3))
    assert all(v.item() == 0.0 for v in m.values())


def test_dual_clip_hand_values_and_gradient():
    lp, old = _ratios(4.0, 2.0, 4.0, 0.5)
    lp.requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, m = policy_loss(lp, old, adv, torch.ones(1, 4), dual_clip=3.0)
    # ratio 4, A=-1: PPO loss -min(-4, -1.2) = 4, capped at -3*A = 3 (dual clip active, no gradient)
    # ratio 2, A=-1: PPO loss 2 < 3 -> unchanged, gradient -ratio*A = 2
    # ratio 4, A=+1: clipped to 1.2 -> -1.2 (dual clip only applies to A < 0)
    # ratio 0.5, A=-1: clipped at 0.8 -> 0.8
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0, -1.2, 0.8]], dtype=torch.float64))
    assert m["clip_frac"].item() == 0.5  # tokens 2 and 3
    assert m["dual_clip_frac"].item() == 0.25  # token 0
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 2.0, 0.0, 0.0]], dtype=torch.float64))
    # without dual clip the first token's loss is 4
    assert policy_loss(lp.detach(), old, adv, torch.ones(1, 4))[0][0, 0].item() == pytest.approx(4.0)


def test_gspo_sequence_level_hand_values():
    # row 0: log ratios [ln 1.21, 0] -> mean ln 1.1 -> s = 1.1 (inside [0.8, 1.2], not clipped)
    # row 1: log ratios [ln 2.25, 0, masked] -> mean ln 1.5 -> s = 1.5 (A = 1 > 0: clipped at 1.2)
    lp = torch.tensor([[math.log(1.21), 0.0, 0.0], [math.log(2.25), 0.0, NAN]], dtype=torch.float64)
    old = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    lp.requires_grad_(True)
    loss, m = policy_loss(lp, old, adv, mask, level="sequence")
    torch.testing.assert_close(loss, torch.tensor([[-1.1, -1.1, 0.0], [-1.2, -1.2, 0.0]], dtype=torch.float64))
    loss.sum().backward()
    # each unclipped token gets -s_i * A = -1.1; the clipped row none
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.1, -1.1, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64))
    assert m["clip_frac"].item() == 0.5
    assert m["ratio_mean"].item() == pytest.approx((1.1 * 2 + 1.5 * 2) / 4)  # 1.3
    # approx_kl stays per token: 0.5 * (ln1.21^2 + ln2.25^2) / 4 = 0.5 * (0.0363361 + 0.6576078) / 4 = 0.0867430
    assert m["approx_kl"].item() == pytest.approx(0.0867430, abs=1e-7)
    # at token level the same inputs clip differently: 1.21 and 2.25 are both clipped at 1.2
    _, m_tok = policy_loss(lp.detach(), old, adv, mask)
    assert m_tok["clip_frac"].item() == 0.5


def test_gspo_gradient_equals_sequence_objective():
    """With seq_mean_token_mean aggregation, GSPO-token has the gradient of -mean_i A_i * s_i
    where s_i = exp(mean_t (lp - old)) (unclipped region)."""
    gen = torch.Generator().manual_seed(2)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    base = -torch.rand(3, 4, generator=gen, dtype=torch.float64)
    old = base + 0.01 * torch.randn(3, 4, generator=gen, dtype=torch.float64)  # ratios stay inside the clip
    adv = torch.tensor([1.5, -0.5, 2.0], dtype=torch.float64)

    lp = base.clone().requires_grad_(True)
    loss, m = policy_loss(lp, old, adv, mask, level="sequence")
    assert m["clip_frac"].item() == 0.0
    aggregate(loss, mask, "seq_mean_token_mean").backward()

    lp_ref = base.clone().requires_grad_(True)
    n = mask.sum(1)
    s = torch.exp(torch.where(mask, lp_ref - old, 0.0).sum(1) / n)
    (-(adv * s).sum() / 3).backward()
    torch.testing.assert_close(lp.grad, lp_ref.grad)


def test_sequence_level_equals_token_level_for_one_token_rows():
    lp, old, adv, _ = _random_case(4, b=6, t=1)
    mask = torch.ones(6, 1, dtype=torch.bool)
    for dual in (None, 2.0):
        a, ma = policy_loss(lp, old, adv, mask, dual_clip=dual)
        b, mb = policy_loss(lp, old, adv, mask, dual_clip=dual, level="sequence")
        torch.testing.assert_close(a, b)
        for key in ma:
            torch.testing.assert_close(ma[key], mb[key])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_masked_garbage_changes_nothing(level, dual_clip):
    lp, old, adv, mask = _random_case(1)

    def fn(lp_, old_, adv_, mask_):
        return policy_loss(lp_, old_, adv_, mask_, eps_clip_high=0.28, dual_clip=dual_clip, level=level)

    _check_masking_invariance(fn, lp, old, adv, mask)


def test_policy_loss_argument_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="level"):
        policy_loss(z, z, torch.zeros(2), torch.ones(2, 3), level="tokens")
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(z, z, torch.zeros(2), torch.ones(2, 3), dual_clip=1.0)
    with pytest.raises(ValueError, match="clip ranges"):
        policy_loss(z, z, torch.zeros(2), torch.ones(2, 3), eps_clip=-0.1)
    with pytest.raises(ValueError, match="2-D"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3))


# ---------------------------------------------------------------------------------------------
# cispo_loss


def test_cispo_hand_values_and_gradient():
    lp, old = _ratios(1.5, 0.5, 1.1)
    lp.requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    loss, m = cispo_loss(lp, old, adv, torch.ones(1, 3))
    # weights clip(ratio, -, 1.2) = [1.2, 0.5, 1.1] (no lower bound)
    # loss = -w*A*lp: -1.2*1*ln1.5 = -0.4865581, -0.5*(-1)*ln0.5 = -0.3465736, -1.1*2*ln1.1 = -0.2096824
    torch.testing.assert_close(
        loss, torch.tensor([[-0.4865581, -0.3465736, -0.2096824]], dtype=torch.float64), atol=1e-7, rtol=0
    )
    loss.sum().backward()
    # every token keeps a gradient, -w*A, even the clipped one
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.2, 0.5, -2.2]], dtype=torch.float64))
    assert m["clip_frac"].item() == pytest.approx(1 / 3)
    assert m["ratio_mean"].item() == pytest.approx(3.1 / 3)
    # with a lower bound 1 - 0.2 = 0.8 the second weight becomes 0.8
    lp.grad = None
    loss, m = cispo_loss(lp, old, adv, torch.ones(1, 3), eps_clip_low=0.2)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.2, 0.8, -2.2]], dtype=torch.float64))
    assert m["clip_frac"].item() == pytest.approx(2 / 3)


def test_cispo_masked_garbage_changes_nothing():
    lp, old, adv, mask = _random_case(8)
    _check_masking_invariance(lambda a, b, c, d: cispo_loss(a, b, c, d, eps_clip_low=0.3), lp, old, adv, mask)


def test_cispo_errors_and_bf16():
    z = torch.zeros(2, 3, dtype=torch.bfloat16)
    loss, _ = cispo_loss(z, z, torch.ones(2), torch.ones(2, 3))
    assert loss.dtype == torch.float32
    with pytest.raises(ValueError, match="clip ranges"):
        cispo_loss(z, z, torch.ones(2), torch.ones(2, 3), eps_clip_high=-1.0)
    with pytest.raises(ValueError, match="advantages"):
        cispo_loss(z, z, torch.ones(3), torch.ones(2, 3))


# ---------------------------------------------------------------------------------------------
# value_loss


def test_value_loss_clipped_hand_values():
    v = torch.tensor([[1.0, 2.0, 1.0, NAN]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.5, INF]], dtype=torch.float64)
    ret = torch.tensor([[2.0, 1.0, 0.0, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = value_loss(v, old, ret, mask, clip=0.2)
    # t0: (1-2)^2 = 1; clipped v = 0.5 + 0.2 = 0.7, (0.7-2)^2 = 1.69 -> 0.5*1.69 = 0.845 (clipped larger)
    # t1: v = old -> both (2-1)^2 = 1 -> 0.5
    # t2: (1-0)^2 = 1; clipped 0.7^2 = 0.49 -> 0.5
    torch.testing.assert_close(loss, torch.tensor([[0.845, 0.5, 0.5, 0.0]], dtype=torch.float64))
    loss.sum().backward()
    # t0's active term is constant in v (clamp saturated) -> 0; t1, t2: v - R = 1, 1; masked 0
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 1.0, 1.0, 0.0]], dtype=torch.float64))
    assert m["clip_frac"].item() == pytest.approx(1 / 3)
    assert m["value_mean"].item() == pytest.approx(4 / 3)
    # explained_var: R = [2, 1, 0] (var 2/3), R - V = [1, -1, -1] (mean -1/3, var (16+4+4)/9/3 = 8/9)
    # -> 1 - (8/9)/(2/3) = -1/3
    assert m["explained_var"].item() == pytest.approx(-1 / 3)


def test_value_loss_unclipped_and_explained_var_edge():
    v = torch.tensor([[1.0, 2.0, 1.0]], requires_grad=True)
    ret = torch.tensor([[2.0, 1.0, 0.0]])
    loss, m = value_loss(v, v.detach() + 5.0, ret, torch.ones(1, 3))
    torch.testing.assert_close(loss, torch.full((1, 3), 0.5))  # 0.5 * 1 each
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[-1.0, 1.0, 1.0]]))
    assert m["clip_frac"].item() == 0.0
    # perfect predictions -> 1; constant returns -> reported as 0 rather than 0/0
    assert value_loss(ret, ret, ret, torch.ones(1, 3))[1]["explained_var"].item() == 1.0
    assert value_loss(v, v, torch.ones(1, 3), torch.ones(1, 3))[1]["explained_var"].item() == 0.0


def test_value_loss_masked_garbage_changes_nothing():
    lp, old, adv, mask = _random_case(9)

    def fn(v, old_v, ret, mask_):
        return value_loss(v, old_v, ret, mask_, clip=0.1)

    _check_masking_invariance(fn, lp, old, adv, mask)


def test_value_loss_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="returns"):
        value_loss(z, z, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="clip"):
        value_loss(z, z, z, torch.ones(2, 3), clip=-0.1)
