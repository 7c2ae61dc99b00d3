"""Trainer throughput: forward + backward tokens/s of `Actor.train_step` per micro-batch layout.

    python -m bench train_throughput                      # 32 samples, 2 measured steps per layout
    python -m bench train_throughput --steps 3 --budget 2048

Workload: SmolLM2-135M-Instruct, fp32 master weights and a bf16 compute copy (`train.dtype:
bfloat16`), GRPO (PPO-clip loss, no KL), one
optimizer step per 32 synthetic samples (random token ids, prompt 30-60 and response 8-200 tokens,
fixed seed). Layouts, each in its own subprocess (one warm-up step, then `--steps` timed steps):

- `padded`: micro-batches of 8 samples, right-padded to the longest (`train.packing=false`);
- `packed`: micro-batches of 8 samples, concatenated into one row (`train.packing=true`);
- `budget`: packed rows filled first-fit up to `--budget` tokens (`train.max_tokens_per_micro_batch`);
- `packed_autocast`: `packed` computed under bf16 autocast over the fp32 weights (`train.dtype:
  autocast`, the precision recipe of TRL's `bf16=True` on CPU) instead of on a bf16 copy.

Tokens are real tokens (prompt + response, no padding); tokens/s is per whole optimizer step, and
`fwd_bwd_tokens_per_s` leaves out the AdamW step (timed with optimizer hooks). Machine limit: a subprocess times large
2048x2048 `torch.matmul`s in bf16 and fp32 on the same threads. Model FLOPs use 6 x N x tokens with
N all parameters (embedding included; SmolLM2 ties it with the output projection). That is an
approximation: tidal runs the output projection only at response positions (and on the padded
[B, R] response grid), never at prompt positions, and 6ND leaves attention out. A second count,
`matmul_flops`, is closer: 6 x non-embedding params x tokens + 6 x embedding params x response
tokens + 6 x layers x width x sum(length^2) for causal attention.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from bench.common import machine, peak_rss_mb, run_measurement, write_result

LAYOUTS = ("padded", "packed", "budget", "packed_autocast")


def synthetic_samples(n: int, prompt_range, response_range, seed: int, vocab: int, group: int = 1) -> list:
    """`n` samples of random non-special token ids with lengths drawn uniformly from the ranges;
    each run of `group` consecutive samples shares one prompt (a GRPO group)."""
    from tidal.types import Sample

    rng = random.Random(seed)
    out = []
    prompt: list[int] = []
    for i in range(n):
        if i % group == 0:
            prompt = [rng.randrange(32, vocab) for _ in range(rng.randint(*prompt_range))]
        r = rng.randint(*response_range)
        tokens = prompt + [rng.randrange(32, vocab) for _ in range(r)]
        lps = [-rng.uniform(0.1, 3.0) for _ in range(r)]
        out.append(
            Sample(
                tokens=tokens,
                response_length=r,
                loss_mask=[1] * r,
                rollout_log_probs=lps,
                index=i,
                group_index=i // group,
            )
        )
    return out


def train_config(layout: str, args):
    """The `TrainConfig` of one layout: a single optimizer step over all samples."""
    from tidal.train.options import TrainConfig

    cfg = TrainConfig(
        global_batch_size=args.samples,
        micro_batch_size=args.micro_batch_size,
        packing=layout != "padded",
        max_tokens_per_micro_batch=args.budget if layout == "budget" else 0,
        lr=1e-6,
        dtype="autocast" if layout == "packed_autocast" else "bfloat16",
        num_threads=args.threads,
    )
    return cfg


def layout_shape(fwd, samples) -> dict:
    """Micro-batch count and the token slots the layout computes: the padded [B, L] grid for
    `padded`, the row length for packed ones, plus the response tokens the output projection
    runs on in both (real ones only: padding of the [B, R] response grid is skipped)."""
    slots = resp_slots = 0
    sizes = []
    for idx in fwd.plan(samples):
        mb = [samples[i] for i in idx]
        sizes.append(len(mb))
        width = max(len(s.tokens) for s in mb)
        slots += sum(len(s.tokens) for s in mb) if fwd.packing else width * len(mb)
        resp_slots += sum(s.response_length for s in mb)
    return {"micro_batches": len(sizes), "micro_batch_sizes": sizes, "token_slots": slots, "response_slots": resp_slots}


def model_counts(model) -> dict:
    """Parameter counts for the FLOP estimates (tied weights counted once)."""
    c = model.config
    n_all = sum(p.numel() for p in model.parameters())
    n_embed = model.get_input_embeddings().weight.numel()
    return {
        "params_all": n_all,
        "params_embedding": n_embed,
        "params_non_embedding": n_all - n_embed,
        "layers": c.num_hidden_layers,
        "attn_width": c.num_attention_heads * getattr(c, "head_dim", c.hidden_size // c.num_attention_heads),
    }


def matmul_flops(counts: dict, samples) -> float:
    """fwd + bwd matmul FLOPs the samples need: linear layers at every token, output projection at
    response tokens only, causal attention scores and values within each sample."""
    tokens = sum(len(s.tokens) for s in samples)
    resp = sum(s.response_length for s in samples)
    sq = sum(len(s.tokens) ** 2 for s in samples)
    linear = 6 * counts["params_non_embedding"] * tokens + 6 * counts["params_embedding"] * resp
    return linear + 6 * counts["layers"] * counts["attn_width"] * sq


def time_optimizer(optimizer) -> list[float]:
    """A list that collects the seconds of every later `optimizer.step()` (AdamW over fp32 weights)."""
    times: list[float] = []
    start: list[float] = []
    optimizer.register_step_pre_hook(lambda *_: start.append(time.perf_counter()))
    optimizer.register_step_post_hook(lambda *_: times.append(time.perf_counter() - start.pop()))
    return times


def child_layout(args) -> dict:
    """Warm up and time `args.steps` train steps of one layout."""
    from tidal.algo.options import AlgoConfig
    from tidal.convert import ensure_model
    from tidal.train.actor import Actor

    model_dir = ensure_model("smollm2")
    actor = Actor(model_dir, train_config(args.layout, args), AlgoConfig(), pad_id=2)
    counts = model_counts(actor.model)
    samples = synthetic_samples(
        args.samples, args.prompt_len, args.response_len, args.seed, actor.model.config.vocab_size
    )
    adv = torch.randn(len(samples), generator=torch.Generator().manual_seed(args.seed))
    actor.train_step(samples, adv)  # warm-up: allocator, oneDNN primitives, optimizer state
    opt_times = time_optimizer(actor.optimizer)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        actor.train_step(samples, adv)
        times.append(time.perf_counter() - t0)
    return {
        "layout": args.layout,
        "step_seconds": times,
        "optimizer_seconds": opt_times,
        "tokens": sum(len(s.tokens) for s in samples),
        "response_tokens": sum(s.response_length for s in samples),
        "matmul_flops": matmul_flops(counts, samples),
        **counts,
        **layout_shape(actor.fwd, samples),
    }


def child_matmul(args) -> dict:
    """GFLOP/s of a square `torch.matmul` per dtype, best of `reps` after one warm-up."""
    n, reps = args.matmul_size, 5
    out = {"size": n}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.matmul(a, b)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_gflops"] = 2 * n**3 / best / 1e9
    return out


def child(args) -> None:
    """One measurement in this process; prints a JSON line."""
    torch.set_num_threads(args.threads)
    res = child_matmul(args) if args.layout == "matmul" else child_layout(args)
    res["peak_rss_mb"] = peak_rss_mb()
    res["loadavg_1min_after"] = os.getloadavg()[0]  # well above the thread count: something else ran
    print("RESULT " + json.dumps(res), flush=True)


def run_child(layout: str, args) -> dict:
    """Run one measurement in a fresh process and return its result."""
    cmd = [sys.executable, "-m", "bench", "train_throughput", "--layout", layout]
    for k in ("samples", "micro_batch_size", "budget", "steps", "seed", "threads", "matmul_size"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    cmd += ["--prompt-len", *map(str, args.prompt_len), "--response-len", *map(str, args.response_len)]
    return run_measurement(cmd, layout)


def derive(r: dict, mm: dict) -> None:
    """Add tokens/s, padding fraction and fractions of the measured bf16 matmul rate to a row."""
    step = sum(r["step_seconds"]) / len(r["step_seconds"])
    opt = sum(r["optimizer_seconds"]) / len(r["optimizer_seconds"])
    r["seconds_per_step"] = step
    r["optimizer_seconds_per_step"] = opt
    r["tokens_per_s"] = r["tokens"] / step
    r["fwd_bwd_tokens_per_s"] = r["tokens"] / (step - opt)
    r["padding_fraction"] = 1 - r["tokens"] / r["token_slots"]
    r["model_gflops_6nd"] = 6 * r["params_all"] * r["tokens"] / 1e9
    r["achieved_gflops_6nd"] = r["model_gflops_6nd"] / step
    r["achieved_gflops_matmul"] = r["matmul_flops"] / 1e9 / step
    r["fraction_of_bf16_matmul_6nd"] = r["achieved_gflops_6nd"] / mm["bfloat16_gflops"]
    r["fraction_of_bf16_matmul"] = r["achieved_gflops_matmul"] / mm["bfloat16_gflops"]


def print_table(rows: list[dict], mm: dict) -> None:
    print(
        f"\nmatmul {mm['size']}x{mm['size']}: bf16 {mm['bfloat16_gflops']:.0f} GFLOP/s, "
        f"fp32 {mm['float32_gflops']:.0f} GFLOP/s"
    )
    print(
        f"{'layout':<16}{'mbs':>5}{'tokens':>8}{'slots':>8}{'pad %':>7}{'s/step':>8}{'adam s':>8}{'tok/s':>8}"
        f"{'fb tok/s':>10}"
        f"{'GF/s 6ND':>10}{'% bf16':>8}{'GF/s mm':>9}{'% bf16':>8}{'RSS MB':>8}"
    )
    for r in rows:
        print(
            f"{r['layout']:<16}{r['micro_batches']:>5}{r['tokens']:>8}{r['token_slots']:>8}"
            f"{100 * r['padding_fraction']:>7.1f}{r['seconds_per_step']:>8.2f}{r['optimizer_seconds_per_step']:>8.2f}"
            f"{r['tokens_per_s']:>8.0f}{r['fwd_bwd_tokens_per_s']:>10.0f}"
            f"{r['achieved_gflops_6nd']:>10.0f}{100 * r['fraction_of_bf16_matmul_6nd']:>8.1f}"
            f"{r['achieved_gflops_matmul']:>9.0f}{100 * r['fraction_of_bf16_matmul']:>8.1f}{r['peak_rss_mb']:>8.0f}"
        )
    print(
        f"6ND uses all {rows[0]['params_all'] / 1e6:.1f}M parameters (embedding included); "
        "'mm' counts the output projection at response tokens only, plus causal attention;\n"
        "tok/s and GF/s are per whole optimizer step (AdamW included); 'fb tok/s' leaves the AdamW step out"
    )


def parse_args():
    p = argparse.ArgumentParser(description="tidal trainer tokens/s: padded vs packed vs token-budget micro-batches")
    p.add_argument("--samples", type=int, default=32, help="samples per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--budget", type=int, default=1024, help="max_tokens_per_micro_batch of the budget layout")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[30, 60])
    p.add_argument("--response-len", type=int, nargs=2, default=[8, 200])
    p.add_argument("--steps", type=int, default=2, help="timed steps per layout (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--matmul-size", type=int, default=2048)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.layout:
        return child(args)
    t0 = time.perf_counter()
    mm = run_child("matmul", args)
    print(f"  matmul: bf16 {mm['bfloat16_gflops']:.0f} GFLOP/s, fp32 {mm['float32_gflops']:.0f} GFLOP/s", flush=True)
    rows = []
    for layout in args.layouts:
        r = run_child(layout, args)
        derive(r, mm)
        rows.append(r)
        print(f"  {layout:<16} {r['tokens_per_s']:6.0f} tok/s  {r['seconds_per_step']:6.2f} s/step", flush=True)
    print_table(rows, mm)
    settings = {k: v for k, v in vars(args).items() if k != "layout"}
    settings.update(
        dtype="bf16 compute copy, fp32 master weights (packed_autocast: bf16 autocast over fp32 weights)",
        algo="grpo (ppo clip loss, no KL)",
        model="smollm2",
    )
    payload = {
        "machine": machine(),
        "settings": settings,
        "matmul": mm,
        "rows": rows,
        "flops_note": (
            "model_gflops_6nd = 6 x params_all (embedding included, tied output projection counted once) x tokens; "
            "an approximation: tidal applies the output projection only at response tokens, not at "
            "prompt positions, and 6ND ignores attention. matmul_flops = 6 x params_non_embedding x tokens + "
            "6 x params_embedding x response tokens + 6 x layers x attn_width x sum(len^2) (causal attention)."
        ),
        "total_seconds": time.perf_counter() - t0,
    }
    path = write_result("train_throughput", payload)
    print(f"wrote {path} ({payload['total_seconds']:.0f} s)")
