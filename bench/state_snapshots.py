"""Multi-turn rollouts of a hybrid model with and without state snapshots (`engine.state_snapshots`).

    python -m bench state_snapshots                       # 8 conversations x 4 turns, 2 rounds
    python -m bench state_snapshots --conversations 16 --turns 6 --rounds 3

A hybrid model's prefix-cache hit needs the recurrent states at the hit's end (docs/engine.md,
"Recurrent states"). With snapshots the engine keeps them every `state_snapshot_tokens` tokens a
sequence computes and a later turn starts from the last one its prefix reaches; without, every
turn computes the whole conversation again. The workload is an agent's: `--conversations`
chat-templated `env:arithmetic` prompts, each turn samples `--new-tokens` (temperature 1, seeded)
for every conversation at once, then appends them and a fixed `--user-tokens`-token user message
to its conversation. The model is `bench engine --model hybrid`'s random Qwen3-Next.

Each configuration runs in its own process, alternating (A B A B), after a one-turn warm-up.
The table gives the turns' wall time, the prompt tokens computed and those taken from the cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.common import machine, run_measurement, write_result


def child(args) -> None:
    from transformers import AutoTokenizer

    from bench.engine import _prompts, random_model
    from tidal.contracts import SamplingParams
    from tidal.engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    model_dir = random_model("hybrid")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    engine = LLMEngine(model_dir, tok, dtype=args.dtype, state_snapshots=args.snapshots)
    engine.generate_batch(_prompts(tok, 2, 3), [SamplingParams(max_new_tokens=8, seed=99)] * 2)  # warm-up
    engine.flush_cache()
    convs = _prompts(tok, args.conversations, 3)
    user = tok("What is the next step? Answer briefly.", add_special_tokens=False).input_ids[: args.user_tokens]
    before = engine.stats()
    t0 = time.perf_counter()
    for turn in range(args.turns):
        params = [
            SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=1000 * turn + i)
            for i in range(len(convs))
        ]
        outs = engine.generate_batch(convs, params)
        convs = [c + o.token_ids + user for c, o in zip(convs, outs, strict=True)]
    seconds = time.perf_counter() - t0
    st = engine.stats()
    res = {
        "snapshots": args.snapshots,
        "seconds": seconds,
        "prefill_tokens": st["prefill_tokens"] - before["prefill_tokens"],
        "prefix_hit_tokens": (st["prefix_hit_blocks"] - before["prefix_hit_blocks"]) * engine.cfg.block_size,
        "final_length": sum(len(c) for c in convs) / len(convs),
    }
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description="multi-turn rollouts of a hybrid model with and without state snapshots")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--user-tokens", type=int, default=12)
    p.add_argument("--snapshots", type=int, nargs="+", default=[32, 0], help="engine.state_snapshots to compare")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.snapshots = args.snapshots[0]
        return child(args)
    from bench.engine import random_model
    from tidal.hardware import resolve_dtype

    args.dtype = resolve_dtype(args.dtype, "bench state_snapshots --dtype").dtype
    random_model("hybrid")  # built here once
    rows = []
    for rnd in range(args.rounds):
        for n in args.snapshots:
            cmd = [sys.executable, "-m", "bench", "state_snapshots", "--child", "--snapshots", str(n)]
            for k in ("conversations", "turns", "new_tokens", "user_tokens", "threads", "dtype"):
                cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            r = run_measurement(cmd, f"snapshots {n}")
            r["round"] = rnd
            rows.append(r)
            print(
                f"  snapshots {n:<3} round {rnd}: {r['seconds']:6.1f} s  {r['prefill_tokens']} prompt tokens computed"
            )
    print(f"\n{'snapshots':>9}{'round':>6}{'turns s':>9}{'computed':>10}{'from cache':>12}{'final length':>14}")
    for r in rows:
        print(
            f"{r['snapshots']:>9}{r['round']:>6}{r['seconds']:>9.1f}{r['prefill_tokens']:>10}"
            f"{r['prefix_hit_tokens']:>12}{r['final_length']:>14.0f}"
        )
    a, b = args.snapshots[0], args.snapshots[-1]
    pairs = [
        x["seconds"] / y["seconds"]
        for x, y in zip([r for r in rows if r["snapshots"] == a], [r for r in rows if r["snapshots"] == b], strict=True)
    ]
    if a != b:
        print(f"time with {a} / with {b} snapshots, pair by pair: " + ", ".join(f"{x:.2f}" for x in pairs))
    path = write_result(
        f"state_snapshots-{args.dtype}",
        {"machine": machine(), "settings": vars(args), "rows": rows, "time_ratios": pairs},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
