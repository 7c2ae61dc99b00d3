"""Overlapped rollout and training (`overlap.mode`) against the synchronous loop, side by side.

    python -m bench overlap                          # simulated engine, modes off one_step full
    python -m bench overlap --engine real --steps 20 # the quickstart itself in each mode

`--engine simulated` (the default) is a labelled simulation of an engine on a device of its own:
the engine's weights are real (the weight pushes are real loads) but a decode step is a fixed
sleep of `--sleep-ms` per step that uses no CPU, emitting seeded random tokens, so the trainer
has the 2 cores to itself while the engine "works". That shows what overlap buys when rollout and
training do not share a processor: the step time, and the idle time it removes on each side.
`--engine real` runs the quickstart (SmolLM2, the tidal engine) where engine and trainer share the
same 2 cores: there overlap can only hide Python and scheduling gaps.

Every mode runs in its own subprocess on examples/quickstart/config.yaml; the first step is not
timed (start-up). Stale modes use `algo.is_correction: truncate` (TIS), which the run requires.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine, run_measurement, write_result

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart" / "config.yaml"
MODES = {
    "off": {},
    "one_step": {"overlap.mode": "one_step", "algo.is_correction": "truncate"},
    "full_k1": {"overlap.mode": "full", "overlap.max_staleness": 1, "algo.is_correction": "truncate"},
    "full_k2": {"overlap.mode": "full", "overlap.max_staleness": 2, "algo.is_correction": "truncate"},
}


def parity_reward(sample) -> float:
    """A reward random tokens earn half the time, so every group has signal and every step trains."""
    return float(sum(sample.response_tokens) % 2 == 0)


def simulate_engine(sleep_s: float) -> None:
    """Make `LLMEngine`'s step API a sleeping stand-in (see the module docstring): requests are
    queued and answered with seeded random tokens, one per step, each step a sleep; weights, weight
    loads and everything else stay real."""
    from tidal.contracts import RequestOutput
    from tidal.engine.llm_engine import LLMEngine

    def table(self) -> dict:
        return self.__dict__.setdefault("_simulated", {})

    def add_request(self, request_id, prompt_ids, params):
        rid = request_id if request_id is not None else f"sim-{len(table(self))}-{time.monotonic_ns()}"
        table(self)[rid] = (list(prompt_ids), params, random.Random(params.seed), [])
        return rid

    def output(self, rid: str, reason: str) -> RequestOutput:
        prompt, _, _, ids = table(self).pop(rid)
        lp = -math.log(self.model.config.vocab_size)
        text = self.tokenizer.decode(ids)
        return RequestOutput(
            request_id=rid,
            token_ids=ids,
            log_probs=[lp] * len(ids),
            finish_reason=reason,
            text=text,
            weight_version=self.weight_version,
            prompt_tokens=len(prompt),
        )

    def step(self):
        time.sleep(sleep_s)
        vocab, done = self.model.config.vocab_size, []
        for rid, (_, params, rng, ids) in list(table(self).items()):
            ids.append(rng.randrange(3, vocab))
            if len(ids) >= params.max_new_tokens:
                done.append(output(self, rid, "length"))
        return done

    def abort(self, request_id=None):
        rids = list(table(self)) if request_id is None else [request_id]
        return [output(self, r, "abort") for r in rids if r in table(self)]

    LLMEngine.add_request = add_request
    LLMEngine.step = step
    LLMEngine.abort = abort
    LLMEngine.has_unfinished = lambda self: bool(table(self))


def child(args) -> dict:
    from tidal.config import build_config
    from tidal.hardware import resolve_dtype
    from tidal.loop import train

    if args.engine == "simulated":
        simulate_engine(args.sleep_ms / 1000)
    values = {
        **MODES[args.mode],
        "train.num_steps": args.steps,
        "train.output_dir": tempfile.mkdtemp(prefix="tidal-bench-overlap-"),
        "train.save_interval": 0,
        "log.tensorboard": False,
        "log.console": False,
        "log.log_samples": 0,
    }
    if args.engine == "simulated":
        values["reward.fn"] = "bench.overlap:parity_reward"
    t0 = time.perf_counter()
    history = train(build_config(str(QUICKSTART), values))
    wall = time.perf_counter() - t0
    timed = history[1:]
    mean = lambda key: statistics.fmean(h.get(key, 0.0) for h in timed)  # noqa: E731
    return {
        "mode": args.mode,
        "engine": args.engine,
        "sleep_ms": args.sleep_ms if args.engine == "simulated" else None,
        "steps": args.steps,
        "wall_s": wall,
        "step_s": mean("time/step"),
        "trainer_idle_s": mean("time/trainer_idle"),
        "engine_idle_s": mean("time/engine_idle"),
        "train_s": mean("time/train"),
        "staleness_mean": mean("staleness/mean"),
        "aborted": sum(h.get("rollout/aborted", 0.0) for h in history),
        "resumed": sum(h.get("rollout/resumed", 0.0) for h in history),
        "reward_by_step": [round(h["reward/mean"], 4) for h in history],
        "step_s_by_step": [round(h["time/step"], 2) for h in history],
        "dtype": resolve_dtype("auto", "train.dtype").dtype,
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("simulated", "real"), default="simulated")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=["off", "one_step", "full_k1", "full_k2"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--sleep-ms", type=float, default=60.0, help="simulated engine: seconds per decode step / 1000")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.mode = args.child
        print("RESULT " + json.dumps(child(args)))
        return
    rows = []
    for mode in args.modes:
        cmd = [sys.executable, "-m", "bench", "overlap", "--child", mode, "--engine", args.engine,
               "--steps", str(args.steps), "--sleep-ms", str(args.sleep_ms)]  # fmt: skip
        rows.append(run_measurement(cmd, f"overlap {mode} ({args.engine})"))
    base = next((r["step_s"] for r in rows if r["mode"] == "off"), None)
    cpu = machine()["cpu_capability"]
    print(f"\noverlap, {args.engine} engine, {args.steps} steps (first not timed); {cpu}, {rows[0]['dtype']}")
    print(f"{'mode':<10} {'s/step':>7} {'speedup':>8} {'train s':>8} {'trainer idle':>13} {'engine idle':>12} "
          f"{'staleness':>10} {'aborted':>8}  reward by step")  # fmt: skip
    for r in rows:
        speed = f"{base / r['step_s']:.2f}x" if base else "-"
        print(f"{r['mode']:<10} {r['step_s']:7.2f} {speed:>8} {r['train_s']:8.2f} {r['trainer_idle_s']:13.2f} "
              f"{r['engine_idle_s']:12.2f} {r['staleness_mean']:10.2f} {r['aborted']:8.0f}  "
              f"{' '.join(f'{x:.2f}' for x in r['reward_by_step'])}")  # fmt: skip
    name = "overlap-quickstart" if args.engine == "real" else "overlap"
    if args.engine == "simulated" and args.sleep_ms != 60:
        name += f"-sleep{args.sleep_ms:g}ms"
    path = write_result(name, {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"wrote {path}")
