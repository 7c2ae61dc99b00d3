"""How rollout and GRPO step time grow with the group size and the response length.

    python -m bench scaling                                  # all three sweeps
    python -m bench scaling --sweeps rollout_n --group-sizes 2 4

Sweeps, every point in its own subprocess:

- `rollout_n`: `LLMEngine.generate` (SmolLM2-135M-Instruct, bf16, temperature 1) on `--prompts`
  prompts x n samples, n in `--group-sizes`, at `--max-new-tokens`;
- `rollout_len`: the same with n = `--len-group-size` and max_new_tokens in `--lengths`;
- `grpo_step`: `tidal.loop.train` on examples/quickstart/config.yaml for 2 steps with
  n_samples_per_prompt in `--grpo-group-sizes` (global_batch_size = rollout_batch_size x n, so
  every step is one optimizer step); the second step is timed (rollout, train, weight sync).

The rollout prompts ask for a long story (through the chat template), so that most samples run to
max_new_tokens: the engine always stops on EOS, so the generated token count, the share of samples
that ran full length and the engine steps (the time per step shows the batch cost) are reported.
Each sweep gets a least-squares line: seconds per extra sample (rollout_n, grpo_step) and per extra
32 tokens of max_new_tokens (rollout_len). Scaling over engines or trainer ranks is not measured:
there is a single 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import machine, peak_rss_mb, run_measurement, write_result

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart" / "config.yaml"
SWEEPS = ("rollout_n", "rollout_len", "grpo_step")


TOPICS = ("a dragon", "the sea", "a robot", "a small town", "winter", "a lost key", "the moon", "a baker")


def story_prompts(tokenizer, n: int) -> list[list[int]]:
    """`n` chat-templated prompts whose natural answers run past 128 tokens: SmolLM2 at temperature 1
    fills ~94% of 128-token budgets on them (counting to 200 stopped early in ~70% of samples)."""
    from tidal.data.dataset import build_prompts

    rows = [
        (i, {"prompt": f"Write a long, detailed story of at least 500 words about {TOPICS[i % len(TOPICS)]}."})
        for i in range(n)
    ]
    records, _ = build_prompts(rows, tokenizer, source="bench")
    return [r.input_ids for r in records]


def child_rollout(args) -> dict:
    """Time one `generate` of prompts x n samples after a small warm-up batch."""
    from transformers import AutoTokenizer

    from tidal.contracts import SamplingParams
    from tidal.convert import ensure_model
    from tidal.engine.llm_engine import LLMEngine
    from tidal.rollout.manager import sample_seed

    model_dir = ensure_model("smollm2")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    engine = LLMEngine(model_dir, tok, dtype="bfloat16")
    batch, params = [], []
    for g, p in enumerate(story_prompts(tok, args.prompts)):
        for j in range(args.n):
            batch.append(p)
            sp = SamplingParams(
                temperature=1.0, max_new_tokens=args.max_new, seed=sample_seed(args.seed, 0, g * args.n + j)
            )
            params.append(sp)
    engine.generate_batch([batch[0]] * 2, [SamplingParams(temperature=1.0, max_new_tokens=8, seed=s) for s in (1, 2)])
    engine.flush_cache()  # the warm-up only warms kernels: no prefix hits from it
    steps0 = engine.stats()["steps"]
    t0 = time.perf_counter()
    outs = engine.generate_batch(batch, params)
    seconds = time.perf_counter() - t0
    return {
        "n": args.n,
        "samples": len(batch),
        "max_new_tokens": args.max_new,
        "seconds": seconds,
        "generated_tokens": sum(len(o.token_ids) for o in outs),
        "full_length_fraction": sum(o.finish_reason == "length" for o in outs) / len(outs),
        "engine_steps": engine.stats()["steps"] - steps0,
    }


def grpo_overrides(args, out_dir: str) -> dict:
    """Config overrides of one GRPO point: group size n, one optimizer step per rollout step."""
    from tidal.config import load_yaml, parse_value
    from tidal.rollout.options import RolloutConfig

    extra = dict(kv.split("=", 1) for kv in args.grpo_set)
    extra = {k: parse_value(v) for k, v in extra.items()}
    prompts = {**load_yaml(QUICKSTART), **extra}.get("rollout.rollout_batch_size", RolloutConfig.rollout_batch_size)
    return {
        **extra,
        "rollout.n_samples_per_prompt": args.n,
        "train.global_batch_size": prompts * args.n,
        "train.num_steps": 2,
        "train.num_threads": args.threads,
        "train.output_dir": out_dir,
        "log.console": False,
        "log.tensorboard": False,
        "log.log_samples": 0,
    }


def child_grpo(args) -> dict:
    """Two quickstart GRPO steps at group size n; returns the second step's timings."""
    from tidal.config import build_config
    from tidal.loop import train

    with tempfile.TemporaryDirectory() as out:
        cfg = build_config(str(QUICKSTART), grpo_overrides(args, out))
        history = train(cfg)
    last = history[-1]
    keys = ("time/step", "time/rollout", "time/train", "time/sync", "actor/tokens", "response/length_mean")
    return {
        "n": args.n,
        "samples": cfg.train.global_batch_size,
        **{k.replace("/", "_"): last[k] for k in keys},
        "first_step_seconds": history[0]["time/step"],
    }


def child(args) -> None:
    """One measurement in this process; prints a JSON line."""
    torch.set_num_threads(args.threads)
    res = child_grpo(args) if args.child == "grpo_step" else child_rollout(args)
    res.update(sweep=args.child, peak_rss_mb=peak_rss_mb())
    res["loadavg_1min_after"] = os.getloadavg()[0]  # well above the thread count: something else ran
    print("RESULT " + json.dumps(res), flush=True)


def run_child(sweep: str, n: int, max_new: int, args) -> dict:
    """One point in a fresh process."""
    cmd = [sys.executable, "-m", "bench", "scaling", "--child", sweep, "--n", str(n), "--max-new", str(max_new)]
    cmd += ["--prompts", str(args.prompts), "--seed", str(args.seed), "--threads", str(args.threads)]
    cmd += ["--grpo-set", *args.grpo_set] if args.grpo_set else []
    return run_measurement(cmd, f"{sweep} n={n} max_new={max_new}")


def fit(xs: list[float], ys: list[float]) -> dict:
    """Least-squares line y = slope * x + intercept (slope 0 with fewer than two distinct xs)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys, strict=True))
    return {"slope": slope, "intercept": intercept, "r2": 1 - ss_res / ss_tot if ss_tot else 1.0}


def sweep_points(sweep: str, args) -> list[tuple[int, int]]:
    """(n, max_new_tokens) of every point of a sweep."""
    if sweep == "rollout_n":
        return [(n, args.max_new_tokens) for n in args.group_sizes]
    if sweep == "rollout_len":
        return [(args.len_group_size, m) for m in args.lengths]
    return [(n, 0) for n in args.grpo_group_sizes]


def sweep_fits(sweep: str, rows: list[dict]) -> dict:
    """The lines a sweep reports, each with what its slope means."""
    if len(rows) < 2:
        return {}
    if sweep == "rollout_n":
        f = fit([r["samples"] for r in rows], [r["seconds"] for r in rows])
        return {"seconds_per_extra_sample": {**f, "x": "samples (prompts x n)"}}
    if sweep == "rollout_len":
        f = fit([r["max_new_tokens"] for r in rows], [r["seconds"] for r in rows])
        return {"seconds_per_extra_32_tokens": {**f, "slope": 32 * f["slope"], "x": "max_new_tokens"}}
    out = {}
    for key in ("time_step", "time_rollout", "time_train"):
        f = fit([r["samples"] for r in rows], [r[key] for r in rows])
        out[f"{key}_seconds_per_extra_sample"] = {**f, "x": "samples (prompts x n)"}
    return out


def print_rows(sweep: str, rows: list[dict], fits: dict) -> None:
    print(f"\n{sweep}")
    if sweep == "grpo_step":
        print(f"{'n':>4}{'samples':>9}{'step s':>9}{'rollout s':>11}{'train s':>9}{'sync s':>8}{'resp len':>10}")
        for r in rows:
            print(
                f"{r['n']:>4}{r['samples']:>9}{r['time_step']:>9.1f}{r['time_rollout']:>11.1f}"
                f"{r['time_train']:>9.1f}{r['time_sync']:>8.2f}{r['response_length_mean']:>10.1f}"
            )
    else:
        print(
            f"{'n':>4}{'samples':>9}{'max new':>9}{'tokens':>8}{'full %':>8}{'seconds':>9}{'tok/s':>8}{'steps':>7}"
            f"{'ms/step':>9}"
        )
        for r in rows:
            print(
                f"{r['n']:>4}{r['samples']:>9}{r['max_new_tokens']:>9}{r['generated_tokens']:>8}"
                f"{100 * r['full_length_fraction']:>8.0f}{r['seconds']:>9.1f}"
                f"{r['generated_tokens'] / r['seconds']:>8.0f}{r['engine_steps']:>7}"
                f"{1000 * r['seconds'] / r['engine_steps']:>9.0f}"
            )
    for name, f in fits.items():
        print(f"  {name}: {f['slope']:.3f} s (intercept {f['intercept']:.2f} s, r2 {f['r2']:.3f}; x = {f['x']})")


def parse_args():
    p = argparse.ArgumentParser(description="rollout and GRPO step time vs group size and response length")
    p.add_argument("--sweeps", nargs="+", default=list(SWEEPS), choices=SWEEPS)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--max-new-tokens", type=int, default=64, help="of the group-size sweep")
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--len-group-size", type=int, default=4)
    p.add_argument("--grpo-group-sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--grpo-set", nargs="+", default=[], metavar="KEY=VALUE", help="extra config of grpo_step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--max-new", type=int, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    t0 = time.perf_counter()
    results = {}
    for sweep in args.sweeps:
        rows = []
        for n, max_new in sweep_points(sweep, args):
            r = run_child(sweep, n, max_new, args)
            rows.append(r)
            print(f"  {sweep} n={n} max_new={max_new}: {r['process_seconds']:.0f} s in process", flush=True)
        results[sweep] = {"rows": rows, "fits": sweep_fits(sweep, rows)}
    for sweep, res in results.items():
        print_rows(sweep, res["rows"], res["fits"])
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "n", "max_new")}
    settings.update(
        model="smollm2 (bf16 engine)",
        rollout_prompts="'Write a long, detailed story of at least 500 words about <topic>.' (chat template), temp 1",
        grpo_config=str(QUICKSTART.relative_to(QUICKSTART.parents[2])),
    )
    payload = {
        "machine": machine(),
        "settings": settings,
        **results,
        "engines_ranks_scaling": "not measured: single 2-core CPU",
        "total_seconds": time.perf_counter() - t0,
    }
    path = write_result("scaling", payload)
    print(f"wrote {path} ({payload['total_seconds']:.0f} s)")
