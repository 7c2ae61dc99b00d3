"""Where a training step's time goes: `Actor.train_step` under the PyTorch profiler.

    python -m bench profile_train                      # the quickstart-shaped batch, train.dtype bfloat16
    python -m bench profile_train --dtype autocast --top 25

One optimizer step over `--samples` synthetic samples shaped like the quickstart's (prompt 45-60,
response 10-48 tokens), micro-batches of 8, packed, GRPO loss, SmolLM2-135M-Instruct. After
`--warmup` unprofiled steps, one step is timed by phase (forward = the micro-batches' `_score`
calls, optimizer = clip + AdamW + copy sync, backward = the rest) and one step is profiled; the
table lists the ops with the most self CPU time and the share of a few groups (matmuls, attention
kernels, the rest). Writes `bench/results/profile_train.json`.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import machine, peak_rss_mb, write_result
from bench.train_throughput import synthetic_samples

GROUPS = {
    "matmul": ("aten::mm", "aten::bmm", "aten::addmm"),
    "attention": (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    ),
    "copies and casts": ("aten::copy_", "aten::_to_copy", "aten::index_select", "aten::index_add_"),
    "vocabulary softmax": ("aten::_log_softmax", "aten::_log_softmax_backward_data"),
    "AdamW": ("aten::_fused_adamw_",),  # the optimizer phase also holds grad clipping and the copy sync
}


def timed_phases(actor, samples, adv) -> dict[str, float]:
    """Seconds of one train step split into forward, backward and optimizer."""
    spent = {"forward": 0.0, "optimizer": 0.0}
    score, step = actor._score, actor.optimizer.step

    def timed_score(*a, **kw):
        t = time.perf_counter()
        out = score(*a, **kw)
        spent["forward"] += time.perf_counter() - t
        return out

    def timed_step(*a, **kw):
        t = time.perf_counter()
        out = step(*a, **kw)
        spent["optimizer"] += time.perf_counter() - t
        return out

    actor._score, actor.optimizer.step = timed_score, timed_step
    t0 = time.perf_counter()
    actor.train_step(samples, adv)
    total = time.perf_counter() - t0
    actor._score, actor.optimizer.step = score, step
    return {**spent, "backward_and_loss": total - spent["forward"] - spent["optimizer"], "total": total}


def main() -> None:
    p = argparse.ArgumentParser(description="profile one tidal train step (SmolLM2, quickstart-shaped batch)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "autocast", "float32"))
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--group", type=int, default=4, help="samples per prompt (a GRPO group shares its prompt)")
    p.add_argument("--no-share-prompts", dest="share_prompts", action="store_false")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    from tidal.algo.options import AlgoConfig
    from tidal.convert import ensure_model
    from tidal.train.actor import Actor
    from tidal.train.options import TrainConfig

    torch.set_num_threads(args.threads)
    cfg = TrainConfig(
        global_batch_size=args.samples, micro_batch_size=8, lr=1e-6, dtype=args.dtype, share_prompts=args.share_prompts
    )
    actor = Actor(ensure_model("smollm2"), cfg, AlgoConfig(), pad_id=2)
    samples = synthetic_samples(args.samples, (45, 60), (10, 48), 0, actor.model.config.vocab_size, args.group)
    adv = torch.randn(args.samples, generator=torch.Generator().manual_seed(0))
    for _ in range(args.warmup):
        actor.train_step(samples, adv)
    phases = timed_phases(actor, samples, adv)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        actor.train_step(samples, adv)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    ops = sorted(
        ({"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in events),
        key=lambda o: -o["self_s"],
    )
    groups = {g: sum(o["self_s"] for o in ops if o["op"] in names) for g, names in GROUPS.items()}
    groups["everything else"] = total / 1e6 - sum(groups.values())

    tokens = sum(len(s.tokens) for s in samples)
    print(f"\none train step, {args.samples} samples, {tokens} tokens, train.dtype {args.dtype} -> {actor.dtype}")
    print("phase             seconds")
    for k, v in phases.items():
        print(f"{k:<18}{v:>7.2f}")
    print(f"\n{'group':<22}{'self s':>8}{'share':>8}")
    for g, v in groups.items():
        print(f"{g:<22}{v:>8.2f}{100 * v / (total / 1e6):>7.1f}%")
    print(f"\n{'op':<58}{'self s':>8}{'share':>8}{'calls':>7}")
    for o in ops[: args.top]:
        print(f"{o['op'][:57]:<58}{o['self_s']:>8.2f}{100 * o['self_s'] / (total / 1e6):>7.1f}%{o['calls']:>7}")
    payload = {
        "machine": machine(),
        "train_dtype": actor.dtype,
        "settings": {**vars(args), "tokens": tokens, "model": "smollm2", "micro_batch_size": 8, "packing": True},
        "phases_s": phases,
        "profiled_self_cpu_s": total / 1e6,
        "groups_s": groups,
        "top_ops": ops[: args.top],
        "peak_rss_mb": peak_rss_mb(),
    }
    print(f"wrote {write_result('profile_train', payload)}")


if __name__ == "__main__":
    main()
