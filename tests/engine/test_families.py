"""LLMEngine on a tiny random model of every family in `families.FAMILIES`: greedy tokens equal
transformers' `generate`, log-probs equal one full transformers forward (greedy and sampled),
preemption under a tiny cache changes nothing, and an architecture the engine does not run is
refused by name. The prompts outgrow the sliding window of the families that have one, and
share prefixes (one duplicate, one sharing two blocks), so windows and prefix sharing both act."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from families import FAMILIES, MOE, WINDOW, hf_forward_greedy_ok, hf_greedy, hf_logprobs, tiny_model

from tidal.contracts import SamplingParams
from tidal.engine import model_runner
from tidal.engine.llm_engine import LLMEngine

BLOCK = 4
SHARED = list(range(40, 52))  # 12 tokens: 3 blocks
PROMPTS = [
    [1, 5, 9],  # shorter than the window
    SHARED,
    SHARED[:8] + [200, 201, 202, 203, 204, 205, 206],  # its first 2 blocks are SHARED's
    SHARED,  # a duplicate
    [7, 300, 17, 250, 99, 3, 64, 128, 190, 211, 16, 45, 77, 88, 150, 160, 170, 180, 260, 319],  # 20
    [11],
]
LONG = [[(37 * i + 11 * j) % 317 + 3 for j in range(10)] for i in range(4)]  # 4 x 10 tokens
N_NEW = 12
assert max(len(p) for p in PROMPTS) > WINDOW + 10


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def reference(family: str):
    """transformers' model, kept apart from the engine's copy (same seed, same weights)."""
    return tiny_model(family)


@functools.cache
def reference_greedy(family: str, prompt: tuple[int, ...], n: int) -> list[int]:
    model = reference(family)
    toks = hf_greedy(model, list(prompt), n)
    # the reference agrees with itself: generate's cached steps = argmax of one uncached forward
    assert hf_forward_greedy_ok(model, list(prompt), toks), f"{family}: transformers' generate != its forward"
    return toks


def engine_for(family: str, **kw) -> LLMEngine:
    kw.setdefault("block_size", BLOCK)
    return LLMEngine(tiny_model(family), None, dtype="float32", **kw)


def greedy(n: int = N_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_log_probs_match_transformers(family):
    engine = engine_for(family, kv_cache_tokens=512)
    outs = engine.generate_batch(PROMPTS, [greedy() for _ in PROMPTS])
    assert engine.stats()["prefix_hit_blocks"] >= 2  # the duplicate and the shared prefix
    ref = reference(family)
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.token_ids == reference_greedy(family, tuple(p), N_NEW), f"prompt of {len(p)} tokens"
        assert o.log_probs == pytest.approx(hf_logprobs(ref, p + o.token_ids, len(p)), abs=1e-4)
        assert o.finish_reason == "length"
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_under_a_tiny_cache_gives_the_same_tokens(family):
    n = 20
    engine = engine_for(family, kv_cache_tokens=48)  # 12 blocks; each request grows to 8
    outs = engine.generate_batch(LONG, [greedy(n) for _ in LONG])
    assert engine.stats()["preemptions"] > 0
    for p, o in zip(LONG, outs, strict=True):
        assert o.token_ids == reference_greedy(family, tuple(p), n)
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_log_probs_match_transformers(family):
    engine = engine_for(family, kv_cache_tokens=512)
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=N_NEW, seed=100 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    outs = engine.generate_batch(PROMPTS, params)
    ref = reference(family)
    for p, o in zip(PROMPTS, outs, strict=True):
        assert len(o.token_ids) == N_NEW
        # at temperature 1 with no top-p/top-k the sampling distribution is the plain softmax
        assert o.log_probs == pytest.approx(hf_logprobs(ref, p + o.token_ids, len(p)), abs=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_reference_agrees_with_itself(family):
    """Guards the tests above: for every prompt, transformers' `generate` (with its cache) picks
    the argmax of one uncached forward, so a failure above is the engine's, not the reference's."""
    for p in PROMPTS:
        reference_greedy(family, tuple(p), N_NEW)
    for p in LONG:
        reference_greedy(family, tuple(p), 20)


_ONE_THETA = {"rope_type": "default", "rope_theta": 1_000_000.0}
# a feature an engine could silently ignore -> the config override that switches it off
FEATURES = [
    ("mistral", dict(sliding_window=4096)),
    ("gemma2", dict(sliding_window=4096)),
    ("gemma2", dict(attn_logit_softcapping=None)),
    ("gemma2", dict(final_logit_softcapping=None)),
    ("gemma2", dict(query_pre_attn_scalar=16)),  # = head_dim
    ("gemma3_text", dict(sliding_window=4096)),
    ("gemma3_text", dict(query_pre_attn_scalar=16)),
    ("gemma3_text", dict(rope_parameters={"sliding_attention": _ONE_THETA, "full_attention": _ONE_THETA})),
    ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 1.0})),
    ("glm4", dict(partial_rotary_factor=1.0)),
    ("glm4_moe", dict(partial_rotary_factor=1.0)),
    ("glm4_moe", dict(routed_scaling_factor=1.0)),
    ("deepseek_v3", dict(rope_interleave=False)),
    ("deepseek_v3", dict(routed_scaling_factor=1.0)),
]


@pytest.mark.parametrize(("family", "off"), FEATURES, ids=[f"{f}-{next(iter(o))}" for f, o in FEATURES])
def test_each_feature_changes_the_reference(family, off):
    """Guards the tests above: switching the feature off changes transformers' own log-probs on
    the 20-token prompt and its greedy continuation, so an engine that ignored it would fail them."""
    p = PROMPTS[4]
    ids = p + reference_greedy(family, tuple(p), N_NEW)
    with_it = hf_logprobs(reference(family), ids, len(p))
    without = hf_logprobs(tiny_model(family, **off), ids, len(p))
    assert max(abs(a - b) for a, b in zip(with_it, without, strict=True)) > 0.05


def test_an_unsupported_architecture_is_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=128)).eval()
    with pytest.raises(model_runner.UnsupportedModelError) as e:
        LLMEngine(model, None, dtype="float32", kv_cache_tokens=64, block_size=BLOCK)
    assert str(e.value) == (
        f"the tidal engine runs {', '.join(model_runner.FAMILIES)} models; config model_type is 'gpt2' "
        "(engine.kind: hf runs any transformers model, slower)"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_over_http_tokens_and_log_probs_match_transformers(family):
    """`tidal serve`'s routes over the engine: the same tokens and log-probs as transformers."""
    from conftest import run_batch

    from tidal.adapters.async_engine import AsyncEngine
    from tidal.adapters.client import HttpEngine
    from tidal.server.app import BackgroundServer, build_app

    engine = AsyncEngine(engine_for(family, kv_cache_tokens=512))
    server = BackgroundServer(build_app(engine, family)).start()
    try:
        outs = run_batch(HttpEngine([server.url], timeout=60), PROMPTS, [greedy() for _ in PROMPTS])
    finally:
        server.stop()
        engine.close()
    ref = reference(family)
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.token_ids == reference_greedy(family, tuple(p), N_NEW)
        assert o.log_probs == pytest.approx(hf_logprobs(ref, p + o.token_ids, len(p)), abs=1e-4)


def transformers_routing(family: str, ids: list[int]) -> torch.Tensor:
    """The experts transformers' own forward chooses at each position of `ids`."""
    from tidal import moe

    with torch.no_grad(), moe.capture(reference(family)) as routing:
        reference(family)(torch.tensor([ids]))
    return routing.take()


@pytest.mark.parametrize("family", MOE)
def test_the_engine_returns_the_experts_transformers_chooses(family):
    """Routing comes back for every position but the last, prefix-shared (the duplicate prompt's
    blocks were computed by another request) and after preemption (recomputed) alike, in-process
    and over HTTP (SGLang's `return_routed_experts`, base64 int32)."""
    from conftest import run_batch

    from tidal.adapters.async_engine import AsyncEngine
    from tidal.adapters.client import HttpEngine
    from tidal.server.app import BackgroundServer, build_app

    params = [SamplingParams(temperature=0.0, max_new_tokens=N_NEW, ignore_eos=True, return_routed_experts=True)]
    engine = engine_for(family, kv_cache_tokens=512)
    outs = engine.generate_batch(PROMPTS, params * len(PROMPTS))
    assert engine.stats()["prefix_hit_blocks"] >= 2
    for p, o in zip(PROMPTS, outs, strict=True):
        ids = p + o.token_ids
        want = transformers_routing(family, ids[:-1])
        assert o.routed_experts.shape == want.shape == (len(ids) - 1, *want.shape[1:])
        # the same set of experts per token and layer (the order of a top-k is not part of it)
        assert torch.equal(o.routed_experts.sort(-1).values.long(), want.sort(-1).values.long())
    preempting = engine_for(family, kv_cache_tokens=48)
    outs = preempting.generate_batch(LONG, [dataclasses.replace(params[0], max_new_tokens=20)] * len(LONG))
    assert preempting.stats()["preemptions"] > 0
    for p, o in zip(LONG, outs, strict=True):
        want = transformers_routing(family, (p + o.token_ids)[:-1])
        assert torch.equal(o.routed_experts.sort(-1).values.long(), want.sort(-1).values.long())
    served = AsyncEngine(engine_for(family, kv_cache_tokens=512))
    server = BackgroundServer(build_app(served, family)).start()
    try:
        remote = run_batch(HttpEngine([server.url], timeout=60), PROMPTS, params * len(PROMPTS))
    finally:
        server.stop()
        served.close()
    local = engine_for(family).generate_batch(PROMPTS, params * len(PROMPTS))
    for o, r in zip(local, remote, strict=True):
        assert r.routed_experts.shape == (o.routed_experts.shape[0], o.routed_experts[0].numel())
        assert torch.equal(r.routed_experts.long(), o.routed_experts.flatten(1).long())


def test_a_dense_model_returns_no_routing():
    engine = engine_for("llama", kv_cache_tokens=512)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, return_routed_experts=True)
    assert engine.generate_batch([[1, 2, 3]], [params])[0].routed_experts is None


def test_mla_caches_its_latents_not_per_head_keys_and_values():
    """DeepSeek-V3's cache holds kv_lora_rank + rope dims per token and layer (`LatentCache`),
    not heads x (qk + v head dims); the tokens above are computed from it."""
    engine = engine_for("deepseek_v3", kv_cache_tokens=64)
    c = engine.model.config
    assert engine.runner.latent and set(engine.runner.latent) == set(range(c.num_hidden_layers))
    per_token = c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4  # fp32
    assert engine.runner.kv_bytes() == 64 * per_token
    expanded = c.num_hidden_layers * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    assert per_token < expanded * 4


def test_a_bidirectional_configuration_is_refused_naming_its_key():
    with pytest.raises(model_runner.UnsupportedModelError) as e:
        LLMEngine(tiny_model("gemma3_text", use_bidirectional_attention=True), None, dtype="float32")
    assert str(e.value) == (
        "config use_bidirectional_attention: true (gemma3_text); the engine runs causal decoder-only models"
    )
