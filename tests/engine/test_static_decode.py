"""Decode steps over static buffers (`tidal.engine.cuda_graphs.DecodeGraphs`), the path a GPU
replays from CUDA graphs, run eagerly on the CPU: block tables and lengths read by the paged
attention (its PyTorch reference here), batches padded to a bucket with rows that touch only the
padding block. Same tokens as the runner's usual path."""

from __future__ import annotations

import pytest
import torch
from families import tiny_model

from tidal.contracts import SamplingParams
from tidal.engine.cuda_graphs import bucket_sizes
from tidal.engine.llm_engine import LLMEngine
from tidal.engine.sequence import Sequence

# 3, 5 and 6 sequences: batches that pad to buckets of 4 and 8
PROMPTS = [[1, 5, 9], list(range(40, 60)), [7, 300, 17, 250, 99, 3, 64, 128, 190, 211, 16, 45], [11], [4, 4], [8] * 9]


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert bucket_sizes(512)[:9] == [1, 2, 4, 8, 16, 32, 48, 64, 96]
    assert bucket_sizes(512)[-2:] == [480, 512] and len(bucket_sizes(512)) == 22
    assert bucket_sizes(100)[-3:] == [64, 96, 100]


def engines(family: str, dtype: str, max_seqs: int = 8) -> tuple[LLMEngine, LLMEngine]:
    """The same model twice: the usual CPU engine, and one whose pure decode steps run through
    the static buffers (as on a GPU, without capturing)."""
    kw = {"dtype": dtype, "block_size": 4, "kv_cache_tokens": 512, "max_num_seqs": max_seqs}
    plain, static = LLMEngine(tiny_model(family), None, **kw), LLMEngine(tiny_model(family), None, **kw)
    assert static.runner.use_static_decode(max_seqs, static.max_model_len, capture=False) is None
    return plain, static


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_static_buffers_give_the_usual_tokens(family):
    # float32: in bfloat16 the reference attention rounds its scores where the CPU's kernel keeps
    # float32, and a sampled token can flip (the kernel's bf16 test: tests/engine/test_paged_kernel.py)
    plain, static = engines(family, "float32")
    params = [SamplingParams(temperature=1.0, max_new_tokens=12, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    params[0] = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    want = plain.generate_batch(PROMPTS, params)
    calls = []
    fill = static.runner.graphs.fill
    static.runner.graphs.fill = lambda seqs, size, ids=None, known=None: (
        calls.append((len(seqs), size, ids is not None)) or fill(seqs, size, ids, known)
    )
    got = static.generate_batch(PROMPTS, params)
    # the first decode step is the decode path's check (transformers' forward beside it); the
    # other ten ran over the static buffers, 6 sequences padded to 8: the first fed the tokens
    # the host had read, the next nine overlapped, fed the tokens of the step before on the device
    assert calls == [(6, 8, False)] + [(6, 8, True)] * 9 and static.runner.decode_path_checked
    assert static.stats()["overlapped_steps"] == 9
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids  # the same sums in another order
        assert max(abs(a - b) for a, b in zip(g.log_probs, w.log_probs, strict=True)) < 1e-5


def test_padding_rows_touch_only_the_padding_block():
    plain, static = engines("llama", "float32", max_seqs=8)
    params = [SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)] * 3
    static.generate_batch(PROMPTS[:3], params)  # 3 sequences in a bucket of 4
    pad = static.runner.pad_block * static.cfg.block_size
    for cache in static.runner.k_cache:
        # the padding rows wrote their keys to the padding slot, and nothing else there moved
        assert cache[pad].abs().sum() > 0 and cache[pad + 1 :].abs().sum() == 0


def test_fill_writes_each_sequences_table_and_padding():
    _, static = engines("llama", "float32", max_seqs=8)
    graphs = static.runner.graphs
    seqs = []
    for i, (table, n) in enumerate([([5, 2, 9], 10), ([7], 3), ([1, 0, 3, 4, 6], 17)]):
        seq = Sequence(str(i), list(range(1, n)), SamplingParams(), block_table=table)
        seq.output_ids = [100 + i]
        seq.num_cached = n - 1
        seqs.append(seq)
    graphs.host_tab.fill_(-1)
    graphs.fill(seqs, 4)
    vec, tab = graphs.vec[:, :4].tolist(), graphs.tab[:4].tolist()
    pad = static.runner.pad_block
    assert vec[0] == [100, 101, 102, 0]  # each sequence's last token; padding feeds token 0
    assert vec[1] == [9, 2, 16, 0]  # its position
    assert vec[2] == [9 * 4 + 1, 7 * 4 + 2, 6 * 4 + 0, pad * 4]  # the slot of that position
    assert vec[3] == [10, 3, 17, 1]  # context lengths
    assert tab[0][:3] == [5, 2, 9] and tab[1][:1] == [7] and tab[2][:5] == [1, 0, 3, 4, 6] and tab[3][0] == pad


def test_graphs_are_off_where_the_decode_path_is():
    engine = LLMEngine(tiny_model("gemma2"), None, dtype="float32", kv_cache_tokens=256)
    why = engine.runner.use_static_decode(8, 64, capture=False)
    assert why == (
        "gemma2 steps run transformers' forward (the decode path covers llama, mistral, qwen2, qwen3, "
        "qwen2_vl_text, qwen2_5_vl_text, qwen3_vl_text, without MoE)"
    )
    assert engine.runner.graphs is None and not engine.runner.device_tables


def overlapping(family: str = "llama", max_seqs: int = 4) -> tuple[LLMEngine, LLMEngine]:
    """Two engines over static buffers: steps overlapped (the GPU's way) and plain."""
    kw = {"dtype": "float32", "block_size": 4, "kv_cache_tokens": 512, "max_num_seqs": max_seqs}
    on = LLMEngine(tiny_model(family), None, **kw)
    off = LLMEngine(tiny_model(family), None, overlap_steps=False, **kw)
    for e in (on, off):
        assert e.runner.use_static_decode(max_seqs, e.max_model_len, capture=False) is None
    return on, off


def mixed_params(stops: dict[int, int] | None = None) -> list[SamplingParams]:
    kinds = [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 3},
        {"temperature": 0.8, "top_p": 0.9, "seed": 4, "top_logprobs": 2},
        {"temperature": 1.2, "top_k": 20, "seed": 5},
    ]
    out = []
    for i in range(10):
        stop = [stops[i]] if stops and i in stops else []
        out.append(SamplingParams(max_new_tokens=6 + i, stop_token_ids=stop, **kinds[i % 4]))
    return out


def run_all(engine: LLMEngine, prompts, params) -> list:
    """Every request's `RequestOutput` (top log-probs included), in request order."""
    rids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    return [done[r] for r in rids]


def same(a, b) -> None:
    """The same tokens and finish reasons; log-probs within float32 rounding (a row's products may
    be summed in another order when the batch around it has another size)."""
    for x, y in zip(a, b, strict=True):
        assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason)
        assert max(abs(p - q) for p, q in zip(x.log_probs, y.log_probs, strict=True)) < 1e-5
        if x.top_logprobs is not None:
            assert [[t for t, _ in top] for top in x.top_logprobs] == [[t for t, _ in top] for top in y.top_logprobs]


def test_overlapped_steps_give_the_plain_steps_tokens():
    """Ten requests through four sequence slots (admissions end the overlap, then it resumes),
    greedy and seeded rows, top-p/top-k, top log-probs, lengths 6..15, and stop tokens met at
    various steps: the same tokens, log-probs and finish reasons as steps read one by one."""
    on, off = overlapping()
    prompts = [[3 + i, 17, 40 + 2 * i] + [9] * i for i in range(10)]
    first = off.generate_batch(prompts, mixed_params())
    stops = {i: first[i].token_ids[2 + i % 3] for i in (1, 2, 5, 6, 9)}  # each met within its length
    want = run_all(off, prompts, mixed_params(stops))
    got = run_all(on, prompts, mixed_params(stops))
    same(got, want)
    assert all(len(top) == 2 for top in got[2].top_logprobs)
    assert sum(o.finish_reason == "stop" for o in got) == 5
    assert on.stats()["overlapped_steps"] > 10 and off.stats()["overlapped_steps"] == 0
    assert on.blocks.num_used == 0 and not on.has_unfinished()


def test_overlapped_steps_stop_at_the_context_as_at_max_new_tokens():
    """Requests whose context ends before their max_new_tokens (and others the other way round)
    finish by length at the same token in overlapped steps as in plain ones."""
    on, off = overlapping()
    for e in (on, off):
        e.max_model_len = 24
    prompts = [[3 + i] * (4 + 3 * i) for i in range(6)]  # 4 .. 19 tokens: 20 .. 5 left
    params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=(30, 9)[i % 2], ignore_eos=True) for i in range(6)]
    want, got = run_all(off, prompts, params), run_all(on, prompts, params)
    same(got, want)
    assert [len(o.token_ids) for o in got] == [
        min(24 - len(p), sp.max_new_tokens) for p, sp in zip(prompts, params, strict=True)
    ]
    assert all(o.finish_reason == "length" for o in got) and on.stats()["overlapped_steps"] > 5


def test_abort_while_a_step_is_in_flight():
    on, off = overlapping()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=12, ignore_eos=True) for i in range(3)]
    want = off.generate_batch(prompts, params)
    rids = [on.add_request(None, p, sp) for p, sp in zip(prompts, params, strict=True)]
    while on.stats()["overlapped_steps"] < 3:
        on.step()
    assert on._launched is not None  # a step is in flight
    (aborted,) = on.abort(rids[1])
    assert aborted.finish_reason == "abort" and want[1].token_ids[: len(aborted.token_ids)] == aborted.token_ids
    done = {}
    while on.has_unfinished():
        done.update((o.request_id, o) for o in on.step())
    assert done[rids[0]].token_ids == want[0].token_ids and done[rids[2]].token_ids == want[2].token_ids
    assert on.blocks.num_used == 0


def test_blocks_filled_while_overlapping_serve_the_prefix_cache():
    """A continuation (the prompt, the answer and a new turn) finds the blocks the answer filled
    during overlapped steps in the prefix cache, as it finds them after plain steps."""
    on, off = overlapping()
    prompt = [7, 8, 9, 10, 11, 12]
    params = SamplingParams(temperature=1.0, seed=1, max_new_tokens=15, ignore_eos=True)
    hits = []
    for engine in (on, off):
        (out,) = engine.generate_batch([prompt], [params])
        turn = prompt + out.token_ids + [20, 21]
        (again,) = engine.generate_batch([turn], [SamplingParams(temperature=0.0, max_new_tokens=3)])
        hits.append((out.token_ids, again.token_ids, engine.blocks.hits))
    assert hits[0] == hits[1] and hits[0][2] == 5  # (6 + 15 - 1) // 4: the full blocks fed before the end


def test_kernels_that_fail_their_check_stay_off(monkeypatch, caplog):
    """A kernel that does not compile on this GPU (here: raises) leaves the PyTorch references on,
    saying why; the engine still generates."""
    import logging

    from tidal.engine import paged_kernel

    def broken(*args, **kwargs):
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(paged_kernel, "runs_on", lambda device: True)
    monkeypatch.setattr(paged_kernel, "decode_attention", broken)
    engine = LLMEngine(tiny_model("llama"), None, dtype="float32", block_size=4, kv_cache_tokens=256)
    with caplog.at_level(logging.WARNING, logger="tidal.engine.model_runner"):
        assert engine.runner.use_static_decode(4, engine.max_model_len, capture=False) is None
    assert not engine.runner.kernel
    why = "paged attention kernels off (their PyTorch references run): RuntimeError: no such instruction"
    assert why in caplog.text
    (out,) = engine.generate_batch([[3, 4, 5]], [SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)])
    assert len(out.token_ids) == 4


def test_graphs_are_dropped_when_what_they_read_moves():
    """A captured graph replays the addresses it was captured with: after a weight update that
    gives a parameter new storage (an aliased trainer tensor), or a KV cache made again after
    sleep, the engine's check drops the graphs (captured again on their next use); an in-place
    weight update (the RL loop's) keeps them."""
    _, static = engines("llama", "float32", max_seqs=4)
    runner, graphs = static.runner, static.runner.graphs
    graphs.graphs[4] = ("a graph", None)  # as if captured (capturing needs a GPU)
    graphs.captured_with = runner.bindings()
    w = static.model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        w.mul_(0.5)  # in place: same storage
    graphs.check()
    assert 4 in graphs.graphs
    w.data = w.data.clone()  # new storage
    graphs.check()
    assert graphs.graphs == {}
    graphs.graphs[4] = ("a graph", None)
    graphs.captured_with = runner.bindings()
    runner.allocate()  # the caches made again (as wake() does)
    graphs.check()
    assert graphs.graphs == {}
    # a parameter replaced by a new object, and a submodule added (a trainer's LoRA layers
    # adopted): the parameters are read from the module tree again
    for change in (
        lambda mlp: setattr(mlp.up_proj, "weight", torch.nn.Parameter(mlp.up_proj.weight.detach().clone())),
        lambda mlp: setattr(mlp, "extra", torch.nn.Linear(2, 2)),
    ):
        graphs.graphs[4] = ("a graph", None)
        graphs.captured_with = runner.bindings()
        graphs.check()
        assert 4 in graphs.graphs
        change(static.model.model.layers[1].mlp)
        graphs.check()
        assert graphs.graphs == {}


def test_a_decode_step_that_cannot_be_captured_runs_eagerly(caplog):
    """Capture fails (here: no CUDA at all; on a GPU, an op that syncs with the host): the engine
    says why once and runs the same static-buffer steps eagerly, with the usual tokens."""
    import logging

    plain, static = engines("llama", "float32")
    with caplog.at_level(logging.WARNING, logger="tidal.engine.cuda_graphs"):
        static.runner.use_static_decode(8, static.max_model_len, capture=True)
    assert "CUDA graphs off: capturing the decode step failed (" in caplog.text
    assert not static.runner.graphs.capture and static.runner.graphs.graphs == {}
    params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=6, ignore_eos=True) for i in range(3)]
    got, want = static.generate_batch(PROMPTS[:3], params), plain.generate_batch(PROMPTS[:3], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert caplog.text.count("CUDA graphs off") == 1


def test_the_run_config_turns_graphs_off():
    from tidal.adapters.factory import core_options
    from tidal.backends import ENGINES
    from tidal.config import build_config

    assert core_options(build_config(None, {}).engine, 512)["cuda_graphs"] is True
    assert core_options(build_config(None, {"engine.cuda_graphs": False}).engine, 512)["cuda_graphs"] is False
    assert "cuda_graphs" in ENGINES["tidal"].core_options and "cuda_graphs" not in ENGINES["vllm"].core_options
    assert (
        LLMEngine(tiny_model("llama"), None, dtype="float32", kv_cache_tokens=256, cuda_graphs=False).cfg.cuda_graphs
        is False
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_give_the_eager_tokens(family, dtype):
    # the same engine with its decode steps replayed from CUDA graphs (and overlapped) and launched
    # one kernel at a time: the same kernels, so the same tokens and log-probs
    kw = {"dtype": dtype, "device": "cuda", "block_size": 4, "kv_cache_tokens": 512, "max_num_seqs": 8}
    eager = LLMEngine(tiny_model(family), None, cuda_graphs=False, **kw)
    graphs = LLMEngine(tiny_model(family), None, **kw)
    params = [SamplingParams(temperature=1.0, max_new_tokens=12, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    want, got = eager.generate_batch(PROMPTS, params), graphs.generate_batch(PROMPTS, params)
    assert graphs.stats()["cuda_graph_replays"] > 0 and graphs.stats()["overlapped_steps"] > 0
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.log_probs, w.log_probs, strict=True)) < 1e-5


def test_static_steps_run_the_fused_ops(monkeypatch):
    # the static buffers' steps (a CUDA graph's capture on a GPU) run outside the engine's
    # inference mode: the norms must still be the engine's fused ones, not the modules' own ops
    from tidal.engine import native

    if native.load() is None:
        pytest.skip("no C compiler: the CPU's fused norm is not built")
    _, static = engines("llama", "float32")
    graphs, calls, inside = static.runner.graphs, [], [False]
    fused = native.rms_norm
    monkeypatch.setattr(native, "rms_norm", lambda *a: calls.append(inside[0]) or fused(*a))
    forward = graphs.forward

    def traced(plan):
        inside[0] = True
        try:
            return forward(plan)
        finally:
            inside[0] = False

    graphs.forward = traced
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=i, ignore_eos=True) for i in range(3)]
    static.generate_batch(PROMPTS[:3], params)
    # 2 layers x 2 norms and the final norm, in each of the 4 static steps
    assert calls.count(True) == 5 * 4
