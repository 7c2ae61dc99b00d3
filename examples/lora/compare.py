"""Run the quickstart with full fine-tuning and with LoRA on the same seeds, and compare them.

    python examples/lora/compare.py                         # 20 steps per arm
    python examples/lora/compare.py --steps 10 --out /tmp/lora-cmp
    python examples/lora/compare.py --table                 # the table of the last comparison again

The arms are `tidal train --config examples/quickstart/config.yaml` (full fine-tuning, lr 1e-5)
and `tidal train --config examples/lora/config.yaml` (the same run with rank-16 LoRA and its own
lr), one after the other, each into a fresh folder under `--out`. Both configs keep the same data
and training seeds, so step 1 rolls out the same batch in both (LoRA starts as the base model
exactly). The table gives the mean reward over the first and the last three steps and over the
second half of the run, and the mean seconds per step (whole step, and its train part);
`<out>/summary.json` keeps the per-step rewards and the machine: torch's CPU capability, the
dtype tidal resolved and the thread count.
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
ARMS = {"full": "examples/quickstart/config.yaml", "lora": "examples/lora/config.yaml"}


def run(arm: str, steps: int, out: Path) -> dict:
    folder = out / arm
    cmd = [
        sys.executable, "-m", "tidal.cli", "train",
        "--config", str(ROOT / ARMS[arm]),
        f"--train.num_steps={steps}",
        f"--train.output_dir={folder}",
        "--train.save_interval=0",
        "--log.log_samples=0",
    ]  # fmt: skip
    if arm == "full":
        cmd.append("--train.lr=1e-5")  # the lr of the measured table (the quickstart itself now runs 2e-5 for 10 steps)
    # each arm is a fresh run: tidal refuses a new run in a used folder, and this one is ours
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((folder / "config.json").read_text())
    rewards = [r["reward/mean"] for r in rows]
    return {
        "arm": arm,
        "config": ARMS[arm],
        "lr": config["train"]["lr"],
        "lora_rank": config["train"]["lora_rank"],
        "dtype": config["resolved"]["train.dtype"]["dtype"],
        "threads": config["train"]["num_threads"],
        "rewards": rewards,
        "first3": statistics.fmean(rewards[:3]),
        "last3": statistics.fmean(rewards[-3:]),
        "step_s": statistics.fmean(r["time/step"] for r in rows),
        "train_s": statistics.fmean(r["time/train"] for r in rows),
        # without LoRA the engine shares the trainer's tensors: only the first push moves bytes
        "sync_mb": [r.get("sync/bytes", 0.0) / 1e6 for r in rows],
        "wall_s": wall,
    }


def commit() -> str:
    """The checkout's commit, with `+dirty` when tidal/ differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "tidal"], cwd=ROOT).returncode != 0
    return head.stdout.strip() + ("+dirty" if dirty else "")


def print_table(summary: dict) -> None:
    commits = ", ".join(sorted({r.get("commit", "?") for r in summary["arms"]}))
    print(f"\nCPU capability {summary['cpu_capability']}, {summary['steps']} steps per arm, commit {commits}")
    print(
        f"{'arm':<6}{'lr':>9}{'dtype':>9}{'threads':>8}{'reward first 3':>16}{'reward last 3':>15}"
        f"{'2nd half':>10}{'s/step':>8}{'train s':>9}"
    )
    for r in summary["arms"]:
        # one step's mean is over 32 samples (about +-0.08): the second half's mean is steadier
        half = statistics.fmean(r["rewards"][len(r["rewards"]) // 2 :])
        print(
            f"{r['arm']:<6}{r['lr']:>9.0e}{r['dtype']:>9}{r['threads']:>8}{r['first3']:>16.3f}{r['last3']:>15.3f}"
            f"{half:>10.3f}{r['step_s']:>8.1f}{r['train_s']:>9.1f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="/tmp/tidal-lora-compare")
    p.add_argument("--table", action="store_true", help="print the table of <out>/summary.json, run nothing")
    args = p.parse_args()
    out = Path(args.out)
    if args.table:
        print_table(json.loads((out / "summary.json").read_text()))
        return
    import torch  # only for the machine record: the runs are subprocesses

    out.mkdir(parents=True, exist_ok=True)
    summary = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "steps": args.steps, "arms": []}
    for arm in args.arms:
        summary["arms"].append({**run(arm, args.steps, out), "commit": commit()})
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_table(summary)
    print(f"wrote {out / 'summary.json'}")


if __name__ == "__main__":
    main()
