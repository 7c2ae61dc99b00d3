"""`bench gpu`'s reading of a profiler trace and of its options, on made-up input (no GPU)."""

import sys
from pathlib import Path

# `bench` is the repository's folder, not an installed package: importable however pytest was started
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu import _union, parse_opts, trace_steps  # noqa: E402


def _ev(cat, name, ts, dur, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_union_counts_overlaps_once():
    assert _union([(0, 10), (5, 15), (20, 25)]) == 20
    assert _union([(0, 10), (2, 3)]) == 10
    assert _union([]) == 0


def test_trace_steps_attributes_kernels_by_correlation():
    events = [
        _ev("user_annotation", "bench_step_0", 0, 100),
        _ev("user_annotation", "bench_sync", 90, 10),
        _ev("cuda_runtime", "cudaLaunchKernel", 10, 1, corr=1),
        _ev("cuda_driver", "cuLaunchKernel", 20, 1, corr=2),
        _ev("cuda_runtime", "cudaGraphLaunch", 30, 1, corr=3),
        _ev("cuda_runtime", "cudaMemcpyAsync", 40, 1, corr=4),
        _ev("cuda_runtime", "cudaStreamSynchronize", 50, 1, corr=5),
        _ev("cuda_runtime", "cudaDeviceSynchronize", 91, 1, corr=6),  # the bench's own: left out
        _ev("kernel", "a", 12, 10, corr=1),
        _ev("kernel", "b", 18, 10, corr=2),  # overlaps a
        _ev("kernel", "g1", 40, 5, corr=3),  # two kernels of one graph launch
        _ev("kernel", "g2", 45, 5, corr=3),
        _ev("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 41, 1, corr=4),
        # the next step's work
        _ev("user_annotation", "bench_step_1", 200, 50),
        _ev("cuda_runtime", "cudaLaunchKernel", 210, 1, corr=7),
        _ev("kernel", "a", 215, 4, corr=7),
    ]
    (s0, s1), top = trace_steps({"traceEvents": events}, 2)
    assert s0["launches"] == 3 and s0["graph_launches"] == 1 and s0["kernel_launches"] == 2
    assert s0["kernels"] == 4
    assert s0["gpu_busy_ms"] == 26 / 1e3  # 12..28 and 40..50
    assert s0["kernel_sum_ms"] == 30 / 1e3
    assert s0["h2d_copies"] == 1
    assert s0["syncs"] == {"cudaStreamSynchronize": 1, "cudaDeviceSynchronize": 0}
    assert s1["kernels"] == 1 and s1["launches"] == 1 and s1["gpu_busy_ms"] == 4 / 1e3
    assert top[0]["name"] == "a" and top[0]["per_step"] == 1.0


def test_trace_steps_without_cuda_events():
    events = [_ev("user_annotation", "bench_step_0", 0, 100), _ev("cpu_op", "aten::mm", 10, 5)]
    (s0,), top = trace_steps({"traceEvents": events}, 1)
    assert s0["kernels"] == 0 and s0["gpu_busy_ms"] == 0 and top == []


def test_engine_options_are_typed():
    opts = parse_opts(["native_attention=false", "max_num_batched_tokens=4096", "x=0.5", "quantization=fp8"])
    assert opts == {"native_attention": False, "max_num_batched_tokens": 4096, "x": 0.5, "quantization": "fp8"}


def test_decode_check_lets_rounding_pass_and_catches_the_faults():
    """`bench decode_check` on a tiny llama in bf16 (the GPU's rule, run on the CPU): as built the
    two paths give the same bits; rounded once, they differ by more than 1% of the largest logit
    yet pass; both faults fail."""
    from bench.decode_check import measure

    rows = {r["case"]: r for r in measure("tiny-llama", "bfloat16", "cpu", [4])}
    assert rows["as built"]["same_bits"] and rows["as built"]["passes"]
    rounded = rows["rotary rounded once"]
    assert not rounded["same_bits"] and not rounded["passes_1pct_rule"] and rounded["passes"]
    assert rounded["tolerance"] == 6 * 2**-7
    for fault in ("positions + 1", "context one short"):
        assert not rows[fault]["passes"] and rows[fault]["relative_error"] > 4 * rows[fault]["tolerance"]
