"""The GRPO run's figures by step: the reward model's mean score (what GRPO trained on) beside the
share of the step's answers that state a number (the preference itself, checked), and the mean
answer length; read from the run folder tidal wrote (`metrics.jsonl`, `samples/`).

    python examples/reward_model/report.py runs/reward_model/grpo
"""

from __future__ import annotations

import statistics
import sys

from preference import states_a_number

from tidal.log import read_metrics
from tidal.samples_log import read_samples


def rows(run_dir: str) -> list[tuple[int, float, float, float, float]]:
    """(step, RM reward mean, share stating a number, mean response tokens, seconds) per step."""
    metrics = {m["step"]: m for m in read_metrics(run_dir)}
    out = []
    for step, records in sorted(read_samples(run_dir).items()):
        m = metrics[step]
        numbers = statistics.fmean(states_a_number(r["response"]) for r in records)
        length = statistics.fmean(r["response_length"] for r in records)
        out.append((step, m["reward/mean"], numbers, length, m["time/step"]))
    return out


def main() -> None:
    print("| step | RM reward (mean) | answers stating a number | response tokens | s/step |")
    print("|---:|---:|---:|---:|---:|")
    for step, reward, numbers, length, seconds in rows(sys.argv[1]):
        print(f"| {step} | {reward:.3f} | {numbers:.2f} | {length:.1f} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
