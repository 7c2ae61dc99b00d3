"""aggregate(): hand values for every mode, global-count micro-batch invariance, masking."""

from __future__ import annotations

import pytest
import torch

from tidal.algo import AGGREGATE_MODES, aggregate, policy_loss

NAN = float("nan")


def _example():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN], [NAN, NAN, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    return x, mask


@pytest.mark.parametrize(
    "mode,kwargs,expected",
    [
        # kept 1, 2, 3, 4: sum 10 over 4 tokens
        ("token_mean", {}, 10 / 4),
        ("token_mean", {"num_tokens": 8}, 10 / 8),
        # row means 2 and 4; the empty third row is not counted: (2 + 4) / 2
        ("seq_mean_token_mean", {}, 3.0),
        ("seq_mean_token_mean", {"num_seqs": 4}, 6 / 4),
        # row sums 6 and 4: 10 / 2
        ("seq_mean_token_sum", {}, 5.0),
        ("seq_mean_token_sum", {"num_seqs": 5}, 10 / 5),
        # Dr. GRPO constant normaliser: 10 / (B=3 * T=3), then 10 / (3 * 5), 10 / (2 * 4)
        ("seq_mean_token_sum_norm", {}, 10 / 9),
        ("seq_mean_token_sum_norm", {"max_len": 5}, 10 / 15),
        ("seq_mean_token_sum_norm", {"num_seqs": 2, "max_len": 4}, 10 / 8),
    ],
)
def test_aggregate_hand_values(mode, kwargs, expected):
    x, mask = _example()
    assert aggregate(x, mask, mode, **kwargs).item() == pytest.approx(expected, abs=1e-12)


def test_aggregate_gradients_by_hand():
    x, mask = _example()
    grads = {}
    for mode in AGGREGATE_MODES:
        xg = x.clone().requires_grad_(True)
        aggregate(xg, mask, mode).backward()
        assert torch.isfinite(xg.grad).all()
        assert (xg.grad[mask == 0] == 0).all()
        grads[mode] = xg.grad[mask == 1].tolist()  # kept entries in order: row 0 (x3), row 1 (x1)
    assert grads["token_mean"] == pytest.approx([1 / 4] * 4)
    # each row weighs 1/2, spread over its tokens: row 0 1/6 each, row 1 1/2
    assert grads["seq_mean_token_mean"] == pytest.approx([1 / 6, 1 / 6, 1 / 6, 1 / 2])
    assert grads["seq_mean_token_sum"] == pytest.approx([1 / 2] * 4)
    assert grads["seq_mean_token_sum_norm"] == pytest.approx([1 / 9] * 4)


@pytest.mark.parametrize("mode", AGGREGATE_MODES)
def test_aggregate_all_masked_is_zero(mode):
    x = torch.full((2, 3), NAN, requires_grad=True)
    out = aggregate(x, torch.zeros(2, 3), mode)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(x.grad, torch.zeros(2, 3))


@pytest.mark.parametrize("mode", AGGREGATE_MODES)
def test_micro_batch_split_equals_whole_batch(mode):
    """With global counts, summing aggregate() over the row splits [0:2], [2:5], [5:] equals
    aggregate() of the whole batch, value and (accumulated) gradient; NaN padding included."""
    gen = torch.Generator().manual_seed(4)
    b, t = 8, 7
    lengths = torch.tensor([7, 2, 0, 5, 1, 7, 3, 4])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mask[0, 3] = False  # a hole in the middle of a row
    base = torch.randn(b, t, generator=gen, dtype=torch.float64) - 1.0
    old = base + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    base = torch.where(mask, base, NAN)

    counts = {
        "num_tokens": float(mask.sum()),
        "num_seqs": float(mask.any(1).sum()) if mode != "seq_mean_token_sum_norm" else float(b),
        "max_len": t,
    }

    whole_lp = base.clone().requires_grad_(True)
    whole = aggregate(policy_loss(whole_lp, old, adv, mask)[0], mask, mode)
    whole.backward()
    # the defaults are the whole batch's own counts, so passing them explicitly changes nothing
    torch.testing.assert_close(whole, aggregate(policy_loss(base, old, adv, mask)[0], mask, mode, **counts))

    split_lp = base.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 2), slice(2, 5), slice(5, None)):
        loss = aggregate(policy_loss(split_lp[rows], old[rows], adv[rows], mask[rows])[0], mask[rows], mode, **counts)
        loss.backward()
        total = total + loss.detach()

    assert torch.isfinite(whole)
    torch.testing.assert_close(total, whole.detach())
    assert torch.isfinite(split_lp.grad).all()
    assert (split_lp.grad[~mask] == 0).all()
    torch.testing.assert_close(split_lp.grad, whole_lp.grad)


def test_aggregate_tensor_counts_and_int_input():
    x, mask = _example()
    out = aggregate(x, mask, "token_mean", num_tokens=torch.tensor(5))
    assert out.item() == pytest.approx(2.0)
    assert aggregate(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2)).item() == 1.0


def test_aggregate_errors():
    x, mask = _example()
    with pytest.raises(ValueError, match="token_mean, seq_mean_token_mean"):
        aggregate(x, mask, "mean")
    with pytest.raises(ValueError, match="mask"):
        aggregate(x, mask[:2], "token_mean")
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(x, mask, "token_mean", num_tokens=-1)
    with pytest.raises(ValueError, match="num_seqs"):
        aggregate(x, mask, "seq_mean_token_sum", num_seqs=-2)
    with pytest.raises(ValueError, match="max_len"):
        aggregate(x, mask, "seq_mean_token_sum_norm", max_len=0)
    with pytest.raises(ValueError, match="2-D"):
        aggregate(x[0], mask[0])
