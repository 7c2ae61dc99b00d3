"""Does it learn as well? Reward per step, tidal vs TRL's GRPOTrainer, on the quickstart workload.

    python -m bench learning                       # 10 steps per framework
    python -m bench learning --steps 20 --repeats 2

Same workload, prompts (in the same order), seed and sample budget as `bench.grpo_step` (see
`bench.trl_runner`): 8 prompts x 4 samples per step, one optimizer step per rollout. Each
framework runs `--steps` steps from the base model in its own process, alternating for
`--repeats`; repeat k uses sampling seed `--seed` + k, the same for both frameworks. No warm-up
step is dropped, every step counts. Prints the per-step mean reward of each run and the mean over
the last `--last` steps. With 32 samples a step the curves are noisy: read a difference of a few
hundredths as a tie.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict

from bench.common import machine, write_result
from bench.trl_runner import add_run_args, run_alternating, versions, workload_from_args


def curve(run: dict) -> list[float]:
    return [s["reward_mean"] for s in run["steps"]]


def summarize(runs: list[dict], last: int) -> dict:
    """Per-run curves, the mean curve, and the mean reward over the first and last `last` steps."""
    curves = [curve(r) for r in runs]
    mean_curve = [statistics.fmean(c[i] for c in curves) for i in range(len(curves[0]))]
    return {
        "curves": curves,
        "mean_curve": mean_curve,
        f"first_{last}_mean": statistics.fmean(mean_curve[:last]),
        f"last_{last}_mean": statistics.fmean(mean_curve[-last:]),
        "seconds_per_step": statistics.fmean(s["seconds"] for r in runs for s in r["steps"]),
        "process_wall_s": [r["wall_s"] for r in runs],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
    }


def print_table(by: dict[str, dict], last: int) -> None:
    names = list(by)
    print("\nmean reward per step")
    print(f"{'step':>8}" + "".join(f"{n:>10}" for n in names))
    for i in range(len(by[names[0]]["mean_curve"])):
        print(f"{i + 1:>8}" + "".join(f"{by[n]['mean_curve'][i]:>10.3f}" for n in names))
    print(f"{'first ' + str(last):>8}" + "".join(f"{by[n][f'first_{last}_mean']:>10.3f}" for n in names))
    print(f"{'last ' + str(last):>8}" + "".join(f"{by[n][f'last_{last}_mean']:>10.3f}" for n in names))
    print(f"{'s/step':>8}" + "".join(f"{by[n]['seconds_per_step']:>10.1f}" for n in names))


def main() -> None:
    p = argparse.ArgumentParser(description="reward curves: tidal vs TRL GRPOTrainer on the same budget (CPU)")
    add_run_args(p, 10, "training steps per run")
    p.add_argument("--last", type=int, default=3, help="average the reward over this many final steps")
    args = p.parse_args()
    w = workload_from_args(args)
    runs = run_alternating(
        args, 0, lambda r: "rewards " + " ".join(f"{x:.2f}" for x in curve(r)), new_seed_per_repeat=True
    )

    by = {fw: summarize(rs, args.last) for fw, rs in runs.items()}
    print_table(by, args.last)
    settings = {"steps": args.steps, "last": args.last, "repeats": args.repeats, "workload": asdict(w)}
    payload = {"machine": machine(), "versions": versions(), "settings": settings, "results": by, "runs": runs}
    print(f"wrote {write_result('learning', payload)}")
