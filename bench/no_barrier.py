"""Does a slow sample hold the others up? Per-request rollout against a round barrier.

    python -m bench no_barrier                      # SmolLM2, 16 samples x 48 tokens, 3 pairs
    python -m bench no_barrier --sleep 2 --pairs 3

A rollout of 16 single-turn samples (`env:arithmetic` prompts, temperature 1) on tidal's engine
through `RolloutManager`, with and without a 17th sample whose generate function samples, sleeps
`--sleep` seconds (a slow tool), and samples again. Measured: the time until the 16 single-turn
samples are done, and until the whole rollout is. Runs alternate (with, without) in one process
after a warm-up. With requests per sample, the 16 finish as fast as without the sleeper; under
a round barrier, where every request waits until every sample is waiting on the engine, they
would have had to wait for it (only the sleeper's own second call waits for its sleep here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from bench.common import machine, write_result

SLEEP_S = 2.0


async def sleeper(ctx, sample, sampling):
    """Sample, wait on a slow tool, sample again (the first answer is the response)."""
    out = await ctx.generate(sample.tokens, sampling)
    await asyncio.sleep(ctx.extra.get("sleep_s", SLEEP_S))
    await ctx.generate(sample.tokens, sampling)
    sample.append_policy(out.token_ids, out.log_probs, out.weight_version, out.text)
    return sample


def run(args) -> dict:
    import torch

    from tidal.config import RolloutConfig
    from tidal.convert import ensure_model, load_tokenizer
    from tidal.data.dataset import build_prompts
    from tidal.data.envs import make_env_rows
    from tidal.engine.async_engine import AsyncEngine
    from tidal.engine.llm_engine import LLMEngine
    from tidal.hardware import resolve_dtype
    from tidal.rollout.manager import RolloutManager

    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, "--dtype").dtype
    model_dir = ensure_model("smollm2")
    tok = load_tokenizer(model_dir)
    rows = make_env_rows("arithmetic", level=1, n=17, seed=7)
    records, _ = build_prompts(rows, tok, source="bench")
    records[16].metadata["generate"] = "bench.no_barrier:sleeper"
    cfg = RolloutConfig(
        n_samples_per_prompt=1, max_new_tokens=args.max_new_tokens, temperature=1.0, reward="math", reward_workers=0
    )
    engine = AsyncEngine(LLMEngine(model_dir, tok, dtype=dtype, kv_cache_tokens=16384))
    manager = RolloutManager(engine, cfg, tok)
    manager.extra["sleep_s"] = args.sleep
    single = manager.generate_fn
    done_at: list[float] = []

    async def timed(ctx, sample, sampling):
        s = await single(ctx, sample, sampling)
        done_at.append(time.perf_counter())
        return s

    manager.generate_fn = timed

    def once(with_sleeper: bool, step: int) -> dict:
        done_at.clear()
        t0 = time.perf_counter()
        samples = manager.generate(records if with_sleeper else records[:16], step=step)
        end = time.perf_counter()
        return {
            "with_sleeper": with_sleeper,
            "sixteen_done_s": max(done_at) - t0,
            "rollout_s": end - t0,
            "tokens": sum(s.response_length for s in samples[:16]),
        }

    try:
        once(False, 0)  # warm-up
        runs = []
        for pair in range(args.pairs):
            for with_sleeper in (True, False):
                runs.append(once(with_sleeper, 1 + pair))  # same seeds for both runs of a pair
    finally:
        manager.close()
        engine.close()
    return {"dtype": dtype, "threads": args.threads, "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench no_barrier")
    p.add_argument("--sleep", type=float, default=SLEEP_S, help="the slow sample's tool time, seconds")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    result = run(args)
    rows = []
    for flag in (False, True):
        runs = [r for r in result["runs"] if r["with_sleeper"] == flag]
        rows.append(
            {
                "rollout": "16 single-turn + 1 sleeping 2 s" if flag else "16 single-turn",
                "sixteen_done_s": statistics.median(r["sixteen_done_s"] for r in runs),
                "rollout_s": statistics.median(r["rollout_s"] for r in runs),
                "all": [round(r["sixteen_done_s"], 2) for r in runs],
            }
        )
    info = machine()
    print(f"{info['cpu_capability']}, {result['dtype']}, {result['threads']} threads, sleep {args.sleep:g} s")
    print(f"{'rollout':<34} {'16 done (median s)':>20} {'whole rollout (s)':>18}  16 done, each run")
    for r in rows:
        print(f"{r['rollout']:<34} {r['sixteen_done_s']:>20.2f} {r['rollout_s']:>18.2f}  {r['all']}")
    path = write_result("no_barrier", {"machine": info, "args": vars(args), **result, "table": rows})
    print(json.dumps({"written": str(path)}))


if __name__ == "__main__":
    main()
