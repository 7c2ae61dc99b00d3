"""Policy loss, KL estimators, entropy, log-probs and masked reductions against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.algo import (
    entropy_from_logits,
    kl_estimate,
    log_probs_and_entropy,
    log_probs_from_logits,
    masked_mean,
    masked_sum,
    policy_loss,
    token_mean_loss,
)


def _ratios(*values: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log_probs / old_log_probs [1, T] whose ratio exp(lp - old) is exactly `values`."""
    lp = torch.tensor([[math.log(v) for v in values]], dtype=torch.float64)
    return lp, torch.zeros_like(lp)


# ---------------------------------------------------------------------------------------------
# policy_loss


@pytest.mark.parametrize(
    "ratio,adv,loss,clipped",
    [
        # inside [0.8, 1.2]: both terms equal -> loss = -ratio * A, not clipped
        (1.1, 2.0, -2.2, 0.0),
        (0.9, -1.0, 0.9, 0.0),
        # ratio above 1 + eps, A > 0: min(1.5, 1.2) = 1.2 -> clipped
        (1.5, 1.0, -1.2, 1.0),
        # ratio above 1 + eps, A < 0: min(-1.5, -1.2) = -1.5 -> unclipped (pessimistic) branch
        (1.5, -1.0, 1.5, 0.0),
        # ratio below 1 - eps, A > 0: min(0.5, 0.8) = 0.5 -> unclipped
        (0.5, 1.0, -0.5, 0.0),
        # ratio below 1 - eps, A < 0: min(-0.5, -0.8) = -0.8 -> clipped
        (0.5, -1.0, 0.8, 1.0),
        # A = 0: loss 0 and nothing is clipped
        (3.0, 0.0, 0.0, 0.0),
    ],
)
def test_ppo_clip_values(ratio, adv, loss, clipped):
    lp, old = _ratios(ratio)
    out, metrics = policy_loss(lp, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1), eps_clip=0.2)
    assert out.shape == (1, 1)
    assert out.item() == pytest.approx(loss, abs=1e-12)
    assert metrics["clip_frac"].item() == clipped


def test_ppo_gradient_is_zero_on_clipped_tokens():
    lp, old = _ratios(1.5, 1.5, 1.1)
    lp.requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    loss, metrics = policy_loss(lp, old, adv, torch.ones(1, 3))
    loss.sum().backward()
    assert metrics["clip_frac"].item() == pytest.approx(1 / 3)  # only the first token is clipped
    # d(-ratio * A)/d lp = -ratio * A on active tokens: -1.5 * -1 = 1.5, -1.1 * 2 = -2.2
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 1.5, -2.2]], dtype=torch.float64))


def test_clip_higher_asymmetry():
    lp, old = _ratios(1.25, 0.7, 1.35)
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    sym, sym_m = policy_loss(lp, old, adv, mask, eps_clip=0.2)
    high, high_m = policy_loss(lp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28)
    # symmetric: 1.25 -> capped at 1.2; 0.7 with A<0 -> floor 0.8; 1.35 -> 1.2
    torch.testing.assert_close(sym, torch.tensor([[-1.2, 0.8, -1.2]], dtype=torch.float64))
    assert sym_m["clip_frac"].item() == 1.0
    # clip-higher: 1.25 is now inside [0.8, 1.28]; the lower bound is unchanged; 1.35 -> 1.28
    torch.testing.assert_close(high, torch.tensor([[-1.25, 0.8, -1.28]], dtype=torch.float64))
    assert high_m["clip_frac"].item() == pytest.approx(2 / 3)


def test_sequence_advantages_broadcast_over_tokens():
    lp = torch.randn(3, 5, dtype=torch.float64)
    old = lp + 0.3 * torch.randn(3, 5, dtype=torch.float64)
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    mask = torch.ones(3, 5)
    a, ma = policy_loss(lp, old, adv, mask)
    b, mb = policy_loss(lp, old, adv[:, None].expand(3, 5), mask)
    torch.testing.assert_close(a, b)
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def test_policy_loss_shape_errors():
    with pytest.raises(ValueError, match="old_log_probs"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(5), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 4))


def test_policy_loss_upcasts_bf16():
    lp = torch.zeros(2, 3, dtype=torch.bfloat16)
    loss, metrics = policy_loss(lp, lp, torch.ones(2, dtype=torch.bfloat16), torch.ones(2, 3))
    assert loss.dtype == torch.float32 and all(m.dtype == torch.float32 for m in metrics.values())
    torch.testing.assert_close(loss, -torch.ones(2, 3))


# ---------------------------------------------------------------------------------------------
# KL estimators


def test_kl_estimators_exact_values():
    ref = torch.tensor([0.3, -1.0, 2.0, -0.5], dtype=torch.float64)
    delta = torch.tensor([0.0, 1.0, -1.0, 0.5], dtype=torch.float64)
    lp = ref + delta
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), delta)
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), torch.tensor([0.0, 0.5, 0.5, 0.125], dtype=torch.float64))
    # exp(-d) - 1 + d: d=1 -> e^-1 = 0.36787944; d=-1 -> e - 2 = 0.71828183; d=0.5 -> 0.10653066
    torch.testing.assert_close(
        kl_estimate(lp, ref, "k3"),
        torch.tensor([0.0, 0.36787944117144233, 0.7182818284590451, 0.10653065971263342], dtype=torch.float64),
    )


def test_kl_unknown_kind_lists_choices():
    with pytest.raises(ValueError, match="k1, k2, k3") as err:
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")
    assert "'k4'" in str(err.value)


# ---------------------------------------------------------------------------------------------
# entropy and log-probs


def test_entropy_uniform_is_log_v():
    for v in (2, 7, 1000):
        h = entropy_from_logits(torch.full((3, v), 1.7))
        torch.testing.assert_close(h, torch.full((3,), math.log(v)))


def test_entropy_hand_values_and_stability():
    # p = [0.5, 0.25, 0.25]: H = 0.5 ln 2 + 0.5 ln 4 = 1.5 ln 2
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)) + 40.0
    assert entropy_from_logits(logits).item() == pytest.approx(1.5 * math.log(2), abs=1e-12)
    # huge logits do not overflow
    assert entropy_from_logits(torch.tensor([1000.0, 1000.0])).item() == pytest.approx(math.log(2))
    # -inf logits (banned tokens) contribute 0, including to the gradient
    z = torch.tensor([0.0, 0.0, -math.inf], requires_grad=True)
    h = entropy_from_logits(z)
    assert h.item() == pytest.approx(math.log(2))
    h.backward()
    assert torch.isfinite(z.grad).all()
    one_hot = torch.tensor([3.0, -math.inf, -math.inf])
    assert entropy_from_logits(one_hot).item() == 0.0


def test_log_probs_hand_values():
    # softmax of log([0.5, 0.25, 0.25]) + 3 is [0.5, 0.25, 0.25]
    logits = (torch.log(torch.tensor([0.5, 0.25, 0.25])) + 3.0).view(1, 1, 3).repeat(1, 2, 1)
    out = log_probs_from_logits(logits, torch.tensor([[0, 2]]))
    torch.testing.assert_close(out, torch.tensor([[math.log(0.5), math.log(0.25)]]))
    # temperature 2 on logits [0, 2]: log_softmax([0, 1])[1] = 1 - ln(1 + e) = -0.31326169
    out = log_probs_from_logits(torch.tensor([[[0.0, 2.0]]]), torch.tensor([[1]]), temperature=2.0)
    assert out.item() == pytest.approx(-0.3132616875182228, abs=1e-6)


def test_log_probs_match_log_softmax_reference():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    out = log_probs_from_logits(logits, labels, temperature=0.7)
    ref = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref)
    (g_out,) = torch.autograd.grad(out.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g_out, g_ref)
    assert log_probs_from_logits(logits.detach().bfloat16(), labels).dtype == torch.float32


def test_log_probs_errors():
    with pytest.raises(ValueError, match="temperature"):
        log_probs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="labels"):
        log_probs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# masked reductions


def test_masked_sum_and_mean_values():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    assert masked_sum(x, mask).item() == 8.0
    assert masked_mean(x, mask).item() == pytest.approx(8.0 / 3.0)
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 5.0]))
    torch.testing.assert_close(masked_sum(x, mask, dim=0), torch.tensor([1.0, 7.0, 0.0]))
    # nothing kept -> 0, not NaN
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    torch.testing.assert_close(masked_mean(x, torch.tensor([[1, 0, 0], [0, 0, 0]]), dim=1), torch.tensor([1.0, 0.0]))
    # a broadcast [B, 1] mask counts every covered position
    assert masked_mean(x, torch.tensor([[1], [0]])).item() == pytest.approx(2.0)


def test_nan_and_inf_at_masked_positions_do_not_leak():
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), 5.0, -float("inf")]], requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    for fn in (lambda: masked_mean(x, mask), lambda: token_mean_loss(x, mask, num_tokens=6)):
        x.grad = None
        out = fn()
        assert torch.isfinite(out)
        out.backward()
        assert torch.isfinite(x.grad).all()
        assert (x.grad[mask == 0] == 0).all()
    assert masked_mean(x, mask).item() == pytest.approx(3.0)
    assert token_mean_loss(x, mask, num_tokens=6).item() == pytest.approx(1.5)


def test_token_mean_loss_zero_tokens_is_zero():
    x = torch.ones(2, 3)
    assert token_mean_loss(x, torch.zeros(2, 3), 0).item() == 0.0
    assert token_mean_loss(x, torch.zeros(2, 3), torch.tensor(0)).item() == 0.0
    with pytest.raises(ValueError):
        token_mean_loss(x, torch.ones(2, 3), -1)


@pytest.mark.parametrize("splits", [[12], [4, 4, 4], [1, 5, 6], [2, 3, 7]])
def test_micro_batch_invariance(splits):
    """Sum over micro-batches of token_mean_loss(global count) == full-batch masked mean,
    values and gradients, with PPO per-token losses and NaN padding inside."""
    g = torch.Generator().manual_seed(1)
    b, t = 12, 9
    base_lp = torch.randn(b, t, generator=g, dtype=torch.float64) - 1.0
    old = base_lp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    # ragged lengths with one row fully masked; NaN garbage is added to every padded per-token loss
    lengths = torch.tensor([9, 1, 5, 0, 7, 3, 9, 2, 8, 4, 6, 9])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    garbage = torch.where(mask.bool(), 0.0, float("nan")).to(torch.float64)

    full_lp = base_lp.clone().requires_grad_(True)
    full_loss = masked_mean(policy_loss(full_lp, old, adv, mask)[0] + garbage, mask)
    full_loss.backward()

    num_tokens = float(mask.sum())
    mb_lp = base_lp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    start = 0
    for size in splits:
        rows = slice(start, start + size)
        per_token = policy_loss(mb_lp[rows], old[rows], adv[rows], mask[rows])[0] + garbage[rows]
        loss = token_mean_loss(per_token, mask[rows], num_tokens)
        loss.backward()  # gradient accumulation, as a trainer would do per micro-batch
        total = total + loss.detach()
        start += size
    assert start == b

    assert torch.isfinite(full_loss)
    torch.testing.assert_close(total, full_loss.detach(), atol=1e-6, rtol=0)
    assert torch.isfinite(mb_lp.grad).all()
    assert (mb_lp.grad[mask == 0] == 0).all()
    torch.testing.assert_close(mb_lp.grad, full_lp.grad, atol=1e-6, rtol=0)


def test_per_micro_batch_mean_would_differ():
    """Sanity check that the invariance above is not trivial: averaging per micro-batch differs."""
    x = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    global_mean = masked_mean(x, mask)  # 7 / 4
    naive = (masked_mean(x[:1], mask[:1]) + masked_mean(x[1:], mask[1:])) / 2  # (1 + 4) / 2
    assert global_mean.item() == pytest.approx(1.75) and naive.item() == pytest.approx(2.5)
    summed = token_mean_loss(x[:1], mask[:1], 4) + token_mean_loss(x[1:], mask[1:], 4)
    assert summed.item() == pytest.approx(1.75)


def test_log_probs_and_entropy_is_both_functions_in_one_pass():
    torch.manual_seed(1)
    logits = torch.randn(3, 4, 9, dtype=torch.float64) * 4
    logits[0, 1, 2] = -math.inf  # a banned token
    labels = torch.randint(0, 9, (3, 4))
    labels[0, 1] = 0
    for temperature in (1.0, 0.6):
        z = logits.clone().requires_grad_()
        lp, h = log_probs_and_entropy(z, labels, temperature)
        torch.testing.assert_close(lp, log_probs_from_logits(logits, labels, temperature), rtol=0, atol=1e-12)
        torch.testing.assert_close(h, entropy_from_logits(logits / temperature), rtol=0, atol=1e-12)
        (lp.sum() + h.sum()).backward()
        ref = logits.clone().requires_grad_()
        (
            log_probs_from_logits(ref, labels, temperature).sum() + entropy_from_logits(ref / temperature).sum()
        ).backward()
        torch.testing.assert_close(z.grad, ref.grad, rtol=0, atol=1e-12)
        assert torch.isfinite(z.grad).all()
    lp, h = log_probs_and_entropy(logits.clone().requires_grad_(), labels, entropy_grad=False)
    assert lp.requires_grad and not h.requires_grad  # a metric: no graph kept for it
    with pytest.raises(ValueError, match="temperature must be > 0"):
        log_probs_and_entropy(logits, labels, 0.0)
