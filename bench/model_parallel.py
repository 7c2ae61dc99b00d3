"""Trainer ranks with and without tensor parallelism: per-rank peak memory and step time.

    python -m bench tensor_parallel                 # 2 ranks: FSDP2 alone, then TP 2
    python -m bench tensor_parallel --rounds 3 --tp 1 2

Two trainer ranks (`tidal.cluster.trainers.TrainerRank` over gloo, each in its own process, as on
Ray) train a random Llama of SmolLM2's size with a tensor-parallel-friendly head count
(`MODEL`: 30 layers, width 576, 8 query / 4 KV heads of 72, MLP 1536, vocabulary 49,152; SmolLM2's
9 heads do not split in two) for `--steps` GRPO steps of 16 samples (4 prompts x 4, 96-token
prompts, 64-token responses, packed, fp32, AdamW, a KL term against the reference), after one
warm-up step. `--tp 1`: FSDP2 over both ranks (each holds half of every tensor and takes half the
samples); `--tp 2`: both ranks split each layer and the output projection (each holds half of
every split matrix and computes every sample). Layouts alternate, each run in fresh processes.
Reported per layout: the median step time and each rank's peak RSS (the parameters, gradients,
AdamW moments and reference it holds, plus activations).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import socket
import sys
import tempfile
import time

import torch

from bench.common import machine, run_measurement, write_result

MODEL = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=72,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def _samples():
    from tidal.types import Sample

    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(16):
        if i % 4 == 0:
            prompt = torch.randint(3, 49152, (96,), generator=gen).tolist()
        resp = torch.randint(3, 49152, (64,), generator=gen).tolist()
        out.append(Sample(tokens=prompt + resp, response_length=64, loss_mask=[1] * 64, rollout_log_probs=[-1.0] * 64))
    return out


def _rank(rank: int, world: int, port: int, model_dir: str, tp: int, steps: int, out: str) -> None:
    from tidal.algo.options import AlgoConfig
    from tidal.cluster.trainers import TrainerRank
    from tidal.train.options import TrainConfig

    train = TrainConfig(global_batch_size=16, micro_batch_size=8, packing=True, dtype="float32", lr=1e-6)
    tr = TrainerRank(
        rank,
        world,
        f"tcp://127.0.0.1:{port}",
        train,
        AlgoConfig(kl_coef=0.01),
        model_dir,
        model_dir,
        1.0,
        0,
        64,
        1,
        600,
        tp_size=tp,
    )
    samples = _samples()
    adv = torch.linspace(-1, 1, 16)
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        tr.train_sums(samples, adv, None, None)
        torch.distributed.barrier()
        if step:  # the first is the warm-up
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"times": times, "peak_rss_mb": peak}, f)
    tr.close()


def child(args) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp()
    mp.spawn(_rank, args=(2, port, args.model_dir, args.child_tp, args.steps, out), nprocs=2, join=True)
    ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
    times = sorted(t for r in ranks[:1] for t in r["times"])
    res = {"tp": args.child_tp, "step_s": times[len(times) // 2], "peak_rss_mb": [r["peak_rss_mb"] for r in ranks]}
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description="trainer ranks with and without tensor parallelism")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tp_size of the 2 ranks (1: FSDP2 alone)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child-tp", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_tp:
        return child(args)
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tempfile.mkdtemp(prefix="tidal-bench-tp-")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(model_dir)
    try:
        rows = measure(args, model_dir)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)  # 0.5 GB of random weights
    print(f"\n{'tp':>3}{'round':>6}{'step s':>8}{'rank 0 MB':>11}{'rank 1 MB':>11}")
    for r in rows:
        mb = r["peak_rss_mb"]
        print(f"{r['tp']:>3}{r['round']:>6}{r['step_s']:>8.2f}{mb[0]:>11,.0f}{mb[1]:>11,.0f}")
    path = write_result("tensor_parallel", {"machine": machine(), "settings": vars(args), "model": MODEL, "rows": rows})
    print(f"wrote {path}")


def measure(args, model_dir: str) -> list[dict]:
    """Each layout of `args.tp` in fresh processes, alternating, `args.rounds` times."""
    rows = []
    for rnd in range(args.rounds):
        for tp in args.tp:
            cmd = [sys.executable, "-m", "bench", "tensor_parallel", "--child-tp", str(tp), "--model-dir", model_dir]
            r = run_measurement([*cmd, "--steps", str(args.steps)], f"tp {tp}")
            r["round"] = rnd
            rows.append(r)
            peaks = ", ".join(f"{m:,.0f}" for m in r["peak_rss_mb"])
            print(f"  tp {tp} round {rnd}: step {r['step_s']:.2f} s, peak RSS per rank {peaks} MB", flush=True)
    return rows


if __name__ == "__main__":
    main()
