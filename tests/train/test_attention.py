"""tidal's packed-row attention: the samples of a row attended as a right-padded batch must give
the block-diagonal causal attention exactly, in values and gradients."""

import math

import pytest
import torch
from conftest import make_model

from tidal.train.attention import NAME, packed_attention, packed_layout, use_packed_attention
from tidal.train.batching import collate_packed, packed_attention_mask, packed_response_hidden, supports_packing
from tidal.types import Sample


def test_packed_layout_by_hand():
    # samples of 3, 2 and 4 tokens -> 3 rows of length 4
    lay = packed_layout(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert (lay.batch, lay.length) == (3, 4)
    assert lay.to_packed.tolist() == [0, 1, 2, 4, 5, 8, 9, 10, 11]
    # padding slots copy their sample's first token (3 -> 0; 6, 7 -> 3)
    assert lay.to_padded.tolist() == [0, 1, 2, 0, 3, 4, 3, 3, 5, 6, 7, 8]
    # a sample starts wherever the position does not step by +1, not only at 0
    lay = packed_layout(torch.tensor([[5, 6, 2, 3, 4]]))
    assert (lay.batch, lay.length, lay.to_packed.tolist()) == (2, 3, [0, 1, 3, 4, 5])
    assert packed_layout(torch.tensor([[0]])).to_padded.tolist() == [0]
    with pytest.raises(ValueError, match=r"position_ids must be \[1, S\], got \(2, 3\)"):
        packed_layout(torch.zeros(2, 3, dtype=torch.long))


class Heads(torch.nn.Module):
    """The attributes transformers' attention functions read from an attention module."""

    is_causal = True

    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_packed_attention_equals_block_diagonal_attention(kv_heads, dtype):
    torch.manual_seed(0)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6]])
    s, heads, d = pos.shape[1], 4, 8
    q = torch.randn(1, heads, s, d, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, s, d, dtype=dtype, requires_grad=True)
    v = torch.randn(1, kv_heads, s, d, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(1, s, heads, d, dtype=dtype)
    module = Heads(heads // kv_heads)

    out, weights = packed_attention(module, q, k, v, None, scaling=0.3, tidal_layout=packed_layout(pos))
    assert weights is None and out.shape == (1, s, heads, d) and out.dtype == dtype
    got = [out, *torch.autograd.grad(out, (q, k, v), grad_out)]

    # reference: plain math in float64 with the block-diagonal causal mask
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    rep = heads // kv_heads
    scores = q64 @ k64.repeat_interleave(rep, 1).transpose(-1, -2) * 0.3
    scores = scores.masked_fill(~packed_attention_mask(pos), -math.inf)
    ref = (scores.softmax(-1) @ v64.repeat_interleave(rep, 1)).transpose(1, 2)
    want = [ref, *torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, atol=tol, rtol=tol)


def test_packed_attention_without_a_layout_is_transformers_sdpa():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    mask[1, :, :, 3:] = False  # a padded row
    out, _ = packed_attention(Heads(1), q, k, v, mask, scaling=0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5).transpose(1, 2)
    torch.testing.assert_close(out, want)


def test_a_switched_model_gives_transformers_packed_results():
    model = make_model()
    samples = [
        Sample(
            tokens=list(range(3 + i, 9 + 2 * i)),
            response_length=2 + i,
            loss_mask=[1] * (2 + i),
            rollout_log_probs=[-1.0] * (2 + i),
            index=i,
        )
        for i in range(4)
    ]
    batch = collate_packed(samples)
    want = packed_response_hidden(model.base_model, batch)  # transformers' sdpa, block-diagonal mask
    assert use_packed_attention(model) and model.config._attn_implementation == NAME
    assert supports_packing(model)
    got = packed_response_hidden(model.base_model, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert use_packed_attention(model)  # switching twice is a no-op
    # eager models switch too (Gemma 2's soft-capping is eager-only), with the same results
    eager = make_model(attn_implementation="eager")
    assert use_packed_attention(eager)
    torch.testing.assert_close(packed_response_hidden(eager.base_model, batch), want, atol=1e-5, rtol=0)
    assert not use_packed_attention(make_model(attn_implementation="flex_attention"))


def test_the_cpu_row_attention_keeps_only_the_rows_tensors_and_gives_autograds_bits():
    """On a CPU, plain causal packed attention keeps for the backward none of the padded view's
    tensors (here each sample's copy of a shared 4-token prompt makes 3 x 9 slots of a 13-token
    row), and its output and gradients are the bits autograd gives through the padded view."""
    from tidal.train.attention import _padded_attention, shared_prefix_layout

    torch.manual_seed(2)
    prompt, tails = [0, 1, 2, 3], [[4, 5, 6, 7, 8], [9, 10], [11, 12]]
    lay = shared_prefix_layout([prompt + t for t in tails], [list(range(9)), [4, 5], [4, 5]], 13)
    grad_out = torch.randn(1, 13, 4, 8)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, h, 13, 8, dtype=dtype, requires_grad=True) for h in (4, 2, 2))
        results = {}
        for name in ("padded", "row"):
            shapes = []

            def pack(t, shapes=shapes):
                shapes.append(tuple(t.shape))
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                if name == "row":
                    out, _ = packed_attention(Heads(2), q, k, v, None, scaling=0.3, tidal_layout=lay)
                else:
                    out = _padded_attention(q, k, v, lay, 0.0, 0.3, 0.3, None, None)
            results[name] = [out, *torch.autograd.grad(out, (q, k, v), grad_out.to(dtype))]
            padded = [s for s in shapes if len(s) == 4 and s[0] == 3 and s[2] == 9]
            assert bool(padded) == (name == "padded"), shapes
        for a, b in zip(results["padded"], results["row"], strict=True):
            assert a.dtype == b.dtype == dtype
            assert torch.equal(a, b)
