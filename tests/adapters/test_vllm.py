"""VLLMCore (vLLM behind tidal's core-engine contract) on a tiny random fp32 Llama: exact greedy
tokens and log-probs, sampled log-probs under tidal's definition of the sampled distribution,
seeds, stops, aborts, all-or-nothing weight loads, sleep/wake, and AsyncEngine on top.

Needs vLLM (scripts/setup_vllm.sh builds .venv-vllm); skipped where it is not installed. One vLLM
engine serves the whole module (start-up is seconds); each test leaves it on the original
weights at version 0.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import threading

import pytest
import torch
from conftest import hf_greedy, make_model, make_tokenizer

from tidal.adapters.options import EngineConfig
from tidal.contracts import SamplingParams
from tidal.engine.weights import WeightsError, weights_checksum

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (scripts/setup_vllm.sh builds .venv-vllm with it)",
    ),
]

PROMPTS = [
    [1, 5, 9, 33, 70],
    [1, 200, 17],
    [1, 44, 45, 46, 47, 48, 49, 50, 51],
    [7],
    [1, 7, 8, 9, 10, 11, 12, 13],
]


def tiny(seed: int = 0):
    # vLLM's CPU attention kernels have no head_dim 16 (conftest's default: 64 / 4 heads), so
    # 2 heads of 32; untied, since a random tied model's greedy choice is its input token again
    return make_model(seed=seed, tie_word_embeddings=False, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm_tiny")
    tiny().save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ref():
    return tiny()


@pytest.fixture(scope="module")
def original(ref):
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


@pytest.fixture(scope="module")
def shared_core(model_dir):
    """Built as the rollout builds it (`make_core`, `engine.kind: vllm`)."""
    from tidal.adapters.factory import make_core

    cfg = EngineConfig(kind="vllm", dtype="float32", kv_cache_tokens=4000, max_num_seqs=32)
    core = make_core(cfg, model_dir, make_tokenizer(), cfg.kv_cache_tokens)
    yield core
    core.close()


@pytest.fixture
def core(shared_core, original):
    """The module's core; afterwards: nothing running, awake, original weights at version 0."""
    yield shared_core
    shared_core.abort()
    if shared_core.asleep:
        shared_core.wake()
    if shared_core.weight_version != 0:
        shared_core.update_weights_from_tensors(original.items(), version=0)


def run(core, prompts, params, prefix="r") -> list:
    ids = [core.add_request(f"{prefix}{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    done = {}
    while core.has_unfinished():
        for o in core.step():
            done[o.request_id] = o
    return [done[i] for i in ids]


def greedy_ids(model, prompt, n) -> list[int]:
    """n argmax tokens, not stopping at the eos (for requests that ignore it)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def greedy(n=12, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def forward_logits(model, prompt, tokens) -> torch.Tensor:
    """[len(tokens), V] fp32 logits that predicted each token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def sampled_log_probs(logits, tokens, temperature, top_p=1.0, top_k=0) -> list[float]:
    """tidal's definition (tidal.engine.sampling.sample_tokens): the token's log-prob under
    softmax(logits / T) restricted to the top-k, then to the smallest most-likely set whose mass
    reaches top_p, renormalised (-inf when the token is outside that set)."""
    out = []
    for z, t in zip(logits, tokens, strict=True):
        z = z / temperature
        order = z.argsort(descending=True, stable=True)
        keep = torch.zeros_like(z, dtype=torch.bool)
        k = top_k if 0 < top_k < z.numel() else z.numel()
        keep[order[:k]] = True
        probs = torch.softmax(z.masked_fill(~keep, -math.inf), -1)[order]
        before = probs.cumsum(0) - probs
        drop = order[(before >= top_p) & (top_p < 1)]
        keep[drop] = False
        keep[order[0]] = True
        out.append(torch.log_softmax(z.masked_fill(~keep, -math.inf), -1)[t].item())
    return out


# ------------------------------------------------------------------ exactness
def test_greedy_matches_transformers_generate_and_forward_log_probs(core, ref):
    outs = run(core, PROMPTS, [greedy() for _ in PROMPTS])
    assert core.dtype == torch.float32
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.token_ids == hf_greedy(ref, p, 12)
        expect = torch.log_softmax(forward_logits(ref, p, o.token_ids), -1)
        assert o.log_probs == pytest.approx([expect[j, t].item() for j, t in enumerate(o.token_ids)], abs=1e-4)
        assert o.finish_reason == ("stop" if o.token_ids[-1] == 2 else "length")
        assert o.weight_version == 0 and o.prompt_tokens == len(p)
    assert not core.has_unfinished() and core.stats()["running"] == 0


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.7, 0.9, 0), (1.0, 1.0, 0), (1.3, 0.8, 20)])
def test_sampled_log_probs_are_those_of_the_distribution_sampled(core, ref, temperature, top_p, top_k):
    params = [
        SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=16, seed=100 + i)
        for i in range(len(PROMPTS))
    ]
    worst = raw_gap = 0.0
    for p, o in zip(PROMPTS, run(core, PROMPTS, params), strict=True):
        logits = forward_logits(ref, p, o.token_ids)
        expect = sampled_log_probs(logits, o.token_ids, temperature, top_p, top_k)
        assert all(math.isfinite(e) for e in expect), "a sampled token lies outside the kept set"
        worst = max(worst, *(abs(a - b) for a, b in zip(o.log_probs, expect, strict=True)))
        raw = torch.log_softmax(logits, -1)[torch.arange(len(o.token_ids)), o.token_ids]
        raw_gap = max(raw_gap, *(abs(a - b) for a, b in zip(raw.tolist(), o.log_probs, strict=True)))
    assert worst <= 1e-4
    if (temperature, top_p, top_k) != (1.0, 1.0, 0):
        assert raw_gap > 1e-2  # vLLM's default (raw) log-probs would have been far off here


def test_seeds_repeat_tokens_within_and_across_batches(core):
    def sp(seed):
        return SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed)

    a = run(core, [PROMPTS[0]] * 3, [sp(1), sp(1), sp(2)], "a")
    b = run(core, [PROMPTS[0], PROMPTS[1]], [sp(1), sp(1)], "b")  # a different batch around it
    assert a[0].token_ids == a[1].token_ids == b[0].token_ids
    assert a[0].log_probs == pytest.approx(b[0].log_probs, abs=1e-5)
    assert a[2].token_ids != a[0].token_ids
    big = run(core, [PROMPTS[0]], [sp(2**64 - 1)], "c")[0]  # tidal's largest seed
    assert len(big.token_ids) == 12


def test_stop_token_stop_string_and_logit_bias(core, ref):
    base = greedy_ids(ref, PROMPTS[0], 12)
    stop_at = base[4]
    o = run(core, [PROMPTS[0]], [greedy(stop_token_ids=[stop_at], ignore_eos=True)])[0]
    assert o.finish_reason == "stop" and o.token_ids == base[: base.index(stop_at) + 1]
    tok = make_tokenizer()
    x = tok.encode("x", add_special_tokens=False)[0]
    o = run(core, [PROMPTS[1]], [greedy(n=10, logit_bias={x: 100.0}, stop=["xxx"])])[0]
    assert o.token_ids == [x, x, x] and o.finish_reason == "stop" and o.text == "xxx"
    o = run(core, [PROMPTS[1]], [greedy(n=5, logit_bias={2: 100.0}, ignore_eos=True)])[0]
    assert o.token_ids == [2] * 5 and o.finish_reason == "length"  # eos (id 2) ignored
    o = run(core, [PROMPTS[1]], [greedy(n=5, logit_bias={2: 100.0})])[0]
    assert o.token_ids == [2] and o.finish_reason == "stop"


def test_top_logprobs_lists_the_most_likely_tokens(core, ref):
    o = run(core, [PROMPTS[2]], [greedy(n=4, top_logprobs=3)])[0]
    logp = torch.log_softmax(forward_logits(ref, PROMPTS[2], o.token_ids), -1)
    assert len(o.top_logprobs) == 4
    for j, tops in enumerate(o.top_logprobs):
        vals, ids = logp[j].topk(3)
        assert [t for t, _ in tops] == ids.tolist()
        assert [v for _, v in tops] == pytest.approx(vals.tolist(), abs=1e-4)
        assert tops[0][0] == o.token_ids[j]


def test_abort_returns_partial_tokens(core, ref):
    full = greedy_ids(ref, PROMPTS[0], 40)
    core.add_request("long", PROMPTS[0], greedy(n=40, ignore_eos=True))
    core.add_request("other", PROMPTS[1], greedy(n=40, ignore_eos=True))
    for _ in range(4):
        assert core.step() == []
    partial = core.progress("long")
    assert partial is not None and 1 <= len(partial[0]) < 40
    [o] = core.abort("long")
    assert o.finish_reason == "abort" and 1 <= len(o.token_ids) < 40 and len(o.log_probs) == len(o.token_ids)
    assert o.token_ids == full[: len(o.token_ids)]
    assert core.abort("long") == [] and core.progress("long") is None
    rest = core.abort()
    assert [r.request_id for r in rest] == ["other"] and rest[0].finish_reason == "abort"
    assert not core.has_unfinished() and core.step() == []


def test_bad_requests_raise_value_errors_naming_the_request(core):
    with pytest.raises(ValueError, match="request e1: the prompt is empty"):
        core.add_request("e1", [], greedy())
    with pytest.raises(ValueError, match=r"request e2: prompt token ids must be ints in \[0, 320\)"):
        core.add_request("e2", [1, 320], greedy())
    with pytest.raises(ValueError, match="request e3: the prompt has 512 tokens; the context holds 512"):
        core.add_request("e3", [1] * 512, greedy())
    with pytest.raises(ValueError, match="top_p must be in"):
        core.add_request("e4", [1], SamplingParams(top_p=0.0))
    core.add_request("dup", [1, 2], greedy(n=2))
    with pytest.raises(ValueError, match="request dup: id already in use"):
        core.add_request("dup", [1, 2], greedy(n=2))


def test_seeded_prompts_over_the_step_token_budget(core):
    # 10 x 400 prompt tokens cannot be prefilled in one step (at most 2048 tokens): some wait for
    # later steps, and each seeded sample is still the one it is alone
    prompts = [[1 + (i * 7 + j) % 300 for j in range(400)] for i in range(10)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=4, seed=40 + i) for i in range(10)]
    together = run(core, prompts, params, "t")
    alone = run(core, prompts[-1:], params[-1:], "a")
    assert together[-1].token_ids == alone[0].token_ids
    assert all(len(o.token_ids) == 4 for o in together)


def test_a_long_request_stops_at_the_context_length(core):
    o = run(core, [[1] * 500], [greedy(n=100, ignore_eos=True)])[0]
    assert len(o.token_ids) == 12 and o.finish_reason == "length"  # 500 + 12 = max_model_len 512


# ------------------------------------------------------------------ weights
def perturbed(original, scale=1.5):
    return {n: (t * scale if "embed" in n or "mlp" in n else t.clone()) for n, t in original.items()}


def test_weight_update_changes_outputs_and_restoring_restores_them(core, original):
    before = run(core, PROMPTS, [greedy() for _ in PROMPTS], "a")
    assert core.weights_checksum() == weights_checksum(original.items(), torch.float32)
    new = perturbed(original)
    core.update_weights_from_tensors(new.items())
    assert core.weight_version == 1
    assert core.weights_checksum() == weights_checksum(new.items(), torch.float32)
    model = tiny()
    model.load_state_dict(new, strict=False)
    changed = run(core, PROMPTS, [greedy() for _ in PROMPTS], "b")
    assert [o.token_ids for o in changed] != [o.token_ids for o in before]
    for p, o in zip(PROMPTS, changed, strict=True):
        assert o.token_ids == hf_greedy(model, p, 12) and o.weight_version == 1
    half = {n: t.to(torch.bfloat16) for n, t in original.items()}
    core.update_weights_from_tensors(half.items(), version=7)
    assert core.weights_checksum() == weights_checksum(half.items(), torch.float32)
    core.update_weights_from_tensors(original.items(), version=9)
    assert core.weight_version == 9
    again = run(core, PROMPTS, [greedy() for _ in PROMPTS], "c")
    assert [o.token_ids for o in again] == [o.token_ids for o in before]
    assert [o.log_probs for o in again] == [o.log_probs for o in before]
    assert all(o.weight_version == 9 for o in again)


def test_weights_update_in_flight_requests_continue(core, original):
    core.add_request("live", PROMPTS[0], greedy(n=20, ignore_eos=True))
    core.step()
    core.update_weights_from_tensors(perturbed(original).items(), version=3)
    done = []
    while core.has_unfinished():
        done += core.step()
    assert done[0].weight_version == 3 and len(done[0].token_ids) == 20


def test_a_bad_update_keeps_the_old_weights_and_version(core, original):
    before = run(core, PROMPTS[:2], [greedy(), greedy()], "a")
    wrong_shape = dict(original)
    wrong_shape["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(WeightsError, match=r"down_proj.weight has shape \(64, 64\), the engine's is \(64, 128\)"):
        core.update_weights_from_tensors(perturbed(wrong_shape).items())
    with pytest.raises(WeightsError, match="has no parameter 'model.layers.9.foo'"):
        core.update_weights_from_tensors([*perturbed(original).items(), ("model.layers.9.foo", torch.zeros(2))])
    missing = perturbed(original)
    del missing["model.norm.weight"]
    with pytest.raises(WeightsError, match=r"no tensor given for \['model.norm.weight'\]"):
        core.update_weights_from_tensors(missing.items())
    assert core.weight_version == 0
    assert core.weights_checksum() == weights_checksum(original.items(), torch.float32)
    after = run(core, PROMPTS[:2], [greedy(), greedy()], "b")
    assert [o.token_ids for o in after] == [o.token_ids for o in before]


def test_staged_update_is_all_or_nothing(core, original):
    before = run(core, PROMPTS[:2], [greedy(), greedy()], "a")
    new = perturbed(original)
    names = sorted(new)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    core.update_weights_from_tensors([(n, new[n]) for n in first], stage=True)
    with pytest.raises(WeightsError, match="has shape"):
        core.update_weights_from_tensors([(second[0], torch.zeros(3))], stage=True)
    # the bad chunk dropped everything staged: the final call alone is incomplete
    with pytest.raises(WeightsError, match="no tensor given"):
        core.update_weights_from_tensors([(n, new[n]) for n in second])
    assert core.weight_version == 0
    assert [o.token_ids for o in run(core, PROMPTS[:2], [greedy(), greedy()], "b")] == [o.token_ids for o in before]
    core.update_weights_from_tensors([(n, new[n]) for n in first], stage=True)
    core.update_weights_from_tensors([(n, new[n]) for n in second[:3]], stage=True)
    assert core.weight_version == 0  # staging loads nothing
    core.update_weights_from_tensors([(n, new[n]) for n in second[3:]], version=4)
    assert core.weight_version == 4
    assert core.weights_checksum() == weights_checksum(new.items(), torch.float32)
    assert [o.token_ids for o in run(core, PROMPTS[:2], [greedy(), greedy()], "c")] != [o.token_ids for o in before]


def test_update_from_disk(core, tmp_path):
    other = tiny(seed=3)
    other.save_pretrained(tmp_path)
    core.update_weights_from_disk(tmp_path, version=2)
    outs = run(core, PROMPTS, [greedy() for _ in PROMPTS])
    assert all(o.weight_version == 2 for o in outs)
    assert [o.token_ids for o in outs] == [hf_greedy(other, p, 12) for p in PROMPTS]
    with pytest.raises(WeightsError, match="no \\*.safetensors in"):
        core.update_weights_from_disk(tmp_path / "missing")
    assert core.weight_version == 2


# ------------------------------------------------------------------ memory
def test_sleep_frees_memory_and_wake_needs_a_weight_update(core, original):
    before = run(core, PROMPTS, [greedy() for _ in PROMPTS], "a")
    core.add_request("busy", PROMPTS[0], greedy())
    with pytest.raises(RuntimeError, match="requests are still running"):
        core.sleep()
    core.abort()
    core.sleep()
    kv_bytes = core.kv_cache_tokens * 2 * 2 * 1 * 32 * 4  # K and V, 2 layers, 1 KV head of 32, fp32
    assert core.stats()["sleep_freed_bytes"] >= kv_bytes
    with pytest.raises(RuntimeError, match="holds no weights"):
        core.add_request("x", PROMPTS[0], greedy())
    with pytest.raises(RuntimeError, match="asleep"):
        core.update_weights_from_tensors(original.items())
    core.wake()
    assert core.weight_version == -1
    with pytest.raises(RuntimeError, match="holds no weights"):
        core.add_request("x", PROMPTS[0], greedy())
    core.update_weights_from_tensors(original.items(), version=5)
    after = run(core, PROMPTS, [greedy() for _ in PROMPTS], "b")
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert [o.log_probs for o in after] == [o.log_probs for o in before]


# ------------------------------------------------------------------ through AsyncEngine
def test_async_engine_concurrent_requests_pause_resume_and_abort(core, ref):
    from tidal.adapters.async_engine import AsyncEngine

    direct = run(core, PROMPTS, [greedy() for _ in PROMPTS], "d")
    engine = AsyncEngine(core)
    got_tokens = threading.Event()

    def on_tokens(ids, lps, tops):
        got_tokens.set()

    async def scenario():
        outs = await asyncio.gather(*(engine.generate(p, greedy()) for p in PROMPTS))
        assert [o.token_ids for o in outs] == [o.token_ids for o in direct]
        assert [o.log_probs for o in outs] == [o.log_probs for o in direct]
        await engine.pause()
        fut = await engine.add_request(PROMPTS[1], greedy())
        for _ in range(3):  # several trips through the engine thread: a paused engine never steps
            await engine.get_stats()
        assert not fut.done() and engine.load() == 1
        await engine.resume()
        assert (await asyncio.wait_for(fut, 60)).token_ids == direct[1].token_ids
        long = await engine.add_request(PROMPTS[0], greedy(n=200, ignore_eos=True), on_tokens=on_tokens)
        assert await asyncio.to_thread(got_tokens.wait, 60), "no tokens streamed within 60 s"
        [aborted] = await engine.abort()
        out = await asyncio.wait_for(long, 60)
        assert out.finish_reason == "abort" and aborted.request_id == out.request_id
        assert 1 <= len(out.token_ids) < 200
        assert out.token_ids == greedy_ids(ref, PROMPTS[0], len(out.token_ids))
        new = {n: p.detach() * 1.5 for n, p in ref.named_parameters()}
        await engine.update_weights_from_tensors(new.items(), version=11)
        assert engine.weight_version == 11 and await engine.weights_checksum() == weights_checksum(new.items())

    try:
        asyncio.run(scenario())
    finally:
        engine.close(close_core=False)  # the module's shared core lives on


# ------------------------------------------------------------------ where it is built
def test_the_rollout_factory_sizes_the_kv_cache_and_allows_one_core_per_process(shared_core, model_dir):
    from tidal.adapters.vllm_core import VLLMCore

    assert type(shared_core) is VLLMCore
    # 4000 tokens round up to whole 128-token blocks; the model's context (512) is the shorter
    assert shared_core.kv_cache_tokens == 4096 and shared_core.max_model_len == 512
    with pytest.raises(RuntimeError, match="a vLLM engine is already running in this process; close"):
        VLLMCore(model_dir, make_tokenizer(), dtype="float32")
    with pytest.raises(ValueError, match="vLLM engine kv_cache_tokens must be an int >= 1, got 0"):
        VLLMCore(model_dir, kv_cache_tokens=0)
    with pytest.raises(FileNotFoundError, match="is not a Hugging Face model folder"):
        VLLMCore(model_dir / "nothing")


def test_a_core_serves_inside_a_ray_actor(ray_session, shared_core, model_dir, tmp_path):
    ray = ray_session
    other = tiny(seed=3)
    other.save_pretrained(tmp_path)

    class Engine:  # defined here so Ray ships it by value to the actor process
        def __init__(self, path, kv_cache_tokens):
            from transformers import AutoTokenizer

            from tidal.adapters.async_engine import AsyncEngine
            from tidal.adapters.vllm_core import VLLMCore

            self.core = VLLMCore(
                path, AutoTokenizer.from_pretrained(path), dtype="float32", kv_cache_tokens=kv_cache_tokens
            )
            self.engine = AsyncEngine(self.core)

        def sizes(self):
            return self.core.kv_cache_tokens, self.core.max_model_len

        def generate(self, prompts, seeds, n=10):
            async def go():
                return await asyncio.gather(
                    *(
                        self.engine.generate(p, SamplingParams(temperature=1.0, max_new_tokens=n, seed=s))
                        for p, s in zip(prompts, seeds, strict=True)
                    )
                )

            return [(o.token_ids, o.log_probs, o.weight_version, o.finish_reason) for o in asyncio.run(go())]

        def load(self, path, version):
            asyncio.run(self.engine.update_weights_from_disk(path, version))
            return self.engine.weight_version

    # a KV cache smaller than the model's context: 300 tokens -> 3 blocks, and the context with them
    actor = ray.remote(num_cpus=1)(Engine).remote(str(model_dir), 300)
    assert ray.get(actor.sizes.remote(), timeout=300) == (384, 384)
    seeds = list(range(len(PROMPTS)))
    remote = ray.get(actor.generate.remote(PROMPTS, seeds), timeout=120)
    local = run(shared_core, PROMPTS, [SamplingParams(temperature=1.0, max_new_tokens=10, seed=s) for s in seeds])
    assert [r[0] for r in remote] == [o.token_ids for o in local]  # seeds repeat across processes
    [longest] = ray.get(actor.generate.remote([[1] * 380], [0], 50), timeout=120)
    assert len(longest[0]) == 4 and longest[3] == "length"
    assert ray.get(actor.load.remote(str(tmp_path), 6), timeout=120) == 6
    moved = ray.get(actor.generate.remote(PROMPTS, seeds), timeout=120)
    assert all(r[2] == 6 for r in moved) and [r[0] for r in moved] != [r[0] for r in remote]
    ray.kill(actor)
