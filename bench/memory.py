"""Peak memory of a GRPO run: tidal with the engine's weights packed for oneDNN, tidal without,
tidal packed with `train.gradient_checkpointing` full ("tidal ckpt") and selective ("tidal sac"),
and TRL's GRPOTrainer (without it), on one workload (CPU, float32 everywhere).

    python -m bench memory                        # one run of each, alternating
    python -m bench memory --repeats 2            # tidal packed, tidal plain, tidal ckpt, tidal sac, TRL, ...

Workload (see `bench.trl_runner`, the quickstart's data and reward): SmolLM2-135M-Instruct, 2
prompts x 8 samples of at most 32 new tokens per step, one optimizer step per rollout in one
micro-batch of 16, 3 steps (no warm-up dropped: the peak is the whole run's), float32 weights,
training and sampling on both sides (`--tidal-dtype`, `--rollout-dtype`, `--trl-dtype`), 2
threads. Each run is a fresh process (tidal's with the allocator settings `tidal train` uses);
its peak RSS is the kernel's high-water mark of its resident memory (`ru_maxrss`), so it counts
everything the run ever held at once: weights, the packed copy, AdamW's moments, activations and
the allocator's kept free memory. Prints a table and writes `bench/results/memory-<kind>.json`.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, replace

from bench.common import machine, write_result
from bench.trl_runner import add_workload_args, run_child, run_note, versions, workload_from_args

# what each row runs: (framework, engine.pack_weights, train.gradient_checkpointing)
CONFIGS = {
    "tidal packed": ("tidal", 1, "false"),
    "tidal plain": ("tidal", 0, "false"),
    "tidal ckpt": ("tidal", 1, "full"),
    "tidal sac": ("tidal", 1, "selective"),
    "trl": ("trl", 1, "false"),
}
DEFAULTS = {
    "prompts": 2,
    "samples": 8,
    "max_new_tokens": 32,
    "micro_batch": 16,
    "tidal_dtype": "float32",
    "rollout_dtype": "float32",
    "trl_dtype": "float32",
}


def summarize(runs: list[dict]) -> dict:
    """One configuration's runs: the peak RSS of each and their mean, seconds per step."""
    peaks = [r["peak_rss_mb"] for r in runs]
    return {
        "peak_rss_mb": peaks,
        "peak_rss_mb_mean": statistics.fmean(peaks),
        "seconds_per_step": statistics.fmean(s["seconds"] for r in runs for s in r["steps"]),
        "process_wall_s": [r["wall_s"] for r in runs],
        "info": runs[0]["info"],
    }


def print_table(by: dict[str, dict]) -> None:
    trl = by.get("trl", {}).get("peak_rss_mb_mean")
    print(f"\n{'run':<14}{'peak RSS MB (each run)':>28}{'mean':>8}{'x TRL':>7}{'s/step':>8}")
    for name, r in by.items():
        each = ", ".join(f"{p:.0f}" for p in r["peak_rss_mb"])
        ratio = f"{r['peak_rss_mb_mean'] / trl:.2f}" if trl else "-"
        print(f"{name:<14}{each:>28}{r['peak_rss_mb_mean']:>8.0f}{ratio:>7}{r['seconds_per_step']:>8.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description="peak RSS of a GRPO run: tidal packed / plain vs TRL (CPU, fp32)")
    p.add_argument("--steps", type=int, default=3, help="steps per run (all measured)")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration (alternating)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    add_workload_args(p)
    p.set_defaults(**DEFAULTS)
    args = p.parse_args()
    w = workload_from_args(args)
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    for rep in range(args.repeats):
        for name in args.configs:
            framework, packed, ckpt = CONFIGS[name]
            r = run_child(framework, replace(w, pack_weights=packed, gradient_checkpointing=ckpt), args.steps, 0)
            runs[name].append(r)
            print(f"  run {rep + 1} {name:<13} peak RSS {r['peak_rss_mb']:6.0f} MB  ({run_note(r)})", flush=True)
    by = {name: summarize(rs) for name, rs in runs.items()}
    print_table(by)
    payload = {
        "machine": machine(),
        "versions": versions(),
        "settings": {"steps": args.steps, "repeats": args.repeats, "workload": asdict(w)},
        "results": by,
        "runs": runs,
    }
    print(f"wrote {write_result('memory', payload)}")
