"""Train the quickstart from Python: build the config in code, run it, read the metrics back.

    python examples/python_api/train.py --steps 2
    python examples/python_api/train.py --steps 4 --set rollout.n_samples_per_prompt=8 --set train.lr=1e-5

The same run as `tidal train --config examples/quickstart/config.yaml --train.num_steps 2`, into a
new folder runs/python_api-<time> (or --out DIR); then one line per step from the metrics
`tidal.run` returns. docs/python-api.md describes the functions.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

import tidal

QUICKSTART = Path(__file__).resolve().parents[1] / "quickstart" / "config.yaml"


def parse_set(text: str) -> tuple[str, object]:
    """`group.key=value`, the value read as YAML (`1e-5`, `true`, `[1, 2]`) as the command line reads it."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected group.key=value, got {text!r}")
    return key, yaml.safe_load(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the quickstart through tidal's Python API.")
    parser.add_argument("--steps", type=int, default=2, help="training steps (default: 2)")
    parser.add_argument("--out", help="run folder (default: a new runs/python_api-<time>)")
    parser.add_argument(
        "--set", type=parse_set, action="append", default=[], metavar="GROUP.KEY=VALUE", help="any option"
    )
    args = parser.parse_args(argv)
    out = args.out or f"runs/python_api-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        cfg = tidal.make_config(
            QUICKSTART,
            train={"num_steps": args.steps, "output_dir": out},  # options by group...
            overrides=dict(args.set),  # ...and by dotted key, applied last
        )
    except tidal.ConfigError as e:  # every problem, each naming the field and the fix
        print(f"train.py: {e}", file=sys.stderr)
        return 2
    history = tidal.run(cfg)  # one dict per step, as metrics.jsonl holds it
    print(f"{len(history)} steps into {cfg.train.output_dir}")
    for row in history:
        print(
            f"step {row['step']}: reward {row['reward/mean']:.3f}, "
            f"{row['response/length_mean']:.1f} tokens per response, {row['time/step']:.1f} s"
        )
    return 0


if __name__ == "__main__":  # needed: the worker processes of a sync reward of your own import this script again
    sys.exit(main())
