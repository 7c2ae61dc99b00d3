"""Run the quickstart once per estimator (one config line each) and compare the reward curves.

    python examples/algorithms/compare.py                      # grpo dr_grpo gspo rloo ppo
    python examples/algorithms/compare.py --algos grpo cispo --steps 10

Each run is `tidal train --config examples/quickstart/config.yaml --algo.advantage=<name>`;
the table gives the mean reward over the first and the last three steps and the seconds per
step, and `runs/algorithms/summary.json` keeps the per-step rewards.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(algo: str, steps: int, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "tidal.cli", "train",
        "--config", str(ROOT / "examples/quickstart/config.yaml"),
        f"--algo.advantage={algo}",
        "--train.lr=1e-5",  # the lr of the table in README.md (the quickstart now runs 2e-5 for 10 steps)
        f"--train.num_steps={steps}",
        f"--train.output_dir={out / algo}",
        "--train.save_interval=0",
        "--log.log_samples=0",
    ]  # fmt: skip
    # each comparison is a fresh run: tidal refuses a new run in a used folder, and this one is ours
    shutil.rmtree(out / algo, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / algo / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    return {
        "algo": algo,
        "rewards": rewards,
        "first3": statistics.fmean(rewards[:3]),
        "last3": statistics.fmean(rewards[-3:]),
        "step_s": statistics.fmean(r["time/step"] for r in rows),
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algos", nargs="+", default=["grpo", "dr_grpo", "gspo", "rloo", "ppo"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="runs/algorithms")
    args = p.parse_args()
    out = ROOT / args.out
    results = []
    for algo in args.algos:
        results.append(run(algo, args.steps, out))
        (out / "summary.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'estimator':<30}{'reward first 3':>16}{'reward last 3':>15}{'s/step':>8}")
    for r in results:
        print(f"{r['algo']:<30}{r['first3']:>16.3f}{r['last3']:>15.3f}{r['step_s']:>8.1f}")


if __name__ == "__main__":
    main()
