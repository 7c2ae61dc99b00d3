"""The device paged decode attention (`tidal.engine.paged_kernel`): the Triton kernel, run by
Triton's interpreter on the CPU (TRITON_INTERPRET=1, set before Triton is imported), against the
PyTorch reference and against attention computed straight from each sequence's keys."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tidal.attend import attend, causal_mask
from tidal.engine.paged_kernel import context_slots, reference_decode_attention

pytest.importorskip("triton")


def _cache(blocks, bs, hkv, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks * bs, hkv, d, generator=g).to(dtype)
    v = torch.randn(blocks * bs, hkv, dv, generator=g).to(dtype)
    return k, v


def _tables(lens, bs, blocks, width, seed):
    """Block tables with holes: each sequence gets random distinct blocks (not in order), the
    unused columns hold junk ids, so only the table's first ceil(len / bs) entries may be read."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(blocks, generator=g)
    tables = torch.randint(0, blocks, (len(lens), width), generator=g, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        need = -(-n // bs)
        tables[i, :need] = order[used : used + need].to(torch.int32)
        used += need
    return tables


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 30.0), (7, 20.0)])
def test_reference_equals_attention_over_each_sequences_keys(window, softcap):
    bs, hkv, heads, d = 4, 2, 6, 16
    lens = [1, 5, 12, 9]
    k, v = _cache(16, bs, hkv, d, d, torch.float64, 0)
    tables = _tables(lens, bs, 16, 4, 1)
    q = torch.randn(len(lens), heads, d, dtype=torch.float64)
    got = reference_decode_attention(q, k, v, tables, torch.tensor(lens), bs, 0.3, window, softcap)
    for i, n in enumerate(lens):
        slots = torch.cat([torch.arange(int(b) * bs, int(b) * bs + bs) for b in tables[i, : -(-n // bs)]])[:n]
        ks, vs = k[slots].transpose(0, 1)[None], v[slots].transpose(0, 1)[None]
        mask = causal_mask(1, n, n - 1, window)
        want = attend(q[i][None, :, None, :], ks, vs, mask, 0.3, softcap)[0, :, 0]
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-12)


def test_context_slots_skip_holes():
    tables = torch.tensor([[3, 0, 9], [7, 2, 5]], dtype=torch.int32)
    slots, seen = context_slots(tables, torch.tensor([3, 6]), 2)
    assert slots.tolist() == [[6, 7, 0, 0, 0, 0], [14, 15, 4, 5, 10, 11]]
    assert seen.tolist() == [[True] * 3 + [False] * 3, [True] * 6]


def kernel_errors(cases: list[dict], device: str) -> list[float]:
    """‖kernel − reference‖ / ‖reference‖ per case (the reference in float64 on the same inputs)."""
    from tidal.engine import paged_kernel as pa

    assert pa.runs_on(torch.device(device))
    errs = []
    for c in cases:
        dtype = getattr(torch, c["dtype"])
        bs, hkv, group, d, dv, lens = c["bs"], c["hkv"], c["group"], c["d"], c["dv"], c["lens"]
        k, v = (t.to(device) for t in _cache(64, bs, hkv, d, dv, dtype, c["seed"]))
        tables = _tables(lens, bs, 64, 40, c["seed"] + 1).to(device)
        q = torch.randn(len(lens), hkv * group, d, generator=torch.Generator().manual_seed(c["seed"] + 2)).to(dtype)
        if c.get("strided_q"):  # q as a view of a wider tensor, as the model hands it over
            wide = torch.randn(len(lens), hkv * group, d + 8).to(dtype)
            wide[..., :d] = q
            q = wide[..., :d]
        q, lens_t = q.to(device), torch.tensor(lens, device=device)
        got = pa.decode_attention(q, k, v, tables, lens_t, bs, c["scale"], c["window"], c["softcap"])
        ref = pa.reference_decode_attention(
            q.double(), k.double(), v.double(), tables, lens_t, bs, c["scale"], c["window"], c["softcap"]
        )
        assert torch.isfinite(got).all()
        errs.append(((got.double() - ref).norm() / ref.norm()).item())
    return errs


KERNEL_CHECK = """
import json, sys
from tests.engine.test_paged_kernel import kernel_errors
print(json.dumps(kernel_errors(json.loads(sys.argv[1]), "cpu")))
"""

CASES = [
    # SmolLM2's shape (3 KV heads of 3 query heads, 64 wide), ragged lengths across tile edges
    {
        "dtype": "float32",
        "bs": 16,
        "hkv": 3,
        "group": 3,
        "d": 64,
        "dv": 64,
        "lens": [1, 15, 16, 17, 64, 65, 130],
        "scale": 0.125,
        "window": None,
        "softcap": None,
        "seed": 0,
    },
    # Qwen3's grouping (2 query heads per KV head, 128 wide) in bf16, q a strided view
    {
        "dtype": "bfloat16",
        "bs": 16,
        "hkv": 2,
        "group": 2,
        "d": 128,
        "dv": 128,
        "lens": [3, 100, 33],
        "scale": 0.088,
        "window": None,
        "softcap": None,
        "seed": 3,
        "strided_q": True,
    },
    # sliding window shorter and longer than some contexts; Gemma 2's soft-capping; block size 8
    {
        "dtype": "float32",
        "bs": 8,
        "hkv": 2,
        "group": 4,
        "d": 32,
        "dv": 32,
        "lens": [2, 9, 40, 77],
        "scale": 0.2,
        "window": 10,
        "softcap": 50.0,
        "seed": 6,
    },
    # widths that are not powers of two, keys wider than values (padded lanes masked), no grouping
    {
        "dtype": "float32",
        "bs": 4,
        "hkv": 3,
        "group": 1,
        "d": 80,
        "dv": 48,
        "lens": [5, 23, 1],
        "scale": 0.11,
        "window": 3,
        "softcap": None,
        "seed": 9,
    },
]


def test_kernel_matches_the_reference_in_the_interpreter():
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    run = subprocess.run(
        [sys.executable, "-c", KERNEL_CHECK, json.dumps(CASES)], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    _check(json.loads(run.stdout.strip().splitlines()[-1]))


def _check(errs: list[float]) -> None:
    for case, err in zip(CASES, errs, strict=True):
        bound = 1e-6 if case["dtype"] == "float32" else 1e-2
        assert err < bound, (case, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_matches_the_reference_on_cuda():
    _check(kernel_errors(CASES, "cuda"))
