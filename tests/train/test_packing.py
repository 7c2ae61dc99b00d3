"""Dynamic batching: token-budget micro-batches and padding-free packed rows must score every
response token exactly as the padded batch does (log-probs and gradients)."""

import random
import types

import pytest
import torch
from conftest import make_model

from tidal.train.batching import (
    collate,
    collate_packed,
    packed_attention_mask,
    packed_response_hidden,
    padded_response_hidden,
    supports_packing,
    token_budget_batches,
)
from tidal.types import Sample


def sample(prompt, response, mask=None, index=0):
    r = len(response)
    mask = [1] * r if mask is None else mask
    lp = [-0.5 - 0.1 * j for j in range(r)]
    return Sample(tokens=prompt + response, response_length=r, loss_mask=mask, rollout_log_probs=lp, index=index)


def make_samples(n=5, seed=0, vocab=320):
    """Mixed prompt/response lengths, one masked (tool-output-like) span, one empty response."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
        r = 0 if i == 3 else rng.randrange(1, 13)
        mask = [1] * r
        if r > 4 and i % 2 == 0:
            mask[1:3] = [0, 0]
        out.append(sample(p, [rng.randrange(vocab) for _ in range(r)], mask, index=i))
    return out


def response_log_probs(model, hidden, batch):
    logits = model.get_output_embeddings()(hidden).float()
    return torch.log_softmax(logits, -1).gather(-1, batch["response_ids"][..., None])[..., 0]


def valid_mask(samples, r):
    return torch.arange(r)[None, :] < torch.tensor([s.response_length for s in samples])[:, None]


def packed_lp(model, samples, **kw):
    batch = collate_packed(samples)
    return response_log_probs(model, packed_response_hidden(model.base_model, batch, **kw), batch), batch


def padded_lp(model, samples):
    batch = collate(samples)
    return response_log_probs(model, padded_response_hidden(model.base_model, batch), batch), batch


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def assert_grads_close(got, want, rel=1e-5):
    for g, w in zip(got, want, strict=True):
        assert (g - w).norm() <= rel * w.norm() + 1e-12
    flat_g, flat_w = torch.cat([g.flatten() for g in got]), torch.cat([w.flatten() for w in want])
    assert flat_w.norm() > 0
    assert (flat_g - flat_w).norm() <= rel * flat_w.norm()


# ------------------------------------------------------------------ token_budget_batches
@pytest.mark.parametrize(
    ("lengths", "budget", "want"),
    [
        ([5, 3, 4, 2, 9], 8, [[0, 1], [2, 3], [4]]),  # 5+3 fills bin 0; 4+2 bin 1; 9 > 8 alone
        ([3, 6, 2, 5, 1, 4], 7, [[0, 2, 4], [1], [3], [5]]),  # 1 goes to the first bin it fits (bin 0)
        ([6, 6, 2, 2], 8, [[0, 2], [1, 3]]),  # later samples go back to earlier open bins
        ([10, 1, 12, 2], 8, [[0], [1, 3], [2]]),  # oversized samples each sit alone
        ([8, 8], 8, [[0], [1]]),  # exactly the budget fits
        ([0, 8, 0], 8, [[0, 1, 2]]),
        ([1, 2, 3], 100, [[0, 1, 2]]),
        ([], 8, []),
    ],
)
def test_token_budget_batches_first_fit(lengths, budget, want):
    assert token_budget_batches(lengths, budget) == want


def test_token_budget_batches_covers_every_index_once_within_budget():
    rng = random.Random(3)
    lengths = [rng.randrange(1, 40) for _ in range(200)]
    bins = token_budget_batches(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(200))
    for b in bins:
        assert b == sorted(b)
        total = sum(lengths[i] for i in b)
        assert total <= 64 or len(b) == 1
    assert bins == token_budget_batches(lengths, 64)  # deterministic
    assert token_budget_batches(lengths, 1) == [[i] for i in range(200)]


@pytest.mark.parametrize("budget", [0, -3])
def test_token_budget_batches_rejects_a_non_positive_budget(budget):
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        token_budget_batches([1, 2], budget)


# ------------------------------------------------------------------ collate_packed
def test_collate_packed_by_hand():
    a = sample([10, 11, 12], [13, 14], [1, 0])
    b = sample([20], [21, 22, 23])
    batch = collate_packed([a, b], pad_id=7)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 14, 20, 21, 22, 23]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    # 13 (row pos 3) is predicted from pos 2, 14 from 3; 21 (pos 6) from 5, 22 from 6, 23 from 7
    assert batch["response_index"].tolist() == [[2, 3, 0], [5, 6, 7]]
    assert batch["response_index"].dtype == torch.long
    assert batch["prompt_lengths"].tolist() == [3, 1]
    assert batch["response_ids"].tolist() == [[13, 14, 7], [21, 22, 23]]
    assert batch["loss_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    padded = collate([a, b], pad_id=7)
    for key in ("prompt_lengths", "response_ids", "loss_mask", "rollout_log_probs"):
        assert torch.equal(batch[key], padded[key]), key
        assert batch[key].dtype == padded[key].dtype, key


def test_collate_packed_index_points_at_the_token_before_each_response_token():
    samples = make_samples(6, seed=1)
    batch = collate_packed(samples)
    total = sum(len(s.tokens) for s in samples)
    assert batch["input_ids"].shape == batch["position_ids"].shape == (1, total)
    r = max(s.response_length for s in samples)
    assert batch["response_index"].shape == (6, r)
    ok = valid_mask(samples, r)
    nxt = batch["input_ids"][0, batch["response_index"] + 1]
    assert torch.equal(nxt[ok], batch["response_ids"][ok])
    assert (batch["response_index"][~ok] == 0).all()
    assert (
        batch["position_ids"][0, batch["response_index"][ok]]
        == batch["prompt_lengths"].repeat_interleave(torch.tensor([s.response_length for s in samples]))
        - 1
        + torch.cat([torch.arange(s.response_length) for s in samples])
    ).all()


def test_collate_packed_edge_cases():
    batch = collate_packed([sample([5, 6], [])])
    assert batch["response_index"].tolist() == [[0]] and batch["loss_mask"].tolist() == [[0.0]]
    with pytest.raises(ValueError, match="no prompt token"):
        collate_packed([sample([5], [6]), sample([], [7, 8])])
    with pytest.raises(ValueError, match="no samples"):
        collate_packed([])


def test_packed_attention_mask_is_block_diagonal_causal():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1]])
    m = packed_attention_mask(pos)[0, 0]
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m, want)
    add = packed_attention_mask(pos, torch.float32)[0, 0]
    assert torch.equal(add == 0, want) and (add[~want] == torch.finfo(torch.float32).min).all()


# ------------------------------------------------------------------ exactness
def test_padded_path_matches_unbatched_forward():
    model = make_model()
    samples = make_samples()
    with torch.no_grad():
        lp, batch = padded_lp(model, samples)
        for i, s in enumerate(samples):
            logits = model(torch.tensor([s.tokens])).logits[0].float()
            want = torch.log_softmax(logits, -1)[s.prompt_length - 1 : -1]
            want = want.gather(1, torch.tensor(s.response_tokens, dtype=torch.long)[:, None])[:, 0]
            torch.testing.assert_close(lp[i, : s.response_length], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("explicit_mask", [False, True])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_log_probs_and_gradients_equal_padded(impl, explicit_mask):
    model = make_model(attn_implementation=impl)
    assert model.config._attn_implementation == impl and supports_packing(model)
    samples = make_samples()
    ok = valid_mask(samples, max(s.response_length for s in samples))

    lp_pad, batch = padded_lp(model, samples)
    g_pad = grads_of(model, (lp_pad * batch["loss_mask"]).sum())
    lp_pack, batch_p = packed_lp(model, samples, explicit_mask=explicit_mask)
    g_pack = grads_of(model, (lp_pack * batch_p["loss_mask"]).sum())

    assert lp_pack.shape == lp_pad.shape
    torch.testing.assert_close(lp_pack[ok], lp_pad[ok], atol=1e-5, rtol=0)
    assert_grads_close(g_pack, g_pad)


def test_token_budget_micro_batches_accumulate_the_padded_gradient():
    model = make_model()
    samples = make_samples(8, seed=2)
    lp_pad, batch = padded_lp(model, samples)
    g_pad = grads_of(model, (lp_pad * batch["loss_mask"]).sum())

    bins = token_budget_batches([len(s.tokens) for s in samples], 24)
    assert 2 < len(bins) < len(samples)  # several micro-batches, some holding several samples
    model.zero_grad(set_to_none=True)
    for b in bins:
        lp, mb = packed_lp(model, [samples[i] for i in b])
        (lp * mb["loss_mask"]).sum().backward()
    assert_grads_close([p.grad for p in model.parameters()], g_pad)


def test_default_use_cache_silently_disables_packing_detection():
    """Why the helpers pass use_cache=False: with the config default (True) the model builds an
    empty DynamicCache, transformers skips find_packed_sequence_indices and samples in a row attend
    to each other. If this starts failing, transformers changed that behaviour."""
    model = make_model()
    samples = make_samples()
    batch = collate_packed(samples)
    ok = valid_mask(samples, batch["response_ids"].shape[1])
    with torch.no_grad():
        lp_pad, _ = padded_lp(model, samples)
        h = model.base_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
        leaky = response_log_probs(model, h[0, batch["response_index"]], batch)
    assert (leaky[ok] - lp_pad[ok]).abs().max() > 1e-2


def test_packed_under_bf16_autocast_stays_close_to_padded():
    model = make_model()
    samples = make_samples()
    ok = valid_mask(samples, max(s.response_length for s in samples))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lp_pad, _ = padded_lp(model, samples)
        for explicit in (False, True):
            lp_pack, _ = packed_lp(model, samples, explicit_mask=explicit)
            torch.testing.assert_close(lp_pack[ok], lp_pad[ok], atol=1e-2, rtol=0)  # bf16 noise ~1e-3; a leak is ~0.3


def test_supports_packing():
    assert supports_packing(make_model(attn_implementation="sdpa"))
    assert supports_packing(make_model(attn_implementation="eager"))
    assert supports_packing(make_model().base_model)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2"))
    assert not supports_packing(fake)
    bidirectional = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="sdpa", is_causal=False))
    assert not supports_packing(bidirectional)
    assert not supports_packing(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------ shared prompts
def grouped_samples(groups=3, n=4, seed=0, vocab=320):
    """GRPO-like: `groups` prompts with `n` responses each (one empty, one with a masked span)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        p = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
        for j in range(n):
            r = 0 if (g, j) == (1, 2) else rng.randrange(1, 11)
            mask = [1] * r
            if r > 4 and j == 1:
                mask[1:3] = [0, 0]
            out.append(sample(p, [rng.randrange(vocab) for _ in range(r)], mask, index=g * n + j))
    return out


def test_shared_prompts_store_each_prompt_once():
    p, q = [5, 6, 7], [9, 8]
    samples = [sample(p, [1, 2]), sample(p, [3]), sample(q, [4, 4, 4]), sample(p, [7, 7])]
    batch = collate_packed(samples, share_prompts=True)
    # p + [1, 2], then [3] continuing p, then q + [4, 4, 4], then [7, 7] continuing p
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1, 2, 3, 9, 8, 4, 4, 4, 7, 7]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 4, 3, 4]]
    # each response token is predicted from the row position of the token before it in its sample
    assert batch["response_index"].tolist() == [[2, 3, 0], [2, 0, 0], [7, 8, 9], [2, 11, 0]]
    lay = batch["layout"]
    assert (lay.batch, lay.length) == (4, 5)
    # sample 1's padded view: the shared prompt's positions, then its own token
    assert lay.to_padded.view(4, 5)[1, :4].tolist() == [0, 1, 2, 5]
    # every row position is computed by exactly one sample: the prompt by the first that holds it
    owner = (lay.to_packed // lay.length).tolist()
    assert owner == [0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prompts_give_the_unshared_log_probs_and_gradients(dtype):
    from tidal.train.attention import use_packed_attention

    model = make_model()
    assert use_packed_attention(model)
    model.to(dtype)
    samples = grouped_samples()
    ok = valid_mask(samples, max(s.response_length for s in samples))
    plain = collate_packed(samples)
    shared = collate_packed(samples, share_prompts=True)
    assert shared["input_ids"].shape[1] < plain["input_ids"].shape[1]
    got = {}
    for name, batch in (("plain", plain), ("shared", shared)):
        lp = response_log_probs(model, packed_response_hidden(model.base_model, batch), batch)
        got[name] = (lp, grads_of(model, (lp * batch["loss_mask"]).sum()))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got["shared"][0][ok], got["plain"][0][ok], atol=tol, rtol=0)
    assert_grads_close(got["shared"][1], got["plain"][1], rel=1e-5 if dtype == torch.float32 else 2e-2)


def test_shared_prompts_need_the_packed_attention():
    model = make_model(attn_implementation="sdpa")
    batch = collate_packed(grouped_samples(), share_prompts=True)
    with pytest.raises(ValueError, match="needs the tidal_packed attention"):
        packed_response_hidden(model.base_model, batch)


def test_token_budget_counts_a_shared_prompt_once():
    lengths = [10, 10, 10, 10]  # prompt 6 + response 4 each, one prompt
    prompts = [("p", 6)] * 4
    assert token_budget_batches(lengths, 20) == [[0, 1], [2, 3]]
    assert token_budget_batches(lengths, 20, prompts) == [[0, 1, 2], [3]]  # 10 + 4 + 4 = 18
    assert token_budget_batches(lengths, 22, prompts) == [[0, 1, 2, 3]]  # 10 + 3 * 4 = 22


def test_a_shared_prompts_last_position_sums_its_samples_gradients_in_index_order():
    """A group's samples all read their prompt's last position: its gradient is their gradients'
    sum, added in the order of `response_index` (row-major), so a step repeats bit for bit. In
    float32, 1e8 + 1 rounds back to 1e8, so the order shows: in index order
    ((1e8 + 1) + 0 + 0) - 1e8 + 1 is 1; other orders give 0 or 2. At this size plain indexing's
    backward (an accumulating index_put) splits the rows between threads, which add into the shared
    row at once (2 on two threads, its order varying with their timing on larger steps)."""
    p = [5, 6, 7]
    samples = [sample(p, list(range(10, 26))) for _ in range(8)]
    batch = collate_packed(samples, share_prompts=True)
    assert batch["response_index"][:, 0].tolist() == [2] * 8  # each first token from position 2
    hidden = torch.zeros(1, batch["input_ids"].shape[1], 1024, requires_grad=True)
    base = lambda **kw: types.SimpleNamespace(last_hidden_state=hidden * 1.0)  # noqa: E731
    base.config = types.SimpleNamespace(_attn_implementation="tidal_packed")
    out = packed_response_hidden(base, batch)
    grad = torch.zeros_like(out)
    grad[:, 0, :] = torch.tensor([1e8, 1.0, 0.0, 0.0, -1e8, 1.0, 0.0, 0.0])[:, None]
    out.backward(grad)
    assert hidden.grad[0, 2].eq(1.0).all()
