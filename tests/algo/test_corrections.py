"""Train/rollout importance weights (TIS truncation and ICEPOP-style masking) at token, sequence
and geometric level, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.algo import importance_weights

NAN = float("nan")
INF = float("inf")


def _case():
    """Row 0 token ratios [1.5, 3, 0.25]; row 1 [3, 3, masked]. rollout log-probs are 0."""
    train = torch.tensor(
        [[math.log(1.5), math.log(3.0), math.log(0.25)], [math.log(3.0), math.log(3.0), NAN]], dtype=torch.float64
    )
    rollout = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, INF]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return train, rollout, mask


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_token_truncate():
    train, rollout, mask = _case()
    w, m = importance_weights(train, rollout, mask)
    # min(ratio, 2): [1.5, 2, 0.25], [2, 2, masked 0]
    torch.testing.assert_close(w, _t([[1.5, 2.0, 0.25], [2.0, 2.0, 0.0]]))
    assert m["clipped_frac"].item() == pytest.approx(3 / 5)
    assert m["weight_mean"].item() == pytest.approx(7.75 / 5)  # (1.5 + 2 + 0.25 + 2 + 2) / 5 = 1.55
    # |Delta| = ln1.5 + ln3 + ln4 + 2 ln3 = 0.4054651 + 1.0986123 + 1.3862944 + 2.1972246 = 5.0875964 -> /5
    assert m["mismatch_abs_diff"].item() == pytest.approx(1.0175193, abs=1e-7)
    assert "masked_frac" not in m
    # with a lower bound 0.5 the 0.25 is raised to 0.5
    w, m = importance_weights(train, rollout, mask, low=0.5)
    torch.testing.assert_close(w, _t([[1.5, 2.0, 0.5], [2.0, 2.0, 0.0]]))
    assert m["clipped_frac"].item() == pytest.approx(4 / 5)


def test_token_mask():
    train, rollout, mask = _case()
    w, m = importance_weights(train, rollout, mask, mode="mask")
    # ratio kept where <= 2, else 0: [1.5, 0, 0.25], [0, 0, -]
    torch.testing.assert_close(w, _t([[1.5, 0.0, 0.25], [0.0, 0.0, 0.0]]))
    assert m["masked_frac"].item() == pytest.approx(3 / 5)
    assert m["weight_mean"].item() == pytest.approx(1.75 / 5)
    assert "clipped_frac" not in m
    w, m = importance_weights(train, rollout, mask, mode="mask", low=0.5, high=3.5)
    # [0.5, 3.5] keeps 1.5 and the 3s, rejects 0.25
    torch.testing.assert_close(w, _t([[1.5, 3.0, 0.0], [3.0, 3.0, 0.0]]))
    assert m["masked_frac"].item() == pytest.approx(1 / 5)


def test_sequence_level():
    train, rollout, mask = _case()
    # row ratios: 1.5 * 3 * 0.25 = 1.125 and 3 * 3 = 9
    w, m = importance_weights(train, rollout, mask, level="sequence")
    torch.testing.assert_close(w, _t([[1.125, 1.125, 1.125], [2.0, 2.0, 0.0]]))
    assert m["clipped_frac"].item() == pytest.approx(2 / 5)  # the two tokens of row 1
    w, m = importance_weights(train, rollout, mask, level="sequence", mode="mask")
    # row 1 (9 > 2) is rejected whole
    torch.testing.assert_close(w, _t([[1.125, 1.125, 1.125], [0.0, 0.0, 0.0]]))
    assert m["masked_frac"].item() == pytest.approx(2 / 5)
    assert m["weight_mean"].item() == pytest.approx(3.375 / 5)


def test_geometric_level():
    train, rollout, mask = _case()
    # geometric means: 1.125^(1/3) = 1.0400419 and 9^(1/2) = 3
    g0 = 1.125 ** (1 / 3)
    w, m = importance_weights(train, rollout, mask, level="geometric")
    torch.testing.assert_close(w, _t([[g0, g0, g0], [2.0, 2.0, 0.0]]))
    assert g0 == pytest.approx(1.0400419, abs=1e-7)
    w, m = importance_weights(train, rollout, mask, level="geometric", mode="mask", low=1.05)
    # low 1.05 rejects row 0 (1.04), high 2 rejects row 1 (3): everything 0
    assert torch.equal(w, torch.zeros(2, 3, dtype=torch.float64))
    assert m["masked_frac"].item() == 1.0


def test_overflowing_sequence_ratio_is_handled():
    # a row sum of 3 * 400 = 1200 overflows exp() to inf; truncation gives `high`, masking gives 0
    train = torch.full((1, 3), 400.0)
    rollout = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    w, _ = importance_weights(train, rollout, mask, level="sequence", high=5.0)
    assert torch.equal(w, torch.full((1, 3), 5.0))
    w, m = importance_weights(train, rollout, mask, level="sequence", mode="mask")
    assert torch.equal(w, torch.zeros(1, 3))
    assert all(torch.isfinite(v) for v in m.values())


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_masked_garbage_changes_nothing_and_weights_are_detached(level, mode):
    gen = torch.Generator().manual_seed(6)
    mask = torch.rand(4, 6, generator=gen) < 0.7
    mask[1] = False  # an empty row
    train = (torch.randn(4, 6, generator=gen) * 0.3 - 1).requires_grad_(True)
    rollout = train.detach() + 0.3 * torch.randn(4, 6, generator=gen)
    w, m = importance_weights(train, rollout, mask, level=level, mode=mode, low=0.6, high=1.5)
    dirty_train = torch.where(mask, train.detach(), NAN)
    dirty_rollout = torch.where(mask, rollout, -INF)
    w2, m2 = importance_weights(dirty_train, dirty_rollout, mask, level=level, mode=mode, low=0.6, high=1.5)
    assert torch.equal(w, w2)
    assert (w[~mask] == 0).all()
    assert not w.requires_grad
    assert m.keys() == m2.keys()
    for key in m:
        assert torch.equal(m[key], m2[key]) and not m[key].requires_grad


def test_bf16_inputs_and_errors():
    z = torch.zeros(2, 3, dtype=torch.bfloat16)
    w, _ = importance_weights(z, z, torch.ones(2, 3))
    assert w.dtype == torch.float32 and torch.equal(w, torch.ones(2, 3))
    o = torch.ones(2, 3)
    with pytest.raises(ValueError, match="token, sequence, geometric"):
        importance_weights(o, o, o, level="seq")
    with pytest.raises(ValueError, match="truncate, mask"):
        importance_weights(o, o, o, mode="clip")
    with pytest.raises(ValueError, match="high"):
        importance_weights(o, o, o, high=0.0)
    with pytest.raises(ValueError, match="low"):
        importance_weights(o, o, o, low=3.0, high=2.0)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        importance_weights(o, torch.ones(2, 4), o)
    with pytest.raises(ValueError, match="mask"):
        importance_weights(o, o, torch.ones(3))
