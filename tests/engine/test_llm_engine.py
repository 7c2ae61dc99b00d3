"""LLMEngine on a tiny fp32 Llama: exact tokens and log-probs, seeds, continuous batching,
preemption, prefix sharing, stop conditions, aborts, weight updates and request validation."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import hf_greedy
from conftest import make_model as _make_model

from tidal.contracts import SamplingParams
from tidal.engine.llm_engine import EngineConfig, LLMEngine
from tidal.engine.sequence import Sequence

# mixed lengths, a duplicate (prefix sharing within the batch) and a 1-token prompt
PROMPTS = [
    [1, 5, 9, 33, 70],
    [1, 200, 17],
    [1, 44, 45, 46, 47, 48, 49, 50, 51],
    [1, 44, 45, 46, 47, 48, 49, 50, 51],
    [7],
    [1, 7, 8, 9, 10, 11, 12, 13],
]
LONG = [list(range(10 + 13 * i, 20 + 13 * i)) for i in range(4)]  # 10 tokens each


pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(seed=0, **kw):
    # untied embeddings: a random tied model's greedy choice is just its input token again
    return _make_model(seed=seed, tie_word_embeddings=False, **kw)


def engine_for(model=None, tokenizer=None, **kw) -> LLMEngine:
    kw.setdefault("block_size", 4)
    return LLMEngine(model if model is not None else make_model(), tokenizer, dtype="float32", **kw)


def greedy(n=12, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def forward_log_probs(model, prompt, tokens, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]


def run_all(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id] = o
    return done


# ------------------------------------------------------------------ exactness
def test_greedy_matches_transformers_generate_and_forward_log_probs():
    ref = make_model()
    engine = engine_for()
    outs = engine.generate_batch(PROMPTS, [greedy() for _ in PROMPTS])
    assert engine.stats()["prefix_hit_blocks"] == 2  # the duplicate 9-token prompt
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.token_ids == hf_greedy(ref, p, 12)
        assert o.log_probs == pytest.approx(forward_log_probs(ref, p, o.token_ids), abs=1e-4)
        assert o.finish_reason == ("stop" if o.token_ids[-1] == 2 else "length")
        assert o.weight_version == 0
    assert outs[2].token_ids == outs[3].token_ids
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished()


def test_sampled_log_probs_use_the_tempered_distribution():
    ref = make_model()
    engine = engine_for()
    params = [
        SamplingParams(temperature=0.7, max_new_tokens=10, seed=s, stop_token_ids=[]) for s in range(len(PROMPTS))
    ]
    outs = engine.generate_batch(PROMPTS, params)
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.log_probs == pytest.approx(forward_log_probs(ref, p, o.token_ids, 0.7), abs=1e-4)


def test_seed_gives_same_tokens_whatever_the_batch():
    engine = engine_for()
    sp = lambda seed: SamplingParams(temperature=1.0, max_new_tokens=10, seed=seed)  # noqa: E731
    alone = engine.generate_batch([PROMPTS[1]], [sp(11)])[0]
    mixed = engine.generate_batch(PROMPTS, [sp(5), sp(11), sp(6), sp(7), sp(8), sp(9)])[1]
    assert alone.token_ids == mixed.token_ids
    assert alone.log_probs == pytest.approx(mixed.log_probs, abs=1e-5)
    other = engine.generate_batch([PROMPTS[1]], [sp(12)])[0]
    assert other.token_ids != alone.token_ids


# ------------------------------------------------------------------ batching and memory
def test_continuous_batching_matches_separate_runs():
    engine = engine_for(max_num_seqs=2)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[4], PROMPTS[5]]
    rids = [engine.add_request(f"r{i}", p, greedy(8)) for i, p in enumerate(prompts)]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id] = o
        assert len(engine.scheduler.running) <= 2
    assert sorted(done) == sorted(rids)
    single = engine_for()
    for rid, p in zip(rids, prompts, strict=True):
        (alone,) = single.generate_batch([p], [greedy(8)])
        assert done[rid].token_ids == alone.token_ids
        assert done[rid].log_probs == pytest.approx(alone.log_probs, abs=1e-5)
    lengths = sum(len(o.token_ids) for o in done.values())
    assert engine.stats()["steps"] < lengths  # requests overlapped
    assert engine.stats()["decode_tokens"] + len(prompts) == lengths


def test_preemption_under_a_tiny_cache_is_exact():
    model_kw = dict(eos_token_id=None)  # no eos: every request runs to max_new_tokens
    big = engine_for(make_model(**model_kw), kv_cache_tokens=1024)
    expected = big.generate_batch(LONG, [greedy(20) for _ in LONG])
    tiny = engine_for(make_model(**model_kw), kv_cache_tokens=48)  # 12 blocks; each request needs 8
    outs = tiny.generate_batch(LONG, [greedy(20) for _ in LONG])
    assert tiny.stats()["preemptions"] > 0
    for o, e in zip(outs, expected, strict=True):
        assert len(o.token_ids) == 20 and o.finish_reason == "length"
        assert o.token_ids == e.token_ids
        assert o.log_probs == pytest.approx(e.log_probs, abs=1e-4)
    assert tiny.stats()["kv_blocks_used"] == 0


def test_preemption_keeps_seeded_sampling_exact():
    model_kw = dict(eos_token_id=None)
    sp = lambda s: SamplingParams(temperature=1.0, max_new_tokens=20, seed=s)  # noqa: E731
    big = engine_for(make_model(**model_kw), kv_cache_tokens=1024)
    expected = big.generate_batch(LONG, [sp(i) for i in range(len(LONG))])
    tiny = engine_for(make_model(**model_kw), kv_cache_tokens=48)
    outs = tiny.generate_batch(LONG, [sp(i) for i in range(len(LONG))])
    assert tiny.stats()["preemptions"] > 0
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]


def test_preemption_when_the_newest_request_needs_a_block():
    prompts = [[10, 11, 12], [20, 21, 22, 23]]  # with blocks of 2, the second one outgrows first
    big = engine_for(make_model(eos_token_id=None), block_size=2)
    expected = big.generate_batch(prompts, [greedy(3), greedy(3)])
    tiny = engine_for(make_model(eos_token_id=None), block_size=2, kv_cache_tokens=8)
    outs = tiny.generate_batch(prompts, [greedy(3), greedy(3)])
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    assert tiny.stats()["preemptions"] > 0


def test_request_that_outgrows_the_whole_cache_is_rejected_or_truncated():
    engine = engine_for(make_model(eos_token_id=None), kv_cache_tokens=16)  # 4 blocks of 4
    try:
        engine.add_request("long", list(range(10, 20)), greedy(20))  # needs 30 slots, has 16
    except ValueError:
        return  # rejected up front: fine
    done = run_all(engine)
    assert done["long"].finish_reason == "length"


def test_request_larger_than_the_cache_is_rejected():
    engine = engine_for(kv_cache_tokens=16)  # 4 blocks of 4
    msg = "request r: prompt + max_new_tokens = 28 tokens cannot fit in the KV cache (16 token slots)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        engine.add_request("r", list(range(10, 26)), greedy())


def test_prefix_sharing_group_prefills_once():
    prompt = list(range(40, 53))  # 13 tokens: 3 full blocks of 4 + 1
    engine = engine_for()
    sp = lambda s: SamplingParams(temperature=1.0, max_new_tokens=6, seed=s, stop_token_ids=[])  # noqa: E731
    for s in range(8):
        engine.add_request(f"g{s}", prompt, sp(s))
    done = run_all(engine)
    st = engine.stats()
    assert st["prefix_hit_blocks"] == 7 * 3
    # the first sample prefills 13 tokens; the other 7 (its twins) copy their last prompt token's
    # K/V and the logits from it
    assert (st["prefill_tokens"], st["prefill_tokens_copied"]) == (13, 7 * 1)
    assert sorted(o.cached_tokens for o in done.values()) == [0] + [12] * 7
    assert all(o.prompt_tokens == 13 for o in done.values())
    # the shared K/V give the same samples as prefilling each one alone (no full block to share)
    alone = engine_for(block_size=64)
    for s in (0, 3, 7):
        (o,) = alone.generate_batch([prompt], [sp(s)])
        assert done[f"g{s}"].token_ids == o.token_ids
        assert done[f"g{s}"].log_probs == pytest.approx(o.log_probs, abs=1e-4)
    assert alone.stats()["prefix_hit_blocks"] == 0


@pytest.mark.parametrize("length", [14, 12, 1])  # a 2-token last block; whole blocks; one token
def test_twins_copy_the_partial_block_and_sample_as_separate_runs(length):
    """Requests admitted in one step with the same tokens compute them once: the others copy the
    K/V of the positions the prefix cache does not hold (a whole last block when the prompt fills
    its blocks: one token is always computed) and the next-token logits. Their samples are those
    of each request run alone, in a step that also decodes and prefills other prompts."""
    prompt = list(range(40, 40 + length))
    other = [1, 7, 8, 9, 10, 11]
    engine = engine_for()
    sp = lambda s: SamplingParams(temperature=1.0, max_new_tokens=6, seed=s, stop_token_ids=[])  # noqa: E731
    engine.add_request("early", other, sp(9))
    engine.step()  # "early" decodes in the next step, beside the admissions
    for s in range(4):
        engine.add_request(f"g{s}", prompt, sp(s))
    engine.add_request("other", other, sp(5))
    engine.step()
    copied = length - (length - 1) // 4 * 4  # what the prefix cache does not hold
    st = engine.stats()
    # "other" finds the first block of "early"'s prompt (the same tokens) in the prefix cache
    assert (st["prefill_tokens"], st["prefill_tokens_copied"]) == (len(other) + length + 2, 3 * copied)
    done = run_all(engine)
    cases = [("g0", prompt, 0), ("g1", prompt, 1), ("g3", prompt, 3), ("other", other, 5), ("early", other, 9)]
    for rid, p, s in cases:
        (o,) = engine_for(block_size=64).generate_batch([p], [sp(s)])
        assert done[rid].token_ids == o.token_ids
        assert done[rid].log_probs == pytest.approx(o.log_probs, abs=1e-4)
    assert all(s.twin is None for s in engine.seqs.values())


def test_twins_take_nothing_from_the_token_budget():
    prompt = list(range(40, 53))  # 13 tokens
    engine = engine_for(max_num_batched_tokens=13)
    for s in range(8):
        engine.add_request(f"g{s}", prompt, SamplingParams(temperature=1.0, max_new_tokens=3, seed=s))
    engine.step()
    assert engine.stats()["running"] == 8 and engine.stats()["prefill_tokens_copied"] == 7


def test_a_failed_step_leaves_no_twins_behind(monkeypatch):
    engine = engine_for()
    for s in range(3):
        engine.add_request(f"g{s}", [1, 2, 3, 4, 5], SamplingParams(temperature=1.0, max_new_tokens=3, seed=s))

    def failing(seqs):
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(engine.runner, "forward", failing)
    with pytest.raises(RuntimeError, match="^the forward failed$"):
        engine.step()
    assert [s.twin for s in engine.seqs.values()] == [None] * 3


def test_a_twin_whose_twin_holds_other_tokens_is_refused():
    engine = engine_for()
    a, b = Sequence("a", [1, 2, 3], greedy()), Sequence("b", [1, 2, 4], greedy())
    engine.blocks.allocate(a)
    engine.blocks.allocate(b)
    b.twin = a
    with pytest.raises(RuntimeError, match="^request b: its twin does not compute its uncached tokens$"):
        engine.runner.copy_twins([b])


def test_multi_turn_continuation_reuses_the_previous_turn():
    engine = engine_for(make_model(eos_token_id=None))
    prompt = list(range(40, 50))
    (turn1,) = engine.generate_batch([prompt], [greedy(9)])
    hits = engine.stats()["prefix_hit_blocks"]
    # prompt + response = 19 tokens; the last response token was never fed, so 18 have K/V: 4 blocks
    turn2_prompt = prompt + turn1.token_ids + [60, 61]
    (turn2,) = engine.generate_batch([turn2_prompt], [greedy(5)])
    assert engine.stats()["prefix_hit_blocks"] - hits == 4
    ref = engine_for(make_model(eos_token_id=None)).generate_batch([turn2_prompt], [greedy(5)])[0]
    assert turn2.token_ids == ref.token_ids
    assert turn2.log_probs == pytest.approx(ref.log_probs, abs=1e-4)


# ------------------------------------------------------------------ stop conditions
def test_stop_token_ids_and_max_new_tokens():
    engine = engine_for(make_model(eos_token_id=None))
    (free,) = engine.generate_batch([PROMPTS[2]], [greedy(20)])
    assert len(free.token_ids) == 20 and free.finish_reason == "length"
    stop_id = free.token_ids[3]
    k = free.token_ids.index(stop_id)
    (cut,) = engine.generate_batch([PROMPTS[2]], [greedy(20, stop_token_ids=[stop_id])])
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: k + 1]
    assert cut.log_probs == pytest.approx(free.log_probs[: k + 1], abs=1e-5)
    (short,) = engine.generate_batch([PROMPTS[2]], [greedy(3)])
    assert short.token_ids == free.token_ids[:3] and short.finish_reason == "length"


def test_tokenizer_eos_stops(tokenizer):
    model = make_model(eos_token_id=None)
    # make <|im_end|> (id 2) the greedy choice: its output row is a scaled copy of the argmax row
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]])).logits[0, -1]
        top = int(logits.argmax())
        assert logits[top] > 0
        model.lm_head.weight[2] = 2.0 * model.lm_head.weight[top]
    no_tok = engine_for(model)
    assert no_tok.eos_ids == set()
    (o,) = no_tok.generate_batch([PROMPTS[0]], [greedy(5)])
    assert o.token_ids[0] == 2 and len(o.token_ids) == 5 and o.finish_reason == "length"
    with_tok = engine_for(model, tokenizer)
    assert with_tok.eos_ids == {2}
    (o,) = with_tok.generate_batch([PROMPTS[0]], [greedy(5)])
    assert o.token_ids == [2] and o.finish_reason == "stop" and o.text == ""


def test_model_config_eos_stops():
    model = make_model()  # config eos_token_id = 2
    with torch.no_grad():
        top = int(model(torch.tensor([PROMPTS[0]])).logits[0, -1].argmax())
        model.lm_head.weight[2] = 2.0 * model.lm_head.weight[top]
    (o,) = engine_for(model).generate_batch([PROMPTS[0]], [greedy(5)])
    assert o.token_ids == [2] and o.finish_reason == "stop"


def test_stop_strings(tokenizer):
    engine = engine_for(make_model(eos_token_id=None), tokenizer)
    prompt = tokenizer.encode("hello there")
    (free,) = engine.generate_batch([prompt], [greedy(20)])
    text = tokenizer.decode(free.token_ids[:5], skip_special_tokens=True)
    stop = text[-2:]
    assert stop.strip(), f"need a visible stop string, got {text!r}"
    (cut,) = engine.generate_batch([prompt], [greedy(20, stop=[stop])])
    assert cut.finish_reason == "stop"
    assert stop in cut.text and len(cut.token_ids) <= 5
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
    assert cut.text == tokenizer.decode(cut.token_ids, skip_special_tokens=True)


def test_max_model_len_truncates_with_length():
    engine = engine_for(make_model(eos_token_id=None), max_model_len=12)
    (o,) = engine.generate_batch([PROMPTS[2]], [greedy(20)])  # 9 prompt tokens
    assert len(o.token_ids) == 3 and o.finish_reason == "length"
    (o,) = engine.generate_batch([list(range(10, 21))], [greedy(20)])  # 11 prompt tokens: room for 1
    assert len(o.token_ids) == 1 and o.finish_reason == "length"


# ------------------------------------------------------------------ abort
def test_abort_returns_partial_output_and_others_finish():
    engine = engine_for(make_model(eos_token_id=None))
    for rid, p in zip("abc", PROMPTS[:3], strict=True):
        engine.add_request(rid, p, greedy(10))
    assert engine.step() == [] and engine.step() == []
    (out,) = engine.abort("b")
    assert out.request_id == "b" and out.finish_reason == "abort"
    assert len(out.token_ids) == 2 and len(out.log_probs) == 2
    (alone,) = engine_for(make_model(eos_token_id=None)).generate_batch([PROMPTS[1]], [greedy(10)])
    assert out.token_ids == alone.token_ids[:2]
    assert out.log_probs == pytest.approx(alone.log_probs[:2], abs=1e-5)
    assert engine.abort("b") == [] and engine.abort("nope") == []
    done = run_all(engine)
    assert sorted(done) == ["a", "c"]
    assert all(len(o.token_ids) == 10 and o.finish_reason == "length" for o in done.values())
    assert engine.stats()["kv_blocks_used"] == 0
    # abort(None) aborts everything, running or waiting
    engine = engine_for(make_model(eos_token_id=None), max_num_seqs=1)
    engine.add_request("x", PROMPTS[0], greedy(10))
    engine.add_request("y", PROMPTS[1], greedy(10))
    engine.step()
    outs = {o.request_id: o for o in engine.abort(None)}
    assert sorted(outs) == ["x", "y"]
    assert all(o.finish_reason == "abort" for o in outs.values())
    assert len(outs["x"].token_ids) == 1 and outs["y"].token_ids == []
    assert not engine.has_unfinished() and engine.stats()["kv_blocks_used"] == 0
    # the ids are free again
    engine.add_request("x", PROMPTS[0], greedy(2))
    assert len(run_all(engine)["x"].token_ids) == 2


# ------------------------------------------------------------------ weights and cache
def test_update_weights_changes_outputs_version_and_flushes_the_prefix_cache():
    engine = engine_for()
    other = make_model(seed=1)
    prompt = list(range(40, 53))  # 3 full blocks
    before = engine.generate_batch([prompt, PROMPTS[0]], [greedy(), greedy()])
    engine.update_weights_from_tensors(other.named_parameters(), version=7)
    assert engine.weight_version == 7
    hits = engine.stats()["prefix_hit_blocks"]
    after = engine.generate_batch([prompt, PROMPTS[0]], [greedy(), greedy()])
    # the prompt's blocks were computed with the old weights: they must not be reused
    assert engine.stats()["prefix_hit_blocks"] == hits
    assert [o.token_ids for o in after] == [hf_greedy(other, p, 12) for p in (prompt, PROMPTS[0])]
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    assert [o.weight_version for o in after] == [7, 7]
    engine.update_weights_from_tensors(make_model(seed=0).named_parameters())
    assert engine.weight_version == 8


def test_blocks_filled_across_a_weight_update_are_not_shared():
    engine = engine_for(make_model(eos_token_id=None))  # blocks of 4
    other = make_model(seed=1, eos_token_id=None)
    engine.add_request("r", [10, 11], greedy(10))
    engine.step()  # prefill of 10, 11 with the old weights
    engine.update_weights_from_tensors(other.named_parameters())
    engine.step()
    engine.step()  # this decode completes block 0: tokens 10, 11, t1 still hold old K/V
    r = engine.seqs["r"]
    prompt = r.tokens[:4] + [50]
    hits = engine.stats()["prefix_hit_blocks"]
    engine.add_request("new", prompt, greedy(6))
    done = run_all(engine)
    (fresh,) = engine_for(make_model(seed=1, eos_token_id=None)).generate_batch([prompt], [greedy(6)])
    assert engine.stats()["prefix_hit_blocks"] == hits
    assert done["new"].token_ids == fresh.token_ids


def test_flush_cache_stops_prefix_hits():
    engine = engine_for()
    prompt = list(range(40, 53))
    engine.generate_batch([prompt], [greedy(2)])
    engine.generate_batch([prompt], [greedy(2)])
    assert engine.stats()["prefix_hit_blocks"] == 3  # freed blocks are still cached
    assert engine.flush_cache() is True
    engine.generate_batch([prompt], [greedy(2)])
    assert engine.stats()["prefix_hit_blocks"] == 3
    engine.generate_batch([prompt], [greedy(2)])
    assert engine.stats()["prefix_hit_blocks"] == 6  # cached again after the flush


# ------------------------------------------------------------------ validation
def test_bad_requests_are_rejected_and_the_engine_still_serves():
    engine = engine_for(max_model_len=16)
    with pytest.raises(ValueError, match="request e: the prompt is empty"):
        engine.add_request("e", [], greedy())
    with pytest.raises(ValueError, match="request l: the prompt has 16 tokens; the context holds 16"):
        engine.add_request("l", list(range(10, 26)), greedy())
    with pytest.raises(ValueError, match=r"request v: prompt token ids must be ints in \[0, 320\)"):
        engine.add_request("v", [1, 320], greedy())
    with pytest.raises(ValueError, match=r"request v: prompt token ids must be ints in \[0, 320\)"):
        engine.add_request("v", [1, -1], greedy())
    with pytest.raises(ValueError, match=r"request b: logit_bias token id 320 is outside the vocabulary \[0, 320\)"):
        engine.add_request("b", [1, 2], greedy(logit_bias={5: 1.0, 320: 1.0}))
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got -1"):
        engine.add_request("n", [1, 2], greedy(-1))
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        engine.generate_batch([[1, 2]], [greedy(0)])
    with pytest.raises(ValueError, match="stop strings need an engine with a tokenizer"):
        engine.add_request("s", [1, 2], greedy(stop=["x"]))
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        engine.generate_batch([[1, 2], [3]], [greedy()])
    engine.add_request("dup", [1, 2, 3], greedy(4))
    with pytest.raises(ValueError, match="request dup: id already in use"):
        engine.add_request("dup", [4, 5], greedy(4))
    assert list(engine.seqs) == ["dup"]
    engine.add_request("e", list(range(10, 25)), greedy(4))  # 15 tokens: the longest allowed
    done = run_all(engine)
    assert sorted(done) == ["dup", "e"]
    assert done["dup"].token_ids == hf_greedy(make_model(), [1, 2, 3], 4)
    assert len(done["e"].token_ids) == 1  # 15 + 1 reaches max_model_len


def test_bad_engine_options():
    with pytest.raises(TypeError, match="unknown engine option 'blocksize'"):
        LLMEngine(make_model(), blocksize=4)
    with pytest.raises(ValueError, match="engine dtype must be one of"):
        EngineConfig(dtype="fp8").validate()
    with pytest.raises(ValueError, match="engine block_size must be >= 1"):
        EngineConfig(block_size=0).validate()
    with pytest.raises(ValueError, match="smaller than one block"):
        EngineConfig(block_size=16, kv_cache_tokens=8).validate()


def test_rejected_generate_leaves_nothing_queued():
    engine = engine_for()
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.generate_batch([[1, 2, 3], []], [greedy(), greedy()])
    assert not engine.has_unfinished() and engine.seqs == {}
