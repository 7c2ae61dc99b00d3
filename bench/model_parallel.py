"""Trainer ranks with and without tensor or context parallelism: per-rank peak memory and step time.

    python -m bench model_parallel                                  # 2 ranks: FSDP2 alone, then TP 2
    python -m bench model_parallel --layouts fsdp cp2 --prompt 1024 --response 512 --samples 4

Two trainer ranks (`tidal.cluster.trainers.TrainerRank` over gloo, each in its own process, as on
Ray) train a random Llama of SmolLM2's size with a tensor-parallel-friendly head count
(`MODEL`: 30 layers, width 576, 8 query / 4 KV heads of 72, MLP 1536, vocabulary 49,152; SmolLM2's
9 heads do not split in two) for `--steps` GRPO steps of `--samples` samples (groups of 4 sharing
a `--prompt`-token prompt, `--response`-token responses, packed, fp32, AdamW, a KL term against
the reference; micro-batches of 8 samples, or 1 when `--samples` is 4), after one warm-up step.
Layouts: `fsdp`: FSDP2 over both ranks (each holds half of every tensor and takes half the
samples); `tp2`: both ranks split each layer and the output projection (each holds half of every
split matrix and computes every sample); `cp2`: both ranks split each micro-batch's tokens (each
computes half of every row's tokens; FSDP2 shards the weights over both). Layouts alternate, each
run in fresh processes. Reported per layout: the median step time and each rank's peak RSS (the
parameters, gradients, AdamW moments and reference it holds, plus activations).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
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


LAYOUTS = {"fsdp": {}, "tp2": {"tp_size": 2}, "cp2": {"cp_size": 2}}


def _samples(n: int, prompt: int, response: int):
    from tidal.types import Sample

    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        if i % 4 == 0:
            tokens = torch.randint(3, 49152, (prompt,), generator=gen).tolist()
        resp = torch.randint(3, 49152, (response,), generator=gen).tolist()
        mask, logp = [1] * response, [-1.0] * response
        out.append(Sample(tokens=tokens + resp, response_length=response, loss_mask=mask, rollout_log_probs=logp))
    return out


def _rank(rank: int, world: int, port: int, model_dir: str, layout: str, args: dict, out: str) -> None:
    from tidal.algo.options import AlgoConfig
    from tidal.cluster.trainers import TrainerRank
    from tidal.train.options import TrainConfig

    n = args["samples"]
    micro = 1 if n <= 4 else 8
    train = TrainConfig(global_batch_size=n, micro_batch_size=micro, packing=True, dtype="float32", lr=1e-6)
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
        args["response"],
        1,
        600,
        **LAYOUTS[layout],
    )
    samples = _samples(n, args["prompt"], args["response"])
    adv = torch.linspace(-1, 1, n)
    times = []
    for step in range(args["steps"] + 1):
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

    from tidal.net import host_store

    store = host_store("127.0.0.1", 600)  # the ranks meet here, as at the store `TrainerGroup` serves
    port = store.port
    out = tempfile.mktemp()
    work = {k: getattr(args, k) for k in ("samples", "prompt", "response", "steps")}
    mp.spawn(_rank, args=(2, port, args.model_dir, args.child, work, out), nprocs=2, join=True)
    ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
    times = sorted(t for r in ranks[:1] for t in r["times"])
    res = {"layout": args.child, "step_s": times[len(times) // 2], "peak_rss_mb": [r["peak_rss_mb"] for r in ranks]}
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description="trainer ranks with and without tensor or context parallelism")
    p.add_argument("--layouts", nargs="+", default=["fsdp", "tp2"], choices=list(LAYOUTS), help="of the 2 ranks")
    p.add_argument("--samples", type=int, default=16, help="a step's samples (groups of 4)")
    p.add_argument("--prompt", type=int, default=96, help="prompt tokens")
    p.add_argument("--response", type=int, default=64, help="response tokens")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tempfile.mkdtemp(prefix="tidal-bench-parallel-")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**MODEL, "max_position_embeddings": args.prompt + args.response})).save_pretrained(
        model_dir
    )
    try:
        rows = measure(args, model_dir)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)  # 0.5 GB of random weights
    print(f"\n{'layout':>7}{'round':>6}{'step s':>8}{'rank 0 MB':>11}{'rank 1 MB':>11}")
    for r in rows:
        mb = r["peak_rss_mb"]
        print(f"{r['layout']:>7}{r['round']:>6}{r['step_s']:>8.2f}{mb[0]:>11,.0f}{mb[1]:>11,.0f}")
    name = "model_parallel-" + "-".join(args.layouts)
    path = write_result(name, {"machine": machine(), "settings": vars(args), "model": MODEL, "rows": rows})
    print(f"wrote {path}")


def measure(args, model_dir: str) -> list[dict]:
    """Each of `args.layouts` in fresh processes, alternating, `args.rounds` times."""
    rows = []
    work = [f"--{k}={getattr(args, k)}" for k in ("samples", "prompt", "response", "steps")]
    for rnd in range(args.rounds):
        for layout in args.layouts:
            cmd = [sys.executable, "-m", "bench", "model_parallel", "--child", layout, "--model-dir", model_dir]
            r = run_measurement([*cmd, *work], layout)
            r["round"] = rnd
            rows.append(r)
            peaks = ", ".join(f"{m:,.0f}" for m in r["peak_rss_mb"])
            print(f"  {layout} round {rnd}: step {r['step_s']:.2f} s, peak RSS per rank {peaks} MB", flush=True)
    return rows


if __name__ == "__main__":
    main()
