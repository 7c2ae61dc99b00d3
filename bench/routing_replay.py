"""The train/rollout log-prob gap on an MoE model, with and without routing replay.

    python -m bench routing_replay                    # fp32 and bf16 engines, 16 prompts x 4
    python -m bench routing_replay --engine-dtypes bfloat16 --prompts 8

A random Qwen3-MoE (no MoE checkpoint is downloadable here; `--layers`, `--experts`, `--top-k`,
transformers' default init, so its routers see near-ties as a trained model's do at some tokens)
samples responses in tidal's engine, recording the experts it chose. The trainer (fp32, packed)
then scores the same tokens twice: routing freely, and replaying the engine's routing
(`algo.routing_replay`). The table gives, per engine dtype, the mean and max |trainer log-prob -
engine log-prob| over the response tokens, and how often the trainer's free choice of experts
differs from the engine's (per token and MoE layer). With an fp32 engine both paths compute the
same numbers up to summation order; a bf16 engine (as GPU rollouts run) rounds the router's
input, flips near-tied choices, and replay removes the part of the gap those flips cause.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import machine, write_result


def _model(args):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=args.hidden // 8,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
    )
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(cfg).float().eval()


def _samples(model, args, dtype: str):
    from tidal.contracts import SamplingParams
    from tidal.engine.llm_engine import LLMEngine
    from tidal.moe import routing_record
    from tidal.types import Sample

    engine = LLMEngine(model, None, dtype=dtype, kv_cache_tokens=16384)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, args.vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.prompts)]
    batch = [p for p in prompts for _ in range(args.samples)]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=i, return_routed_experts=True)
        for i in range(len(batch))
    ]
    t0 = time.perf_counter()
    outs = engine.generate_batch(batch, params)
    seconds = time.perf_counter() - t0
    samples = []
    for i, (p, o) in enumerate(zip(batch, outs, strict=True)):
        s = Sample(
            tokens=p + o.token_ids,
            response_length=len(o.token_ids),
            loss_mask=[1] * len(o.token_ids),
            rollout_log_probs=list(o.log_probs),
            group_index=i // args.samples,
            index=i,
        )
        s.set_routed_experts(routing_record(o.routed_experts))
        samples.append(s)
    return samples, seconds


def _gaps(actor, samples) -> tuple[float, float]:
    lp = actor.compute_log_probs(samples)
    diffs = torch.cat(
        [(lp[i, : s.response_length] - torch.tensor(s.rollout_log_probs)).abs() for i, s in enumerate(samples)]
    )
    return float(diffs.mean()), float(diffs.max())


def _flips(model, samples) -> float:
    """The share of (position, MoE layer) whose expert set the trainer's free forward picks
    differently from the engine's record."""
    from tidal.moe import capture, routing_tensor

    differ = total = 0
    with torch.no_grad():
        for s in samples:
            with capture(model) as rec:
                model(torch.tensor([s.tokens[:-1]]))
            mine = rec.take().sort(-1).values
            theirs = routing_tensor(s.routed_experts).sort(-1).values
            differ += int((mine != theirs).any(-1).sum())
            total += mine.shape[0] * mine.shape[1]
    return differ / total


def main() -> None:
    p = argparse.ArgumentParser(description="train/rollout log-prob gap on an MoE model, with and without replay")
    p.add_argument("--engine-dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from tidal.algo.options import AlgoConfig
    from tidal.train.actor import Actor
    from tidal.train.options import TrainConfig

    cfg = TrainConfig(micro_batch_size=8, global_batch_size=8, dtype="float32")
    rows = []
    for dtype in args.engine_dtypes:
        samples, seconds = _samples(_model(args), args, dtype)
        row = {"engine_dtype": dtype, "tokens": sum(s.response_length for s in samples), "rollout_s": seconds}
        for replay in (False, True):
            actor = Actor(_model(args), cfg, AlgoConfig(routing_replay=replay), temperature=1.0)
            mean, worst = _gaps(actor, samples)
            row[f"{'replay' if replay else 'free'}_mean"] = mean
            row[f"{'replay' if replay else 'free'}_max"] = worst
        row["routing_differs"] = _flips(_model(args), samples)
        rows.append(row)
        print(f"  engine {dtype}: done ({row['tokens']} tokens)", flush=True)

    cap = torch.backends.cpu.get_cpu_capability()
    print(f"\nQwen3-MoE random, {args.layers} layers, {args.experts} experts top-{args.top_k}; trainer fp32; CPU {cap}")
    head = ("engine", "tokens", "routing differs", "free mean", "free max", "replay mean", "replay max")
    print(f"{head[0]:<10}{head[1]:>8}{head[2]:>17}{head[3]:>12}{head[4]:>10}{head[5]:>13}{head[6]:>12}")
    for r in rows:
        print(
            f"{r['engine_dtype']:<10}{r['tokens']:>8}{r['routing_differs']:>16.2%} {r['free_mean']:>11.2e}"
            f"{r['free_max']:>10.2e}{r['replay_mean']:>13.2e}{r['replay_max']:>12.2e}"
        )
    path = write_result("routing_replay", {"machine": machine(), "settings": vars(args), "rows": rows})
    print(f"wrote {path}")
