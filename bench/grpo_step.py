"""One GRPO step, tidal vs TRL's GRPOTrainer, on the quickstart workload (CPU, no vLLM).

    python -m bench grpo_step                      # 1 warm-up + 4 measured steps per framework
    python -m bench grpo_step --steps 6 --repeats 2 --trl-dtype float32
    python -m bench grpo_step --frameworks tidal tidal_invariant   # the price of batch invariance

Workload (see `bench.trl_runner`): SmolLM2-135M-Instruct, `env:arithmetic` level 1 through the
chat template, math reward, 8 prompts x 4 samples = 32 completions of at most 48 tokens per step,
one AdamW step (lr 1e-5) in micro-batches of 8, no KL, 2 torch threads. tidal samples with its own
engine in bf16 and trains a bf16 compute copy of fp32 master weights (`train.dtype: bfloat16`:
fp32 gradient accumulation and AdamW; `--tidal-dtype autocast` trains as TRL does). TRL
(`use_cpu=True`, `bf16=True`) trains in accelerate's bf16 autocast over fp32 weights and samples
with transformers' `generate` under the same autocast.

Each framework runs in its own process (alternating: tidal, TRL, tidal, TRL ... for `--repeats`),
one warm-up step then `--steps` measured steps. Reported per framework, over the measured steps:
seconds per step, where the time goes (rollout = generate + score, train = advantages +
forward/backward + optimizer, other), rollout tokens/s (completion tokens / generation time),
train tokens/s (prompt + completion tokens, no padding, / train time), peak RSS and mean reward;
then tidal/TRL seconds per step and whether tidal is at least 2x faster.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict

from bench.common import machine, write_result
from bench.trl_runner import add_run_args, run_alternating, versions, workload_from_args

PHASES = ("rollout", "generate", "train", "other")


def summarize(runs: list[dict]) -> dict:
    """Aggregate the measured steps of one framework's runs."""
    steps = [s for r in runs for s in r["steps"]]

    def mean(key: str) -> float:
        return statistics.fmean(s[key] for s in steps)

    def total(key: str) -> float:
        return sum(s[key] for s in steps)

    return {
        "runs": len(runs),
        "measured_steps": len(steps),
        "seconds_per_step": mean("seconds"),
        "seconds_per_step_by_run": [statistics.fmean(s["seconds"] for s in r["steps"]) for r in runs],
        "phases_s": {p: mean(f"{p}_s") for p in PHASES},
        "rollout_tokens_per_s": total("completion_tokens") / total("generate_s"),
        "train_tokens_per_s": total("train_tokens") / total("train_s"),
        "completion_tokens_per_step": mean("completion_tokens"),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "reward_mean": mean("reward_mean"),
        "process_wall_s": [r["wall_s"] for r in runs],
        "info": runs[0]["info"],
    }


def compare(by: dict[str, dict]) -> dict:
    """tidal vs TRL: the ratio of seconds per step and the per-phase speed-ups."""
    tidal, trl = by["tidal"], by["trl"]
    ratio = tidal["seconds_per_step"] / trl["seconds_per_step"]
    return {
        "tidal_over_trl_seconds_per_step": ratio,
        "tidal_speedup": 1 / ratio,
        "tidal_at_least_2x_faster": 1 / ratio >= 2.0,
        "phase_speedup": {
            p: trl["phases_s"][p] / tidal["phases_s"][p]
            for p in PHASES
            if min(tidal["phases_s"][p], trl["phases_s"][p]) > 0.05
        },
        "rollout_tokens_per_s_ratio": tidal["rollout_tokens_per_s"] / trl["rollout_tokens_per_s"],
        "train_tokens_per_s_ratio": tidal["train_tokens_per_s"] / trl["train_tokens_per_s"],
    }


def print_table(by: dict[str, dict], cmp: dict | None) -> None:
    print(
        f"\n{'framework':<16}{'s/step':>8}{'rollout s':>10}{'(generate)':>11}{'train s':>9}{'other s':>9}"
        f"{'rollout tok/s':>14}{'train tok/s':>12}{'peak RSS MB':>12}{'reward':>8}"
    )
    for name, r in by.items():
        ph = r["phases_s"]
        print(
            f"{name:<16}{r['seconds_per_step']:>8.1f}{ph['rollout']:>10.1f}{ph['generate']:>11.1f}"
            f"{ph['train']:>9.1f}{ph['other']:>9.2f}{r['rollout_tokens_per_s']:>14.0f}"
            f"{r['train_tokens_per_s']:>12.0f}{r['peak_rss_mb']:>12.0f}{r['reward_mean']:>8.3f}"
        )
    if cmp is None:
        return
    verdict = "yes" if cmp["tidal_at_least_2x_faster"] else "NO"
    phases = ", ".join(f"{p} x{v:.2f}" for p, v in cmp["phase_speedup"].items())
    print(
        f"tidal/TRL seconds per step: {cmp['tidal_over_trl_seconds_per_step']:.2f} "
        f"(tidal x{cmp['tidal_speedup']:.2f} faster; at least 2x: {verdict})\n"
        f"per-phase speed-up of tidal over TRL: {phases}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description="seconds per GRPO step: tidal vs TRL GRPOTrainer (CPU)")
    add_run_args(p, 4, "measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first in each run")
    args = p.parse_args()
    w = workload_from_args(args)
    runs = run_alternating(
        args, args.warmup, lambda r: f"{statistics.fmean(s['seconds'] for s in r['steps']):6.1f} s/step"
    )

    by = {fw: summarize(rs) for fw, rs in runs.items()}
    cmp = compare(by) if {"tidal", "trl"} <= set(by) else None
    print_table(by, cmp)
    invariant = None
    if {"tidal", "tidal_invariant"} <= set(by):  # the price of exact on-policy log-probs
        plain, exact = by["tidal"], by["tidal_invariant"]
        invariant = {
            "seconds_per_step_ratio": exact["seconds_per_step"] / plain["seconds_per_step"],
            "rollout_tokens_per_s_ratio": exact["rollout_tokens_per_s"] / plain["rollout_tokens_per_s"],
            "train_tokens_per_s_ratio": exact["train_tokens_per_s"] / plain["train_tokens_per_s"],
        }
        print(
            "tidal_invariant / tidal: seconds per step x{seconds_per_step_ratio:.2f}, rollout tokens/s "
            "x{rollout_tokens_per_s_ratio:.2f}, train tokens/s x{train_tokens_per_s_ratio:.2f}".format(**invariant)
        )
    settings = {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "workload": asdict(w)}
    payload = {
        "machine": machine(),
        "versions": versions(),
        "settings": settings,
        "results": by,
        "comparison": cmp,
        "batch_invariant": invariant,
        "runs": runs,
    }
    # a run of the batch-invariant variant keeps its own file
    name = "grpo_step-batch-invariant" if "tidal_invariant" in by else "grpo_step"
    print(f"wrote {write_result(name, payload)}")
