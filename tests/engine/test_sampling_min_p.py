"""min_p in sample_tokens and SamplingParams: which tokens survive, the renormalised log-prob,
the interplay with temperature, top-k and top-p, and validation."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.contracts import SamplingParams
from tidal.engine.sampling import sample_tokens

N_DRAWS = 2000
PROBS = [0.5, 0.3, 0.15, 0.05]


def _draw(probs, n=N_DRAWS, temperature=1.0, top_p=1.0, top_k=0, **kw):
    """n independent seeded draws from one row of logits = log(probs)."""
    logits = torch.tensor(probs, dtype=torch.float32).log().repeat(n, 1)
    return sample_tokens(logits, temperature, top_p, top_k, seeds=list(range(n)), **kw)


def _filtered(probs, kept, temperature=1.0):
    """The renormalised tempered distribution over `kept` tokens."""
    q = {t: probs[t] ** (1.0 / temperature) for t in kept}
    z = sum(q.values())
    return {t: v / z for t, v in q.items()}


def _check(tokens, logp, expected, tol=0.04):
    assert set(tokens.tolist()) == set(expected)
    for t, p in expected.items():
        sel = tokens == t
        torch.testing.assert_close(logp[sel], torch.full_like(logp[sel], math.log(p)))
        freq = sel.float().mean().item()
        assert abs(freq - p) < tol, (t, freq, p)


@pytest.mark.parametrize(
    "min_p,kept",
    [
        (0.2, [0, 1, 2]),  # threshold 0.1: 0.05 is dropped
        (0.5, [0, 1]),  # threshold 0.25
        (0.65, [0]),  # threshold 0.325: 0.3 is dropped
        (0.09, [0, 1, 2, 3]),  # threshold 0.045: everything stays
    ],
)
def test_min_p_keeps_tokens_above_a_fraction_of_the_top_one(min_p, kept):
    tokens, logp = _draw(PROBS, min_p=min_p)
    _check(tokens, logp, _filtered(PROBS, kept))


def test_min_p_worked_example():
    tokens, logp = _draw(PROBS, min_p=0.2)
    assert set(tokens.tolist()) == {0, 1, 2}
    for t, p in enumerate(PROBS[:3]):
        sel = tokens == t
        torch.testing.assert_close(logp[sel], torch.full_like(logp[sel], math.log(p / 0.95)))
    assert abs((tokens == 0).float().mean().item() - 0.5 / 0.95) < 0.04


def test_min_p_acts_on_the_tempered_distribution():
    # temperature 2: q ~ sqrt(p) = [.707, .548, .387, .224]; q / q_max = [1, .77, .55, .32]
    tokens, logp = _draw(PROBS, temperature=2.0, min_p=0.5)
    _check(tokens, logp, _filtered(PROBS, [0, 1, 2], temperature=2.0))
    # the same min_p at temperature 1 keeps only two
    tokens, _ = _draw(PROBS, n=500, temperature=1.0, min_p=0.5)
    assert set(tokens.tolist()) == {0, 1}


def test_min_p_combines_with_top_p_and_top_k():
    # top_p 0.9 keeps {0, 1, 2}; min_p 0.4 (threshold 0.2) then drops 2
    tokens, logp = _draw(PROBS, top_p=0.9, min_p=0.4)
    _check(tokens, logp, _filtered(PROBS, [0, 1]))
    # top_k 3 keeps {0, 1, 2}; min_p 0.05 (threshold 0.025) drops nothing more
    tokens, logp = _draw(PROBS, top_k=3, min_p=0.05)
    _check(tokens, logp, _filtered(PROBS, [0, 1, 2]))
    # min_p keeps {0, 1, 2}; top_p 0.7 keeps {0, 1}: the stricter filter wins
    tokens, logp = _draw(PROBS, top_p=0.7, min_p=0.2)
    _check(tokens, logp, _filtered(PROBS, [0, 1]))


def test_min_p_zero_leaves_the_distribution_unchanged():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    tokens, logp = sample_tokens(logits, 1.0, 1.0, 0, seeds=list(range(64)), min_p=0.0)
    ref = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logp, ref)
    default_tokens, default_logp = sample_tokens(logits, 1.0, 1.0, 0, seeds=list(range(64)))
    assert torch.equal(tokens, default_tokens) and torch.equal(logp, default_logp)
    # with top_p < 1, min_p = 0 changes nothing either: same draws as top_p alone
    t1, l1 = sample_tokens(logits, 0.8, 0.6, 0, seeds=list(range(64)), min_p=0.0)
    t2, l2 = sample_tokens(logits, 0.8, 0.6, 0, seeds=list(range(64)))
    assert torch.equal(t1, t2) and torch.equal(l1, l2)
    tokens, logp = _draw(PROBS, top_p=0.7, min_p=0.0)
    _check(tokens, logp, _filtered(PROBS, [0, 1]))


def test_min_p_one_keeps_only_the_top_token():
    tokens, logp = _draw(PROBS, n=100, min_p=1.0)
    assert torch.equal(tokens, torch.zeros(100, dtype=torch.long))
    assert torch.equal(logp, torch.zeros(100))


def test_per_row_min_p_does_not_leak_between_rows():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    mp = torch.tensor([0.0, 0.3, 0.0, 0.9])
    tok, lp = sample_tokens(logits, 1.0, 1.0, 0, seeds=list([10, 11, 12, 13]), min_p=mp)
    for i in range(4):
        t, lone = sample_tokens(logits[i : i + 1], 1.0, 1.0, 0, seeds=list([10 + i]), min_p=float(mp[i]))
        assert tok[i] == t[0]
        torch.testing.assert_close(lp[i], lone[0])
    # rows without min_p keep the plain softmax log-prob
    ref = torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp[[0, 2]], ref[[0, 2]])


def test_greedy_rows_ignore_min_p():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(4))
    tokens, logp = sample_tokens(logits, 0.0, 1.0, 0, min_p=0.9)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), True, "0.1", None])
def test_sampling_params_rejects_bad_min_p(bad):
    with pytest.raises(ValueError, match="min_p must be a number in \\[0, 1\\]"):
        SamplingParams(min_p=bad).validate()


def test_sampling_params_min_p_roundtrip():
    assert SamplingParams().min_p == 0.0
    assert SamplingParams(min_p=0).validate().min_p == 0
    assert SamplingParams.from_dict({"min_p": 0.05}).min_p == 0.05
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams.from_dict({"min_p": 1.5})
    with pytest.raises(ValueError, match="min_p"):
        sample_tokens(torch.zeros(2, 5), 1.0, 1.0, 0, min_p=1.5)
    with pytest.raises(ValueError, match="min_p"):
        sample_tokens(torch.zeros(2, 5), 1.0, 1.0, 0, min_p=torch.tensor([0.1, -0.2]))
