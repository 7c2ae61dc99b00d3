"""The host's part of an overlapped decode step: what the GPU waits for when the host is slower.

    python -m bench host_step                       # cpu, 64 and 512 sequences
    python -m bench host_step --seqs 512 --rounds 7

On a GPU a pure decode step is a CUDA graph replay plus the sampler's kernels, and the engine
launches the next step before it reads the last (`LLMEngine.step`): the GPU is busy as long as
the host's bookkeeping of a step (reading the tokens back, appending them, stop checks, the next
step's block tables, positions and sampling inputs) takes less than the GPU's step. At SmolLM2's
size and 512 sequences the GPU's step is about 4 ms (an H100), so every 0.1 ms of host time per
step is ~2% of the busy share.

This runs the engine's overlapped decode path over its static buffers (`DecodeGraphs` without
capture, as on a GPU whose graphs failed) with the model's forward replaced by a fixed logits
tensor, so a step is the host's work alone: the scheduler's and the engine's per-sequence Python,
the buffers' fill, and the sampler's draw over a small vocabulary (`--vocab`; on a GPU the draw
is a few kernels over the real one). Every sequence decodes through `--rounds` x `--steps` steps
without finishing; each round's wall time over its steps is one figure, and the median is
printed. The split (fill, sample, chain, complete) comes from one more round with each part timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from bench.common import machine, machine_kind, write_result


def build_engine(seqs: int, steps: int, vocab: int, device: str):
    """An engine over a one-layer Llama with `seqs` sequences decoding on the static-buffer path,
    its forward replaced by a fixed logits tensor (returned beside it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tidal.contracts import SamplingParams
    from tidal.engine.llm_engine import LLMEngine
    from tidal.hardware import is_cuda

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=steps + 64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    tokens = seqs * (steps + 32)
    engine = LLMEngine(
        model,
        None,
        dtype="float32",
        block_size=16,
        kv_cache_tokens=tokens,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(2048, seqs * 8),
        device=device,
        cuda_graphs=False,
    )
    if not is_cuda(engine.device):  # a GPU's engine has its static buffers from the start
        why = engine.runner.use_static_decode(seqs, engine.max_model_len, capture=False)
        if why:
            raise SystemExit(f"bench host_step: no static decode path: {why}")
    for i in range(seqs):  # groups of 8 sharing a prompt, every row seeded, as a rollout runs
        params = SamplingParams(temperature=1.0, max_new_tokens=steps + 16, seed=1000 + i, ignore_eos=True)
        engine.add_request(None, [1 + (i // 8) % 50, 5, 9, 12, 40 + i % 8], params)
    for _ in range(4):  # prefill, the decode path's check, the first static step
        engine.step()
    logits = torch.zeros(seqs, vocab, device=engine.device)
    engine.runner.graphs.forward = lambda plan: logits[: plan.input_ids.shape[0]]
    for _ in range(3):
        engine.step()
    if engine._launched is None:
        raise SystemExit("bench host_step: the engine's steps do not overlap")
    return engine


def timed_split(engine, steps: int) -> dict[str, float]:
    """Milliseconds a step in each part, over `steps` steps with each part wrapped in a timer."""
    spent: dict[str, float] = defaultdict(float)

    def wrap(obj, name, key):
        inner = getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t

        setattr(obj, name, timed)
        return inner

    originals = [
        (engine.runner.graphs, "fill", wrap(engine.runner.graphs, "fill", "fill")),
        (engine, "_sample", wrap(engine, "_sample", "sample")),
        (engine, "_chain", wrap(engine, "_chain", "chain")),
        (engine, "_complete", wrap(engine, "_complete", "complete")),
    ]
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - t0
    for obj, name, inner in originals:
        setattr(obj, name, inner)
    out = {k: v / steps * 1e3 for k, v in spent.items()}
    # `chain` holds `fill` and `sample`: its own part is what is left
    out["chain_own"] = out.pop("chain") - out["fill"] - out["sample"]
    out["other"] = total / steps * 1e3 - sum(out.values())
    return out


def measure(seqs: int, args) -> dict:
    engine = build_engine(seqs, args.steps * (args.rounds + 1), args.vocab, args.device)
    per_round, cpu_round = [], []
    for _ in range(args.rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            engine.step()
        per_round.append((time.perf_counter() - t0) / args.steps * 1e3)
        cpu_round.append((time.process_time() - c0) / args.steps * 1e3)
    split = timed_split(engine, args.steps)
    return {
        "seqs": seqs,
        "ms_per_step": per_round,
        "median_ms": statistics.median(per_round),
        # the process's CPU time: a shared machine's stolen time does not count in it
        "cpu_ms_per_step": cpu_round,
        "median_cpu_ms": statistics.median(cpu_round),
        "split_ms": split,
        "overlapped_steps": engine.stats()["overlapped_steps"],
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench host_step", description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[64, 512])
    p.add_argument("--steps", type=int, default=100, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--vocab", type=int, default=320, help="the logits' width: the sampler's work on a CPU")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the host's work is one thread)")
    p.add_argument("--tag", default="", help="a suffix for the result file")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    rows = [measure(n, args) for n in args.seqs]
    print(f"host's part of an overlapped decode step, {args.device}, vocabulary {args.vocab}, forward stubbed")
    print(f"{'seqs':>6}{'median ms':>11}{'cpu ms':>8}{'fill':>8}{'sample':>8}{'chain':>8}{'complete':>10}{'other':>8}")
    for r in rows:
        s = r["split_ms"]
        print(
            f"{r['seqs']:>6}{r['median_ms']:>11.3f}{r['median_cpu_ms']:>8.3f}{s['fill']:>8.3f}{s['sample']:>8.3f}{s['chain_own']:>8.3f}"
            f"{s['complete']:>10.3f}{s['other']:>8.3f}"
        )
    kind = machine_kind() + (f"-{args.tag}" if args.tag else "")
    path = write_result("host_step", {"machine": machine(), "settings": vars(args), "rows": rows}, kind=kind)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
