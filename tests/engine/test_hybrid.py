"""Hybrid models' recurrent states in the engine (`tidal.engine.states`) and the trainer's packed
rows (`tidal.recurrent`): a group's prompt is computed once and its state copied to every sample,
a prefix shared without a twin is recomputed (no state for a cache hit), state slots come back
after finishing, aborts and preemption, sleep frees the pool and wake gives it back zeroed, and a
packed row's samples do not read each other's states. Tokens and log-probs are compared with
transformers (tests/engine/test_families.py runs the rest of the engine's checks on these
families too)."""

from __future__ import annotations

import pytest
import torch
from families import HYBRID, hf_greedy, hf_logprobs, tiny_model

from tidal.contracts import SamplingParams
from tidal.engine.llm_engine import LLMEngine
from tidal.engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_thread")


def engine_for(family: str, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_tokens", 512)
    return LLMEngine(tiny_model(family), None, dtype="float32", block_size=4, **kw)


def states_of(engine: LLMEngine, slot: int) -> list[torch.Tensor]:
    pool = engine.runner.states
    return [t[slot] for t in (*pool.conv.values(), *pool.recurrent.values()) if t is not None]


PROMPT = list(range(40, 54))  # 14 tokens: 3 full blocks and 2 more


@pytest.mark.parametrize("family", HYBRID)
def test_a_group_computes_its_prompt_once_and_each_sample_gets_its_state(family):
    engine = engine_for(family)
    params = [SamplingParams(temperature=1.0, max_new_tokens=8, seed=i, ignore_eos=True) for i in range(4)]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", PROMPT, p)
    engine.step()  # the prompts: the first computes, the three twins copy
    seqs = [engine.seqs[f"r{i}"] for i in range(4)]
    assert engine.counters["prefill_tokens"] == 14
    assert engine.counters["prefill_tokens_copied"] == 3 * 2  # the twins share 3 blocks and copy the rest
    assert engine.stats()["prefix_hit_blocks"] == 3 * 3
    lead = states_of(engine, seqs[0].state_slot)
    assert any(t.abs().sum() > 0 for t in lead)
    for s in seqs[1:]:
        assert s.state_slot != seqs[0].state_slot
        assert all(torch.equal(a, b) for a, b in zip(states_of(engine, s.state_slot), lead, strict=True))
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    ref = tiny_model(family)
    tokens = [outs[f"r{i}"].token_ids for i in range(4)]
    assert len({tuple(t) for t in tokens}) > 1  # the samples went their own ways from the shared state
    for i in range(4):
        o = outs[f"r{i}"]
        assert o.log_probs == pytest.approx(hf_logprobs(ref, PROMPT + o.token_ids, len(PROMPT)), abs=1e-4)


LONG = [(7 * i + 3) % 300 + 10 for i in range(20)]  # 20 tokens: 5 blocks of 4


def greedy_params(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def run(engine: LLMEngine, prompt: list[int], n: int = 6):
    return engine.generate_batch([prompt], [greedy_params(n)])[0]


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2", "falcon_h1"])
def test_a_prefix_hit_starts_from_the_states_kept_at_its_end(family):
    """States are kept every 8 tokens a sequence computes (prefill and decode alike); a later
    request whose prefix hits the cache starts from the snapshot at the hit's end: a prompt
    sharing 18 tokens hits 4 blocks (16 tokens: the snapshot there), a second turn continuing the
    first request's 26 tokens hits 6 (24: taken while it decoded). Same tokens and log-probs as
    transformers; without snapshots the same requests compute everything."""
    ref = tiny_model(family)
    second = LONG[:18] + [200, 201, 202]
    for snapshots, hits in ((32, (4, 6)), (0, (0, 0))):
        engine = engine_for(family, state_snapshots=snapshots, state_snapshot_tokens=8)
        first = run(engine, LONG)
        out = run(engine, second)
        assert engine.stats()["prefix_hit_blocks"] == hits[0]
        assert engine.counters["prefill_tokens"] == len(LONG) + len(second) - 4 * hits[0]
        turn = LONG + first.token_ids + [210, 211]
        out2 = run(engine, turn)
        assert engine.stats()["prefix_hit_blocks"] == hits[0] + hits[1]
        for prompt, o in ((LONG, first), (second, out), (turn, out2)):
            assert o.token_ids == hf_greedy(ref, prompt, 6)
            assert o.log_probs == pytest.approx(hf_logprobs(ref, prompt + o.token_ids, len(prompt)), abs=1e-4)


def test_snapshots_are_bounded_and_dropped_with_new_weights():
    """One snapshot slot, least recently used out: the first request's states at 8 tokens (16 finds
    no free slot in the same step) give way to those at 24, taken while it decodes, so a prompt
    sharing 18 tokens would hit nothing and the second turn hits 6 blocks. After a weight update
    (which flushes the prefix cache) no snapshot is left, and the same turn hits nothing."""
    engine = engine_for("qwen3_next", state_snapshots=1, state_snapshot_tokens=8)
    first = run(engine, LONG)
    assert len(engine.blocks.states.snap) == 1
    turn = LONG + first.token_ids + [210, 211]
    assert engine.blocks.cached_tokens(Sequence("a", LONG[:18] + [200, 201, 202], greedy_params()), False) == 0
    run(engine, turn)
    assert engine.stats()["prefix_hit_blocks"] == 6 and len(engine.blocks.states.snap) == 1
    engine.update_weights_from_tensors(tiny_model("qwen3_next").named_parameters())
    assert not engine.blocks.states.snap
    out = run(engine, turn)
    assert engine.stats()["prefix_hit_blocks"] == 6
    assert out.token_ids == hf_greedy(tiny_model("qwen3_next"), turn, 6)


def test_state_slots_come_back_after_finishing_aborts_and_preemption():
    engine = engine_for("qwen3_next", max_num_seqs=3)
    assert engine.blocks.states.free == [2, 1, 0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i, 9, 11, 13], greedy)
    engine.step()
    assert engine.blocks.states.free == [] and sorted(engine.seqs[f"r{i}"].state_slot for i in range(3)) == [0, 1, 2]
    assert engine.seqs["r3"].state_slot == -1  # waiting: max_num_seqs are running
    engine.abort("r1")
    assert engine.blocks.states.free == [1]
    while engine.has_unfinished():
        engine.step()
    assert sorted(engine.blocks.states.free) == [0, 1, 2]

    tight = engine_for("qwen3_next", kv_cache_tokens=48, max_num_seqs=4)  # 12 blocks: preempts
    prompts = [[(37 * i + 11 * j) % 317 + 3 for j in range(10)] for i in range(4)]
    outs = tight.generate_batch(prompts, [SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)] * 4)
    assert tight.stats()["preemptions"] > 0 and sorted(tight.blocks.states.free) == [0, 1, 2, 3]
    ref = tiny_model("qwen3_next")
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(ref, p, 20)


def test_the_state_pool_has_each_layers_shape_and_sleep_frees_it():
    """Qwen3-Next's GDN layers (0 and 2): a conv state of its kernel's 4 inputs over q, k and v
    (2 x 2 key heads x 16 + 4 value heads x 16 = 128 channels) and a delta-rule state per value
    head [4, 16, 16] in fp32; the attention layer has none. A slot per running sequence and per
    snapshot."""
    engine = engine_for("qwen3_next", max_num_seqs=5, state_snapshots=3)  # 8 slots
    pool = engine.runner.states
    assert set(pool.shapes) == {0, 2}
    for layer in (0, 2):
        assert pool.shapes[layer].conv == ((128, 4), torch.float32)
        assert pool.shapes[layer].recurrent == ((4, 16, 16), torch.float32)
    assert pool.nbytes() == 2 * 8 * (128 * 4 + 4 * 16 * 16) * 4
    engine.generate_batch([PROMPT], [SamplingParams(temperature=0.0, max_new_tokens=4)])
    assert any(t.abs().sum() > 0 for t in states_of(engine, 0))
    engine.sleep()
    assert pool.nbytes() == 0
    engine.wake()
    assert pool.nbytes() == 2 * 8 * (128 * 4 + 4 * 16 * 16) * 4
    assert all(t.abs().sum() == 0 for t in states_of(engine, 0))
    ref = tiny_model("qwen3_next")
    engine.update_weights_from_tensors(ref.named_parameters())
    out = engine.generate_batch([PROMPT], [SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)])
    assert out[0].token_ids == hf_greedy(ref, PROMPT, 6)


@pytest.mark.parametrize("family", HYBRID)
def test_a_packed_row_does_not_carry_state_from_one_sample_into_the_next(family):
    """transformers' own forward over a packed row lets the second sample start from the first's
    states (its log-probs differ from the sample alone); the trainer's packed path does not."""
    from tidal.train.attention import packed_layout, use_packed_attention

    model = tiny_model(family)
    a, b = [1, 5, 9, 33, 70, 8, 100], [7, 300, 17, 250, 99, 3, 64, 128, 190]
    row = torch.tensor([a + b])
    pos = torch.tensor([list(range(len(a))) + list(range(len(b)))])
    with torch.no_grad():
        alone = model(torch.tensor([b])).logits[0]
        leaked = model(row, position_ids=pos, use_cache=False).logits[0, len(a) :]
        assert (leaked - alone).abs().max() > 1e-2
        assert use_packed_attention(model)
        packed = model(row, position_ids=pos, use_cache=False, tidal_layout=packed_layout(pos)).logits[0]
    assert torch.allclose(packed[len(a) :], alone, atol=1e-5)
    with torch.no_grad():
        first = model(torch.tensor([a])).logits[0]
    assert torch.allclose(packed[: len(a)], first, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_next", "falcon_h1"])
def test_the_trainer_gives_packed_rows_the_log_probs_of_padded_batches(family):
    """A group's prompt stored once in a packed row, the recurrent layers run per sample: the
    same log-probs as a right-padded batch."""
    from conftest import make_samples

    from tidal.algo.options import AlgoConfig
    from tidal.train.actor import Actor
    from tidal.train.options import TrainConfig

    samples = make_samples(8, group=4)
    actors = {
        packing: Actor(
            tiny_model(family),
            TrainConfig(micro_batch_size=8, global_batch_size=8, dtype="float32", packing=packing),
            AlgoConfig(),
        )
        for packing in (True, False)
    }
    assert actors[True].fwd.packing and actors[True].fwd.share_prompts
    packed, padded = (actors[p].compute_log_probs(samples) for p in (True, False))
    for i, s in enumerate(samples):
        r = s.response_length
        assert torch.allclose(packed[i, :r], padded[i, :r], atol=1e-5)


def test_a_qwen3_5_checkpoint_runs_as_its_language_model(tmp_path):
    """Qwen3.5 checkpoints are vision-language models (`qwen3_5`); the engine loads one as its
    language model (transformers' causal-LM class for the type) and gives the whole model's
    greedy tokens for a text prompt."""
    from families import _BASE, _GDN, _reinit
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = {k: v for k, v in {**_BASE, **_GDN}.items() if k != "bos_token_id"}
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
    config = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    vlm = AutoModelForImageTextToText.from_config(config).eval()
    _reinit(vlm, 0)  # well-separated greedy choices
    vlm.save_pretrained(tmp_path)
    engine = LLMEngine(tmp_path, None, dtype="float32", block_size=4, kv_cache_tokens=256)
    assert engine.model.config.model_type == "qwen3_5_text"
    out = engine.generate_batch([PROMPT], [SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)])
    with torch.no_grad():
        want = vlm.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=8, eos_token_id=None)
    assert out[0].token_ids == want[0, len(PROMPT) :].tolist()


def test_the_run_config_sets_the_snapshots_and_bad_values_are_named():
    from tidal.adapters.factory import core_options
    from tidal.backends import ENGINES
    from tidal.config import build_config

    assert core_options(build_config(None, {}).engine, 512)["state_snapshots"] == 32
    assert core_options(build_config(None, {"engine.state_snapshots": 0}).engine, 512)["state_snapshots"] == 0
    assert "state_snapshots" in ENGINES["tidal"].core_options and "state_snapshots" not in ENGINES["vllm"].core_options
    engine = engine_for("lfm2", state_snapshots=0)
    assert engine.blocks.states.snapshots == 0 and engine.runner.states.slots == engine.cfg.max_num_seqs
    with pytest.raises(ValueError) as e:
        engine_for("lfm2", state_snapshot_tokens=6)
    assert str(e.value) == "engine state_snapshot_tokens must be a multiple of block_size (4), got 6"
