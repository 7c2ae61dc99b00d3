"""The fused ops (`tidal.engine.native.rms_norm`, `silu_mul`, `rotary`) against transformers'
modules and functions and torch's ops (the norm and the rotary embedding bit for bit in bfloat16),
and `tidal.engine.fuse` replacing exactly the modules they compute alike."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model
from families import tiny_model
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from tidal.engine import fuse, native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the modules keep their forwards")


def _norm(width: int, dtype: torch.dtype, eps: float = 1e-5) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(width, eps=eps)
    norm.weight.data = (torch.rand(width) * 2 - 0.5).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 576), (37, 576), (300, 64), (5, 8)])
def test_rms_norm_is_the_module(dtype, rows, width):
    """bfloat16: the module's bits (the normalised row rounded, then the weight's product rounded,
    as its ops round); float32: within the order of a row's sum of squares."""
    torch.manual_seed(rows)
    norm = _norm(width, dtype)
    x = (torch.randn(2, rows, width) * 3).to(dtype)
    with torch.no_grad():
        want = norm(x)
    got = native.rms_norm(x, norm.weight, 1e-5)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


def test_rms_norm_reads_strided_rows_and_splits_threads_without_changing_them():
    torch.manual_seed(1)
    norm = _norm(64, torch.bfloat16)
    x = torch.randn(700, 128).bfloat16()[:, 32:96]  # rows 128 apart
    assert x.stride() == (128, 1)
    want = norm(x).detach()
    outs = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        outs.append(native.rms_norm(x, norm.weight, 1e-5))
    torch.set_num_threads(2)
    assert all(torch.equal(o, want) for o in outs)


def test_silu_mul_is_torchs_two_ops():
    torch.manual_seed(3)
    g = torch.randn(41, 1536) * 5
    g[0, :8] = torch.tensor([0.0, -0.0, 1e-6, -1e-6, 80.0, -80.0, 200.0, -200.0])
    g[1, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    u = torch.randn(41, 1536)
    want = F.silu(g) * u
    got = native.silu_mul(g, u)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30, equal_nan=True)
    assert torch.isnan(got[1, 1:3]).all() and got[1, 0] == u[1, 0] * float("inf")
    assert got[0, 7] == 0  # silu(-200) underflows to 0
    strided = torch.randn(41, 3072)[:, 1536:]  # gate and up as halves of one row
    torch.testing.assert_close(native.silu_mul(strided, u), F.silu(strided) * u, rtol=1e-6, atol=1e-30)


def test_fused_ops_refuse_what_they_cannot_take():
    x = torch.randn(3, 12)
    with pytest.raises(ValueError, match=r"native.rms_norm: float32 or bfloat16 CPU rows a multiple of 8 wide"):
        native.rms_norm(x, torch.ones(12), 1e-5)
    with pytest.raises(ValueError, match=r"native.rms_norm: weight \(16,\) torch.bfloat16, rows \(3, 16\)"):
        native.rms_norm(torch.randn(3, 16), torch.ones(16, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match=r"native.silu_mul: gate \(3, 16\) torch.float32, up \(3, 8\)"):
        native.silu_mul(torch.randn(3, 16), torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"torch.bfloat16: float32 of the same shape expected"):
        native.silu_mul(torch.randn(3, 16).bfloat16(), torch.randn(3, 16).bfloat16())
    with pytest.raises(ValueError, match=r"native.silu_mul: float32 or bfloat16 CPU rows a multiple of 8 wide"):
        native.silu_mul(torch.randn(3, 12), torch.randn(3, 12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_replaces_llamas_norms_and_mlps_and_keeps_its_logits(dtype):
    model = make_model(num_hidden_layers=3).to(dtype)
    ids = torch.randint(3, 320, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    assert fuse.fuse(model) == {"rms_norm": 7, "mlp": 3}  # norms: two per layer, the final one
    with torch.no_grad():
        got = model(ids).logits
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)  # the norms' bits; bfloat16 MLPs keep torch's ops (as fast)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fuse_leaves_modules_of_another_formula():
    """Gemma-2's (1 + w) norms and GeLU MLP are not what the fused ops compute: kept."""
    model = tiny_model("gemma2")
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and fuse.fuse(model) == {"rms_norm": 0, "mlp": 0}
    assert not any("forward" in m.__dict__ for m in norms)


def test_fused_forwards_step_aside_for_gradients():
    """With gradients enabled the modules run their own forwards (the C ops have no backward)."""
    model = make_model()
    ids = torch.randint(3, 320, (1, 7), generator=torch.Generator().manual_seed(1))
    loss_own = model(ids).logits.logsumexp(-1).sum()
    loss_own.backward()
    grad_own = model.model.norm.weight.grad.clone()
    model.zero_grad()
    fuse.fuse(model)
    loss = model(ids).logits.logsumexp(-1).sum()
    loss.backward()
    torch.testing.assert_close(loss, loss_own, rtol=0, atol=0)
    torch.testing.assert_close(model.model.norm.weight.grad, grad_own, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_transformers_function(dtype):
    """The bits of `apply_rotary_pos_emb` on the [1, heads, T, D] views the attention module makes."""
    torch.manual_seed(4)
    t, d = 7, 64
    angle = torch.rand(1, t, d) * 50
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    q, k = torch.randn(t, 9 * d).to(dtype), torch.randn(t, 3 * d).to(dtype)
    want_q, want_k = apply_rotary_pos_emb(
        q.view(1, t, 9, d).transpose(1, 2), k.view(1, t, 3, d).transpose(1, 2), cos, sin
    )
    got_q, got_k = (native.rotary(x.view(t, -1, d), cos[0], sin[0]) for x in (q, k))
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))
    # q and k as column ranges of one joined product: tokens 12 heads apart
    qk = torch.cat([q, k], dim=1)
    got_q, got_k = (native.rotary(x.view(t, -1, d), cos[0], sin[0]) for x in (qk[:, : 9 * d], qk[:, 9 * d :]))
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))
    with pytest.raises(ValueError, match=r"native.rotary: x \(7, 9, 24\) .*: x \[T, H, D\] \(D a multiple of 16\)"):
        native.rotary(torch.randn(t, 9, 24).to(dtype), cos[0, :, :24], sin[0, :, :24])


def test_a_fused_mlp_calls_projections_replaced_after_it():
    """A trainer's LoRA layers given to the engine replace its projections after start-up: the
    fused forward calls the module's current ones."""
    model = make_model()
    fuse.fuse(model)
    mlp = model.model.layers[0].mlp
    torch.manual_seed(5)
    mlp.up_proj = torch.nn.Linear(64, 128, bias=True)
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), type(mlp).forward(mlp, x), rtol=1e-6, atol=1e-6)
