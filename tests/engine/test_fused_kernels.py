"""The GPU's fused RMSNorm and rotary kernels (`tidal.engine.fused_kernels`), run by Triton's
interpreter on the CPU, against the transformers modules' own ops on the same inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

CHECK = """
import json, sys
from tests.engine.test_fused_kernels import compare
print(json.dumps(compare(sys.argv[1])))
"""


def compare(device: str) -> dict:
    """For float32 and bfloat16: the fraction of elements where each kernel differs from the
    module's ops, and the largest difference in units of the dtype's rounding."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from tidal.engine import fused_kernels

    assert fused_kernels.available(torch.device(device))
    out = {}
    gen = torch.Generator().manual_seed(0)
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        # RMSNorm over 576 (SmolLM2's width, not a power of two) and 64 (a head: Qwen3's q/k norm)
        for width in (576, 64):
            norm = LlamaRMSNorm(width, eps=1e-5).to(device, dtype)
            with torch.no_grad():
                norm.weight.copy_(torch.randn(width, generator=gen).to(dtype))
            x = (torch.randn(7, 3, width, generator=gen) * 4).to(device, dtype)
            with torch.no_grad():
                want = norm(x)
            got = fused_kernels.rms_norm(x, norm.weight, norm.variance_epsilon)
            out[f"rms_norm-{width}-{name}"] = _diff(got, want)
        # rotary: 5 rows, 6 query heads and 2 KV heads of 64; q and k as views of one projection
        b, hq, hk, d = 5, 6, 2, 64
        qkv = torch.randn(b, (hq + 2 * hk) * d, generator=gen).to(device, dtype)
        q, k = qkv[:, : hq * d].view(b, hq, d), qkv[:, hq * d : (hq + hk) * d].view(b, hk, d)
        pos = torch.tensor([0, 3, 17, 200, 4000]).float()
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
        wq, wk = apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2), cos[None], sin[None])
        gq, gk = fused_kernels.rotary(q, k, cos, sin)
        out[f"rotary-q-{name}"] = _diff(gq, wq[0].transpose(0, 1))
        out[f"rotary-k-{name}"] = _diff(gk, wk[0].transpose(0, 1))
    return out


def _diff(got: torch.Tensor, want: torch.Tensor) -> list[float]:
    """[share of elements that differ, largest difference in roundings of the dtype at the
    larger of the two operands' scale (each row's largest magnitude)]."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.abs().float().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    ulps = (got.float() - want.float()).abs() / (torch.finfo(want.dtype).eps * scale)
    return [(got != want).float().mean().item(), ulps.max().item()]


def _check(result: dict, interpreted: bool) -> None:
    for key, (share, ulps) in result.items():
        if interpreted and key.endswith("bfloat16"):
            # the interpreter narrows float32 to bf16 by truncation where a GPU rounds to nearest:
            # a rounding apart at most, per rounding
            assert ulps <= 2.0, (key, ulps)
        elif key.startswith("rotary") and interpreted:
            assert share == 0, (key, share)  # transformers' bits
        elif key.startswith("rotary"):
            # a GPU may fuse a float32 product into the sum (an H100: under one rounding apart on a
            # fifth of the fp32 elements); the engine takes the kernel only where its start-up
            # sample gives transformers' bits (`DecodePath._rope_agrees`)
            assert ulps <= 1.0, (key, ulps)
        elif key.endswith("float32"):  # the sum of squares in another order
            assert ulps <= 4.0, (key, ulps)
        else:  # bf16: the normalised row rounds the same but for a rare tie
            assert share < 0.05 and ulps <= 1.0, (key, share, ulps)


def test_kernels_compute_the_modules_numbers_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    run = subprocess.run([sys.executable, "-c", CHECK, "cpu"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    _check(json.loads(run.stdout.strip().splitlines()[-1]), interpreted=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_compute_the_modules_numbers_on_cuda():
    _check(compare("cuda"), interpreted=False)


ENGINE_CHECK = """
import json, sys
sys.path.insert(0, "tests")
from families import tiny_model
from tidal.engine import native
native.load = lambda: None  # as on a GPU: no C kernels, so the Triton ones are the candidates
from tidal.contracts import SamplingParams
from tidal.engine.llm_engine import LLMEngine
family = sys.argv[1]
engine = LLMEngine(tiny_model(family), None, dtype="float32", block_size=4, kv_cache_tokens=256, native_attention=False)
path = engine.runner.decode_path
fused = sum(
    type(m).__name__.endswith("RMSNorm") and getattr(m.forward, "__qualname__", "").startswith("_inference_only")
    for m in engine.model.modules()
)
params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=6, ignore_eos=True) for i in range(2)]
outs = engine.generate_batch([[3, 4, 5], [9, 8, 7, 6, 5]], params)
print(json.dumps({"fused_rope": path.fused_rope, "checked": engine.runner.decode_path_checked, "fused_modules": fused,
                  "tokens": [o.token_ids for o in outs], "log_probs": [o.log_probs for o in outs]}))
"""


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_engine_takes_them_where_they_agree(family):
    """Where no C kernels are built, the engine's norms and the decode path's rotary embedding
    run the Triton kernels (here interpreted) after their checks, and a generation gives the
    tokens and log-probs of the engine without them."""
    import sys as _sys

    _sys.path.insert(0, "tests")
    from families import tiny_model

    from tidal.contracts import SamplingParams
    from tidal.engine import native
    from tidal.engine.llm_engine import LLMEngine

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    run = subprocess.run(
        [sys.executable, "-c", ENGINE_CHECK, family], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # every RMSNorm (2 layers x 2, the final one; qwen3's q and k norms too) and the rotary
    assert got["fused_rope"] and got["checked"] and got["fused_modules"] == (5 if family == "llama" else 9)
    native_load = native.load
    try:
        native.load = lambda: None
        plain = LLMEngine(tiny_model(family), None, dtype="float32", block_size=4, kv_cache_tokens=256)
        params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=6, ignore_eos=True) for i in range(2)]
        want = plain.generate_batch([[3, 4, 5], [9, 8, 7, 6, 5]], params)
    finally:
        native.load = native_load
    assert got["tokens"] == [o.token_ids for o in want]
    for a, b in zip(got["log_probs"], [o.log_probs for o in want], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
