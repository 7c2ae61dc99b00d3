"""sample_tokens and SamplingParams: greedy, top-k, top-p, temperature, per-row params and seeds."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.contracts import SamplingParams
from tidal.engine.sampling import sample_tokens

N_DRAWS = 2000


def _draw(logits_row, n=N_DRAWS, **params):
    """n independent draws from one distribution, as one batch with a seed per row."""
    logits = torch.as_tensor(logits_row, dtype=torch.float32).repeat(n, 1)
    return sample_tokens(logits, seeds=list(range(n)), **params)


def test_greedy_is_argmax_with_raw_softmax_log_prob():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tokens, logp = sample_tokens(logits, temperature=0.0, top_p=0.5, top_k=3)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert torch.equal(tokens, logits.float().argmax(-1))
    assert tokens.dtype == torch.long and logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref.gather(-1, tokens[:, None])[:, 0])


def test_top_k_1_is_greedy():
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    tokens, logp = sample_tokens(logits, temperature=1.3, top_p=1.0, top_k=1)
    assert torch.equal(tokens, logits.argmax(-1))
    # The filtered distribution has one token, so its probability is 1.
    assert torch.equal(logp, torch.zeros(8))


def test_top_k_2_support_and_frequencies():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    tokens, logp = _draw(probs.log(), temperature=1.0, top_p=1.0, top_k=2)
    assert set(tokens.tolist()) <= {1, 3}
    expected = {1: 0.4 / 0.7, 3: 0.3 / 0.7}
    for tok, p in expected.items():
        freq = (tokens == tok).float().mean().item()
        assert abs(freq - p) < 0.04, (tok, freq, p)
        torch.testing.assert_close(logp[tokens == tok], torch.full_like(logp[tokens == tok], math.log(p)))


def test_top_k_2_frequencies_with_global_rng():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        tokens, _ = sample_tokens(probs.log().repeat(N_DRAWS, 1), temperature=1.0, top_p=1.0, top_k=2)
    assert set(tokens.tolist()) <= {1, 3}
    assert abs((tokens == 1).float().mean().item() - 0.4 / 0.7) < 0.04


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens, logp = _draw(probs.log(), temperature=1.0, top_p=0.7, top_k=0)
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(logp[tokens == 0], torch.full_like(logp[tokens == 0], math.log(0.5 / 0.8)))
    torch.testing.assert_close(logp[tokens == 1], torch.full_like(logp[tokens == 1], math.log(0.3 / 0.8)))
    assert abs((tokens == 0).float().mean().item() - 0.5 / 0.8) < 0.04


def test_top_p_always_keeps_top_token():
    tokens, logp = _draw(torch.tensor([0.2, 0.5, 0.3]).log(), n=50, temperature=1.0, top_p=1e-6, top_k=0)
    assert torch.equal(tokens, torch.ones(50, dtype=torch.long))
    assert torch.equal(logp, torch.zeros(50))


def test_top_p_applies_after_top_k():
    # top_k=3 leaves [0.4, 0.3, 0.2] -> renormalised [4/9, 3/9, 2/9]; top_p=0.7 then keeps two.
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    tokens, logp = _draw(probs.log(), n=500, temperature=1.0, top_p=0.7, top_k=3)
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(logp[tokens == 0], torch.full_like(logp[tokens == 0], math.log(4 / 7)))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_log_probs(temperature):
    logits = torch.tensor([1.0, 2.0, 3.0, -1.0])
    tokens, logp = _draw(logits, n=200, temperature=temperature, top_p=1.0, top_k=0)
    z = logits / temperature
    expected = z - torch.logsumexp(z, dim=0)
    torch.testing.assert_close(logp, expected[tokens])
    # Exact values for the top token, by hand.
    e = [math.exp(x / temperature) for x in logits.tolist()]
    top = logp[tokens == 2]
    torch.testing.assert_close(top, torch.full_like(top, math.log(e[2] / sum(e))))


def test_same_seed_same_tokens_whatever_else_is_in_the_batch():
    vocab = 64
    target = torch.randn(vocab, generator=torch.Generator().manual_seed(7))
    others_a = torch.randn(3, vocab, generator=torch.Generator().manual_seed(8))
    others_b = torch.randn(4, vocab, generator=torch.Generator().manual_seed(9))
    # Batch A: the seeded request is row 0; batch B: row 2, other rows, params and seeds differ.
    batch_a = torch.cat([target[None], others_a])
    batch_b = torch.cat([others_b[:2], target[None], others_b[2:]])
    seeds_a = [42, None, 1, None]
    seeds_b = [None, 5, 42, 6, None]
    temp_a = torch.tensor([0.9, 1.0, 0.0, 2.0])
    temp_b = torch.tensor([1.0, 0.3, 0.9, 1.5, 0.0])
    toks_a, toks_b = [], []
    for k in range(20):  # the k-th token of each row: its k-th draw
        ta, la = sample_tokens(batch_a, temp_a, top_p=torch.tensor([0.95, 1.0, 1.0, 0.5]),
                               top_k=torch.tensor([0, 5, 0, 0]), seeds=seeds_a, draws=[k] * 4)  # fmt: skip
        tb, lb = sample_tokens(batch_b, temp_b, top_p=torch.tensor([1.0, 0.2, 0.95, 1.0, 1.0]),
                               top_k=torch.tensor([3, 0, 0, 0, 0]), seeds=seeds_b, draws=[k] * 5)  # fmt: skip
        toks_a.append(ta[0].item())
        toks_b.append(tb[2].item())
        assert la[0].item() == lb[2].item()
    assert toks_a == toks_b
    assert len(set(toks_a)) > 1  # actually random, not accidentally greedy
    # The same seed at draw 0 again replays the sequence from the start.
    replay = [sample_tokens(target[None], 0.9, 0.95, 0, seeds=list([42]))[0].item()]
    assert replay[0] == toks_a[0]


def test_mixed_params_in_one_batch():
    probs = torch.tensor([0.1, 0.45, 0.3, 0.15])
    logits = probs.log().repeat(4, 1)
    temperature = torch.tensor([0.0, 1.0, 1.0, 1.0])
    top_p = torch.tensor([1.0, 1.0, 0.5, 1.0])
    top_k = torch.tensor([0, 1, 0, 0])
    seen = [set() for _ in range(4)]
    for seed in range(200):
        tokens, logp = sample_tokens(logits, temperature, top_p, top_k, seeds=list([seed] * 4))
        # Row 0 greedy: log-prob from the raw softmax; row 1 top_k=1; row 2 top_p=0.5 -> {1, 2}.
        assert tokens[0].item() == 1 and logp[0].item() == pytest.approx(math.log(0.45), abs=1e-6)
        assert tokens[1].item() == 1 and logp[1].item() == 0.0
        expected_row2 = {1: math.log(0.45 / 0.75), 2: math.log(0.3 / 0.75)}
        assert logp[2].item() == pytest.approx(expected_row2[tokens[2].item()], abs=1e-6)
        assert logp[3].item() == pytest.approx(math.log(probs[tokens[3]].item()), abs=1e-6)
        for i in range(4):
            seen[i].add(tokens[i].item())
    assert seen[0] == {1} and seen[1] == {1} and seen[2] == {1, 2} and seen[3] == {0, 1, 2, 3}


def test_bad_shapes_and_seed_count():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="shape"):
        sample_tokens(logits, torch.ones(3), 1.0, 0)
    with pytest.raises(ValueError, match="one entry per row"):
        sample_tokens(logits, 1.0, 1.0, 0, seeds=list([1]))


def test_sampling_params_validate_messages():
    SamplingParams().validate()
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=1).validate()
    cases = [
        (dict(temperature=-0.1), r"temperature .*>= 0"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be an int >= 0"),
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            SamplingParams(**kwargs).validate()


def test_sampling_params_from_dict():
    stops = ["</answer>"]
    sp = SamplingParams.from_dict({"temperature": 0.7, "top_k": 20, "stop": stops, "seed": 3})
    assert sp == SamplingParams(temperature=0.7, top_k=20, stop=["</answer>"], seed=3)
    stops.append("x")
    assert sp.stop == ["</answer>"]  # copied, not aliased
    with pytest.raises(ValueError, match="temprature, top-p"):
        SamplingParams.from_dict({"temprature": 0.7, "top-p": 0.9})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 2.0})


MASK = (1 << 64) - 1


def _mix_ref(x: int) -> int:
    """splitmix64's finaliser on unsigned 64-bit Python integers (the published constants)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def _uniform_ref(seed: int, draw: int) -> float:
    """row_uniforms' formula in plain integers: top 24 bits of mix(mix(seed ^ salt) + (draw + 1) * gamma)."""
    state = (_mix_ref((seed & MASK) ^ 0x5851F42D4C957F2D) + (draw + 1) * 0x9E3779B97F4A7C15) & MASK
    return (_mix_ref(state) >> 40) / (1 << 24)


def test_row_uniforms_are_splitmix64_in_plain_integers():
    # wrapping int64 products and logical shifts give exactly the unsigned reference, seeds of
    # every size and sign included (rollout seeds go up to 2**63 - 1; a user may pass -1)
    from tidal.engine.sampling import row_uniforms

    seeds = [0, 1, 2, 42, 11, 2**31, 2**62 + 12345, 2**63 - 1, -1, -(2**63)]
    draws = [0, 1, 7, 1000, 3, 0, 5, 2**20, 9, 4]
    got = row_uniforms(torch.tensor(seeds), torch.tensor(draws)).tolist()
    assert got == [_uniform_ref(s, d) for s, d in zip(seeds, draws, strict=True)]
    assert all(0.0 <= u < 1.0 for u in got)


def test_row_uniforms_are_uniform_and_turn_seeds_are_not_shifted_streams():
    from tidal.engine.sampling import row_uniforms
    from tidal.rollout.generate import turn_seed

    # 200 seeds x 500 draws: every decile holds 10% of the numbers within 1% (deterministic: fixed seeds)
    seeds = torch.arange(200).repeat_interleave(500)
    draws = torch.arange(500).repeat(200)
    u = row_uniforms(seeds, draws)
    counts = torch.histc(u, bins=10, min=0.0, max=1.0) / u.numel()
    assert (counts - 0.1).abs().max().item() < 0.01
    assert abs(u.mean().item() - 0.5) < 0.005
    # a sample's later turns add multiples of gamma to its seed: their streams are not one
    # stream shifted (the seed is scrambled before the counter is added)
    s0, s1 = 11, turn_seed(11, 1)
    a = row_uniforms(torch.full((50,), s0), torch.arange(50))
    b = row_uniforms(torch.full((50,), s1), torch.arange(50))
    assert not torch.equal(a[1:], b[:-1]) and not torch.equal(a, b)
    assert len(set(a.tolist()) & set(b.tolist())) <= 1


READ_BACKS = {"__bool__", "item", "tolist", "nonzero", "__int__", "__float__", "__index__", "numpy"}


def test_parameters_given_as_lists_draw_without_reading_anything_back(monkeypatch):
    # the engine passes Python lists: what decides how to draw is read from them, never from a
    # tensor (on a GPU every read-back stalls the host until the device catches up). The torch
    # path, as on a GPU: the CPU's native sampler checks its own input, on the host anyway
    from torch.overrides import TorchFunctionMode

    from tidal.engine import native

    monkeypatch.setattr(native, "can_sample", lambda logits: False)

    class Reads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in READ_BACKS:
                self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(2))
    mixed = ([0.0, 1.0, 0.7, 1.0, 1.3, 1.0], [1.0, 1.0, 1.0, 0.9, 1.0, 1.0], [0, 0, 0, 0, 0, 5])
    plain = ([1.0] * 6, [1.0] * 6, [0] * 6)  # the RL case
    for temp, top_p, top_k in (mixed, plain):
        seeds, draws = [1, 2, None, 4, 5, 6], [3] * 6
        with Reads() as reads:
            tokens, logp = sample_tokens(logits, temp, top_p, top_k, seeds, min_p=[0.0] * 6, draws=draws)
        assert reads.seen == []
        # the same draw as with the parameters as tensors (which are read back to decide), seeded rows
        t_tokens, t_logp = sample_tokens(
            logits, torch.tensor(temp), torch.tensor(top_p), torch.tensor(top_k), seeds, draws=draws
        )
        seeded = [0, 1, 3, 4, 5]
        assert torch.equal(tokens[seeded], t_tokens[seeded]) and torch.equal(logp[seeded], t_logp[seeded])
