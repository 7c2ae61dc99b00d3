"""The native decode attention (`tidal.engine.native`): the C kernel against the shared attention
formula over gathered keys, the engine sampling the same tokens with it as without it, and how it
is built, refused and turned off."""

from __future__ import annotations

import logging
import math
import shutil

import pytest
import torch
from conftest import make_model

from tidal.attend import attend
from tidal.contracts import SamplingParams
from tidal.engine import native
from tidal.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the engine keeps the torch path")


def reference(q, k_cache, v_cache, slots, lengths, scale, window=None, softcap=None):
    """The torch path's formula: keys and values gathered per sequence, masked past each length
    (and outside a sliding window), grouped-query heads as `attend` maps them."""
    b, c = slots.shape
    kd, vd = k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2)  # [B, Hkv, C, D]
    pos = torch.arange(c)[None]
    mask = pos < lengths[:, None]
    if window:
        mask &= pos > lengths[:, None] - 1 - window
    return attend(q[:, :, None], kd, vd, mask[:, None, None], scale, softcap)[:, :, 0]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "dv", "window", "softcap"),
    [
        (9, 3, 64, 64, None, None),  # SmolLM2's grouped-query shape
        (4, 4, 32, 32, None, None),  # one query head per KV head
        (8, 2, 24, 16, None, None),  # keys wider than values (MLA), widths not a multiple of 32
        (6, 3, 64, 64, 5, None),  # sliding window
        (6, 2, 16, 16, None, 3.0),  # soft-capping (Gemma 2)
        (6, 2, 16, 16, 4, 2.0),
    ],
)
def test_kernel_matches_the_attention_formula(heads, kv_heads, d, dv, window, softcap):
    torch.manual_seed(0)
    b, c, n = 7, 23, 300
    k_cache, v_cache = torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, dv)
    lengths = torch.tensor([23, 1, 2, 9, 17, 4, 23])
    slots = torch.stack([torch.randperm(n)[:c] for _ in range(b)])  # scattered rows, as blocks are
    slots[lengths[:, None] <= torch.arange(c)[None]] = 0  # past the length: slot 0, as the plan pads
    # the query as the engine passes it: a transposed view of [1, H, B, D]
    q = torch.randn(1, heads, b, d)[0].transpose(0, 1)
    assert not q.is_contiguous()
    got = native.decode_attention(q, k_cache, v_cache, slots, lengths, 0.3, window, softcap)
    want = reference(q, k_cache, v_cache, slots, lengths, 0.3, window, softcap)
    assert got.shape == (b, heads, dv)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    # sequence 1 (one key) reads exactly its value row: softmax of one score is 1
    torch.testing.assert_close(got[1], v_cache[slots[1, 0]].repeat_interleave(heads // kv_heads, 0), rtol=0, atol=1e-7)


@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(9, 3, None), (6, 2, 4)])
def test_kernel_reads_a_bfloat16_cache(heads, kv_heads, window):
    """A bfloat16 cache and query (the engine's dtype where bf16 is native): the formula in
    float32 over the same bf16 numbers, the output rounded once to bf16 (so within one bf16 step)."""
    torch.manual_seed(2)
    b, c, n, d = 5, 19, 200, 64
    k_cache, v_cache = torch.randn(n, kv_heads, d).bfloat16(), torch.randn(n, kv_heads, d).bfloat16()
    lengths = torch.tensor([19, 1, 7, 12, 3])
    slots = torch.stack([torch.randperm(n)[:c] for _ in range(b)])
    slots[lengths[:, None] <= torch.arange(c)[None]] = 0
    q = torch.randn(b, heads, d).bfloat16()
    got = native.decode_attention(q, k_cache, v_cache, slots, lengths, 0.125, window)
    want = reference(q.float(), k_cache.float(), v_cache.float(), slots, lengths, 0.125, window)
    assert got.dtype == torch.bfloat16 and got.shape == (b, heads, d)
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-6)
    assert torch.equal(got[1], v_cache[slots[1, 0]].repeat_interleave(heads // kv_heads, 0))  # one key: its row


def test_kernel_splits_work_over_threads_without_changing_it():
    torch.manual_seed(1)
    q, k, v = torch.randn(5, 4, 16), torch.randn(64, 2, 16), torch.randn(64, 2, 16)
    slots, lengths = torch.randint(0, 64, (5, 11)), torch.tensor([11, 3, 7, 1, 10])
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(native.decode_attention(q, k, v, slots, lengths, 0.25))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])  # each item computed alike


def test_kernel_refuses_what_it_cannot_read():
    q, k = torch.randn(2, 4, 16), torch.randn(8, 2, 16)
    lengths = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"decode_attention: q \(2, 4, 16\), k \(8, 2, 16\), slots \(3, 4\)"):
        native.decode_attention(q, k, k, torch.zeros(3, 4, dtype=torch.long), lengths, 1.0)
    with pytest.raises(ValueError, match="slots and lengths must be int64, got torch.int32 and torch.int64"):
        native.decode_attention(q, k, k, torch.zeros(2, 4, dtype=torch.int32), lengths, 1.0)
    assert native.supports(q, k, k)
    assert native.supports(q.bfloat16(), k.bfloat16(), k.bfloat16())
    assert not native.supports(q.half(), k.half(), k.half())  # float32 or bfloat16: sdpa serves fp16
    assert not native.supports(q, k.bfloat16(), k)  # keys and values of one type
    assert not native.supports(q, k.bfloat16(), k.bfloat16())  # a float32 query over a bf16 cache
    with pytest.raises(ValueError, match="must all be float32 or all bfloat16, got torch.float32, torch.bfloat16 and"):
        native.decode_attention(q, k.bfloat16(), k, torch.zeros(2, 4, dtype=torch.long), lengths, 1.0)
    assert not native.supports(torch.randn(2, 4, 12), torch.randn(8, 2, 12), torch.randn(8, 2, 12))
    assert not native.supports(q, k.transpose(0, 2).contiguous().transpose(0, 2), k)  # rows not contiguous
    assert not native.supports(q.to("meta"), k, k)


PROMPTS = [[5, 9, 14, 3, 7], [5, 9, 14, 3, 8, 11, 6], [20, 21], [5, 9, 14, 3, 7]]


def sample(engine):
    params = [SamplingParams(temperature=1.0, max_new_tokens=24, seed=s) for s in range(len(PROMPTS))]
    return engine.generate_batch(PROMPTS, params)


def mistral(seed: int):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=6, eos_token_id=2,
    )  # fmt: skip
    return MistralForCausalLM(cfg).eval()


@pytest.mark.parametrize("model_of", [make_model, mistral], ids=["llama", "mistral-window-6"])
def test_engine_samples_alike_with_and_without_it(model_of):
    """Mixed steps (prompts admitted while others decode), shared prefixes, a sliding window: the
    same tokens, log-probs within float32 rounding of the gather + sdpa path."""
    # 8 tokens a step: the later prompts are admitted while the first ones decode
    fast = LLMEngine(model_of(seed=3), dtype="float32", kv_cache_tokens=512, max_num_batched_tokens=8)
    plain = LLMEngine(
        model_of(seed=3), dtype="float32", kv_cache_tokens=512, max_num_batched_tokens=8, native_attention=False
    )
    assert fast.runner.native and not plain.runner.native
    for out, ref in zip(sample(fast), sample(plain), strict=True):
        assert out.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(ref.log_probs), rtol=0, atol=1e-5)


def test_bfloat16_engine_decodes_through_it(monkeypatch):
    """A bfloat16 engine's decode steps run the kernel, and greedy decoding picks the tokens the
    gather + sdpa path picks, log-probs within bf16 rounding of each other."""
    calls = []
    kernel = native.decode_attention
    monkeypatch.setattr(native, "decode_attention", lambda *a, **kw: calls.append(a[1].dtype) or kernel(*a, **kw))
    engines = [
        LLMEngine(make_model(seed=5), dtype="bfloat16", kv_cache_tokens=512, native_attention=on)
        for on in (True, False)
    ]
    params = [SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True) for _ in PROMPTS]
    fast, plain = (e.generate_batch(PROMPTS, params) for e in engines)
    assert calls and set(calls) == {torch.bfloat16}
    # 15 decode steps after the prefill, the first run twice (the decode path checked against transformers')
    assert len(calls) == 16 * engines[0].model.config.num_hidden_layers
    for out, ref in zip(fast, plain, strict=True):
        assert out.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(ref.log_probs), rtol=0, atol=3e-2)


@pytest.fixture(autouse=True)
def _reload_after():
    yield
    native.load.cache_clear()  # what a test loaded under its own settings is not kept


def fresh_load(monkeypatch, tmp_path, **env):
    monkeypatch.setenv("TIDAL_HOME", str(tmp_path))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    native.load.cache_clear()
    return native.load()


def test_built_once_into_the_kernel_cache(monkeypatch, tmp_path):
    assert fresh_load(monkeypatch, tmp_path) is not None
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].name.startswith("tidal_native-") and built[0].suffix == ".so"
    mtime = built[0].stat().st_mtime_ns
    assert fresh_load(monkeypatch, tmp_path) is not None  # loaded from the cache, not rebuilt
    assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").iterdir()] == [mtime]


def test_no_compiler_or_a_failing_build_keeps_the_torch_path(monkeypatch, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="tidal.engine.native"):
        assert fresh_load(monkeypatch, tmp_path, CC="no-such-compiler") is None
    assert (
        "no C compiler (no-such-compiler) found: decode attention, sampling, RMSNorm and SwiGLU run through torch"
        in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tidal.engine.native"):
        assert fresh_load(monkeypatch, tmp_path, CC="false") is None  # runs, builds nothing
    assert (
        "the native kernels could not be built: decode attention, sampling, RMSNorm and SwiGLU run through torch"
        in caplog.text
    )
    assert not list((tmp_path / "kernels").glob("*.so"))  # no half-written library left behind
    assert fresh_load(monkeypatch, tmp_path, TIDAL_NATIVE_KERNELS="0") is None
    monkeypatch.setenv("TIDAL_NATIVE_KERNELS", "0")
    engine = LLMEngine(make_model(seed=3), dtype="float32", kv_cache_tokens=512)
    assert not engine.runner.native
    assert [len(o.token_ids) for o in sample(engine)] == [24] * len(PROMPTS)


def torch_sample(monkeypatch, logits, temp, seeds):
    """`sample_tokens` through torch (the native sampler turned away), with seeded rows."""
    from tidal.engine.sampling import sample_tokens

    with monkeypatch.context() as m:
        m.setattr(native, "can_sample", lambda logits: False)
        return sample_tokens(logits, temp, 1.0, 0, seeds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_draws_what_the_torch_path_draws(monkeypatch, dtype):
    """Same uniforms, same inverse CDF: the same tokens; log-probs those of softmax(z / t) (vocab
    not a multiple of the 256-token chunks or of 8)."""
    from tidal.engine.sampling import sample_tokens

    torch.manual_seed(3)
    b, v = 64, 1000 + 3
    logits = (torch.randn(b, v) * 3).to(dtype)
    temp = torch.linspace(0.3, 1.7, b)
    assert native.can_sample(logits)
    seeds = list(range(100, 100 + b))
    got_tok, got_lp = sample_tokens(logits, temp, 1.0, 0, seeds)
    want_tok, want_lp = torch_sample(monkeypatch, logits, temp, seeds)
    assert torch.equal(got_tok, want_tok)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=2e-5)
    exact = torch.log_softmax(logits.double() / temp[:, None].double(), dim=-1).gather(1, got_tok[:, None])[:, 0]
    torch.testing.assert_close(got_lp.double(), exact, rtol=0, atol=1e-5)


def test_sampler_frequencies_follow_the_distribution():
    """20,000 draws from one 300-token distribution (two chunks): each token's frequency within
    4.5 standard errors of its probability (a fixed seed: the same draws every run)."""
    torch.manual_seed(4)
    z = torch.randn(1, 300) * 2
    n = 20_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(5))
    tokens, _ = native.sample(z.expand(n, -1), torch.full((n,), 0.8), u)
    freq = torch.bincount(tokens, minlength=300).double() / n
    p = torch.softmax(z[0].double() / 0.8, dim=-1)
    assert float(((freq - p).abs() / (p * (1 - p) / n).sqrt().clamp_min(1e-9)).max()) < 4.5


def test_sampler_never_draws_a_token_of_zero_weight():
    v = 600
    z = torch.full((3, v), -math.inf)
    z[:, [7, 300, 401]] = torch.tensor([0.5, 1.0, 2.0])
    u = torch.tensor([0.0, 0.999999, 1.0 - 2**-24])
    tokens, lp = native.sample(z, torch.ones(3), u)
    assert tokens.tolist() == [7, 401, 401]
    torch.testing.assert_close(lp, torch.log_softmax(z, dim=-1)[torch.arange(3), tokens], rtol=0, atol=1e-6)


def test_sampler_refuses_nan_and_bad_temperatures():
    z = torch.randn(3, 40)
    z[1, 17] = math.nan
    with pytest.raises(ValueError, match=r"sampling: logits rows \[1\] hold NaN or infinite values"):
        native.sample(z, torch.ones(3), torch.rand(3))
    with pytest.raises(ValueError, match="every temperature must be > 0"):
        native.sample(torch.randn(2, 40), torch.tensor([1.0, 0.0]), torch.rand(2))
    assert not native.can_sample(torch.randn(2, 40).half()) and not native.can_sample(torch.randn(40, 2).t())
