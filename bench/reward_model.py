"""Reward-model scoring throughput (`reward.fn: rm`): samples per second at batch 1 vs batch 16.

    python -m bench reward_model                  # 64 samples, batch sizes 1 and 16, fp32, 2 threads
    python -m bench reward_model --hidden 512 --layers 8 --samples 128 --dtype bfloat16

Workload: a random Llama sequence-classification model (one label) of `--hidden` / `--layers`
with the byte-level tokenizer of the tests (one token per byte, ChatML template), saved to a
temporary folder and loaded as a run loads it (`tidal.reward.reward_model.RewardModel`). The
samples are chat prompts and responses of 40 to 400 bytes (seeded), scored as the rollout scores
them: every sample's reward awaited concurrently through `score_samples`, so the reward model's
batcher forms the batches. One warm-up pass (loads the model), then `--repeats` measured passes;
the median pass gives samples/s. Random weights: the time of a forward does not depend on them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time

from bench.common import machine, machine_kind, write_result


def build_model(path: str, hidden: int, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tests.conftest import make_tokenizer  # the tests' byte tokenizer: nothing to download

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=2048,
        num_labels=1,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
    )
    LlamaForSequenceClassification(config).save_pretrained(path)
    make_tokenizer().save_pretrained(path)


def make_samples(n: int, seed: int = 0) -> list:
    from tidal.reward.reward_model import MESSAGES_KEY
    from tidal.types import Sample

    rng = random.Random(seed)
    words = "the a reward model scores each sample of the rollout step by step with one forward".split()

    def text(lo: int, hi: int) -> str:
        out = ""
        target = rng.randrange(lo, hi)
        while len(out) < target:
            out += rng.choice(words) + " "
        return out

    return [
        Sample(response=text(20, 300), index=i, metadata={MESSAGES_KEY: [{"role": "user", "content": text(20, 100)}]})
        for i in range(n)
    ]


def measure(path: str, batch_size: int, args) -> dict:
    from tidal.reward.options import RewardModelConfig
    from tidal.reward.reward_model import RewardModel
    from tidal.reward.score import score_samples

    rm = RewardModel(RewardModelConfig(path=path, device="cpu", dtype=args.dtype, batch_size=batch_size))
    times = []
    for i in range(args.repeats + 1):
        samples = make_samples(args.samples)
        t0 = time.perf_counter()
        failed = asyncio.run(score_samples(samples, rm))
        if failed:
            raise RuntimeError(f"{failed} samples failed: {samples[0].metadata.get('error')}")
        if i:  # the first pass loads the model
            times.append(time.perf_counter() - t0)
    tokens = sum(len(rm.encode(s)) for s in make_samples(args.samples))
    seconds = statistics.median(times)
    return {
        "batch_size": batch_size,
        "seconds": seconds,
        "samples_per_s": args.samples / seconds,
        "tokens_per_s": tokens / seconds,
        "forwards_per_pass": rm.forwards // (args.repeats + 1),
        "tokens": tokens,
    }


def main() -> None:
    import torch

    p = argparse.ArgumentParser(prog="python -m bench reward_model")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-rm-") as path:
        build_model(path, args.hidden, args.layers)
        for b in (int(x) for x in args.batch_sizes.split(",")):
            rows.append(measure(path, b, args))
    print(
        f"reward model: hidden {args.hidden}, {args.layers} layers, {args.dtype}, cpu ({machine_kind()}), "
        f"{args.threads} threads, {args.samples} samples"
    )
    print(f"{'batch':>6} {'forwards':>9} {'seconds':>8} {'samples/s':>10} {'tokens/s':>10}")
    for r in rows:
        print(
            f"{r['batch_size']:>6} {r['forwards_per_pass']:>9} {r['seconds']:>8.3f} "
            f"{r['samples_per_s']:>10.1f} {r['tokens_per_s']:>10.0f}"
        )
    settings = {k: getattr(args, k) for k in ("samples", "hidden", "layers", "dtype", "threads", "repeats")}
    path = write_result(
        f"reward_model-h{args.hidden}x{args.layers}-{args.dtype}",
        {"machine": machine(), "settings": settings, "rows": rows},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
