"""The device paged decode attention (`tidal.engine.paged_kernel`): the Triton kernel, run by
Triton's interpreter on the CPU (TRITON_INTERPRET=1, set before Triton is imported), against the
PyTorch reference and against attention computed straight from each sequence's keys."""

from __future__ import annotations

import json
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
    q = torch.randn(len(lens), heads, d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
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


def prefill_errors(cases: list[dict], device: str) -> list[float]:
    """‖kernel − reference‖ / ‖reference‖ of `prefill_attention` per case; rows of the output that
    belong to no listed sequence must stay as they were (NaN here)."""
    from tidal.engine import paged_kernel as pa

    errs = []
    for c in cases:
        dtype = getattr(torch, c["dtype"])
        bs, hkv, group, d, dv = c["bs"], c["hkv"], c["group"], c["d"], c["dv"]
        cached, news = c["cached"], c["news"]
        k, v = (t.to(device) for t in _cache(128, bs, hkv, d, dv, dtype, c["seed"]))
        tables = _tables([a + b for a, b in zip(cached, news, strict=True)], bs, 128, 40, c["seed"] + 1).to(device)
        gap = 3  # rows of other tokens (a decode token's, say) between the sequences' rows
        starts, at = [], gap
        for n in news:
            starts.append(at)
            at += n + gap
        q = torch.randn(at, hkv * group, d, generator=torch.Generator().manual_seed(c["seed"] + 2)).to(dtype).to(device)
        out = torch.full((at, hkv * group, dv), float("nan"), dtype=dtype, device=device)
        ref = torch.full((at, hkv * group, dv), float("nan"), dtype=torch.float64, device=device)
        t = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
        batch = pa.PrefillBatch(tables, t(starts), t(news), t(cached), max(news))
        args = (batch, bs, c["scale"], c["window"], c["softcap"])
        pa.prefill_attention(q, out, k, v, *args)
        pa.reference_prefill_attention(q.double(), ref, k.double(), v.double(), *args)
        listed = torch.zeros(at, dtype=torch.bool)
        for s0, n in zip(starts, news, strict=True):
            listed[s0 : s0 + n] = True
        assert torch.isnan(out[~listed.to(device)]).all() and torch.isfinite(out[listed.to(device)]).all()
        got, want = out[listed.to(device)].double(), ref[listed.to(device)]
        errs.append(((got - want).norm() / want.norm()).item())
    return errs


PREFILL_CASES = [
    # a fresh prompt, one after a cached prefix (a multi-turn continuation), one longer than a tile
    {"dtype": "float32", "bs": 16, "hkv": 3, "group": 3, "d": 64, "dv": 64, "cached": [0, 32, 16], "news": [5, 9, 70],
     "scale": 0.125, "window": None, "softcap": None, "seed": 0},
    {"dtype": "bfloat16", "bs": 16, "hkv": 2, "group": 2, "d": 128, "dv": 128, "cached": [48, 0], "news": [17, 33],
     "scale": 0.088, "window": None, "softcap": None, "seed": 3},
    # a sliding window shorter than the prefix and than the new tokens; soft-capping; block size 8
    {"dtype": "float32", "bs": 8, "hkv": 2, "group": 4, "d": 32, "dv": 32, "cached": [24, 0, 3], "news": [12, 40, 1],
     "scale": 0.2, "window": 10, "softcap": 50.0, "seed": 6},
    {"dtype": "float32", "bs": 4, "hkv": 3, "group": 1, "d": 80, "dv": 48, "cached": [5, 0], "news": [7, 66],
     "scale": 0.11, "window": 3, "softcap": None, "seed": 9},
]  # fmt: skip

PREFILL_CHECK = """
import json, sys
from tests.engine.test_paged_kernel import prefill_errors
print(json.dumps(prefill_errors(json.loads(sys.argv[1]), "cpu")))
"""


def _check_prefill(errs: list[float]) -> None:
    for case, err in zip(PREFILL_CASES, errs, strict=True):
        bound = 1e-6 if case["dtype"] == "float32" else 1e-2
        assert err < bound, (case, err)


def test_prefill_kernel_matches_the_reference_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    run = subprocess.run(
        [sys.executable, "-c", PREFILL_CHECK, json.dumps(PREFILL_CASES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    _check_prefill(json.loads(run.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefill_kernel_matches_the_reference_on_cuda():
    _check_prefill(prefill_errors(PREFILL_CASES, "cuda"))


ENGINE_CHECK = """
import json, sys
sys.path.insert(0, "tests")
from families import tiny_model
from tidal.contracts import SamplingParams
from tidal.engine.llm_engine import LLMEngine
from tests.engine.test_paged_kernel import ENGINE_PROMPTS, engine_params
family = sys.argv[1]
engine = LLMEngine(tiny_model(family), None, dtype="float32", block_size=4, kv_cache_tokens=512, max_num_seqs=8)
assert engine.runner.use_static_decode(8, engine.max_model_len, capture=False) is None
assert engine.runner.kernel  # Triton's interpreter: the GPU's kernels, decode and prefill
first = engine.generate_batch(ENGINE_PROMPTS, engine_params())
turn = ENGINE_PROMPTS[1] + first[1].token_ids + [33, 44]  # a continuation: a prefill over cached blocks
again = engine.generate_batch([turn], [SamplingParams(temperature=0.0, max_new_tokens=4)])
print(json.dumps([[o.token_ids, o.log_probs] for o in first + again] + [engine.blocks.hits]))
"""

ENGINE_PROMPTS = [[1, 5, 9], list(range(40, 60)), list(range(40, 60)), [7, 300, 17, 250, 99, 3, 64, 128, 190, 211]]


def engine_params() -> list:
    from tidal.contracts import SamplingParams

    return [SamplingParams(temperature=1.0, seed=i, max_new_tokens=8, ignore_eos=True) for i in range(4)]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_the_engine_on_the_kernels_gives_its_usual_tokens(family):
    """The whole GPU path but the graphs, on the CPU: prefill (a group's shared prompt, a
    continuation over cached blocks, a sliding window for mistral) and decode steps through the
    Triton kernels in the interpreter give the plain CPU engine's tokens."""
    import sys as _sys

    _sys.path.insert(0, "tests")
    from families import tiny_model

    from tidal.contracts import SamplingParams
    from tidal.engine.llm_engine import LLMEngine

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    run = subprocess.run(
        [sys.executable, "-c", ENGINE_CHECK, family], capture_output=True, text=True, env=env, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    *got, hits = json.loads(run.stdout.strip().splitlines()[-1])
    plain = LLMEngine(tiny_model(family), None, dtype="float32", block_size=4, kv_cache_tokens=512, max_num_seqs=8)
    first = plain.generate_batch(ENGINE_PROMPTS, engine_params())
    turn = ENGINE_PROMPTS[1] + first[1].token_ids + [33, 44]
    again = plain.generate_batch([turn], [SamplingParams(temperature=0.0, max_new_tokens=4)])
    assert hits == plain.blocks.hits and hits >= 7  # the continuation found the first turn's blocks
    for (tokens, lps), want in zip(got, first + again, strict=True):
        assert tokens == want.token_ids
        assert max(abs(a - b) for a, b in zip(lps, want.log_probs, strict=True)) < 1e-5
