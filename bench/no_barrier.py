"""Does a slow sample hold the others up? Per-request rollout against a round barrier.

    python -m bench no_barrier                      # SmolLM2, 16 samples x 48 tokens, 3 pairs
    python -m bench no_barrier --sleep 2 --pairs 3

A rollout of 16 single-turn samples (`env:arithmetic` prompts, temperature 1) on tidal's engine
through `RolloutManager`, beside a 17th sample whose generate function samples, waits (a slow
tool) and samples again: `--sleep` seconds in one arm, 0 in the other, so both arms do the same
engine work and differ only by the wait. Measured: the time until the 16 single-turn samples are
done, and until the whole rollout is. The arms alternate in one process after a warm-up, with the
same seeds within a pair. With requests per sample, the 16 finish as fast with the wait as
without; under a round barrier, where every request waits until every sample is waiting on the
engine, they would have had to wait for it.
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

    from tidal.adapters.async_engine import AsyncEngine
    from tidal.convert import ensure_model, load_tokenizer
    from tidal.data.dataset import build_prompts
    from tidal.data.envs import make_env_rows
    from tidal.engine.llm_engine import LLMEngine
    from tidal.hardware import resolve_dtype
    from tidal.rollout.manager import RolloutManager
    from tidal.rollout.options import RolloutConfig

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
    single = manager.generate_fn
    done_at: list[float] = []

    async def timed(ctx, sample, sampling):
        s = await single(ctx, sample, sampling)
        done_at.append(time.perf_counter())
        return s

    manager.generate_fn = timed

    def once(with_sleeper: bool, step: int) -> dict:
        done_at.clear()
        manager.extra["sleep_s"] = args.sleep if with_sleeper else 0.0
        t0 = time.perf_counter()
        samples = manager.generate(records, step=step)
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
                "rollout": f"16 single-turn + 1 waiting {args.sleep:g} s" if flag else "16 single-turn + 1 not waiting",
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
    pairs = list(zip(result["runs"][0::2], result["runs"][1::2], strict=True))
    ratios = [round(w["sixteen_done_s"] / n["sixteen_done_s"], 3) for w, n in pairs]
    print(f"16 done, waiting / not waiting, pair by pair: {ratios}")
    rows.append({"ratios": ratios})
    path = write_result("no_barrier", {"machine": info, "args": vars(args), **result, "table": rows})
    print(json.dumps({"written": str(path)}))


if __name__ == "__main__":
    main()
