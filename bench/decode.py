"""The engine's decode step against the machine's own limits.

    python -m bench decode                           # SmolLM2, batch 32, every quantization this device runs
    python -m bench decode --model random --batch 16 32 64 --threads 2
    python -m bench decode --device cuda --dtype bfloat16 --quantization none fp8

Three things measured in one process, one after another, on the machine it runs on:

- **formats**: `none` is the linear layers run by MKL on the parameters themselves (torch's
  default), `packed` the engine's default for float32 on a CPU (`pack_weights`: oneDNN's kernel on
  copies in its blocked layout, `tidal.engine.quant.PACKED`), `fp16`/`int8`/`fp8` the
  `engine.quantization` formats.
- **limits**: the read bandwidth of memory (a sum over 1 GiB) and the matmul rate of the model's
  own linear layers at the batch size, two ways: `hot` (each weight multiplied 20 times in a row,
  its matrix in cache: the kernel's best) and `stream` (all of the model's weights once, in the
  order a forward reads them: what a decode step's matrix products cost at best, weights coming
  from memory). Each for every weight format the step is measured in.
- **the decode step**: `batch` sequences (prompts of 40 tokens, a group of 4 sharing each prompt)
  decoding one token each, `LLMEngine.step()` timed over `--steps` steps after 5 warm-up steps:
  forward, sampling and bookkeeping. Its matmul rate counts 2 x batch x (weights of the linear
  layers) FLOPs per step; `% of stream` is the streamed matrix products' time over the step's,
  i.e. the share of the step the matrix products would take at the speed this machine gives
  them: each step is timed right after one streamed pass in the same format, and the two medians
  compared (the VM's speed drifts by 10-30% within minutes; best-of-5 passes against a median of
  steps measured minutes apart moved the share by up to 15 points). `% of the best pass` is the
  older figure: the step's rate over the fastest of 5 streamed passes. Attention and everything
  else make up the rest. `% of best fp32` is
  the step's rate over the faster of the `none` and `packed` streamed rates: the machine's fp32
  limit for those shapes, whichever kernel reaches it.
- `--model random` is SmolLM2-135M's shape with random weights (no checkpoint needed).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from bench.common import SMOLLM2_SHAPE, machine, write_result
from tidal.engine.quant import PACKED, packs


def load_model(name: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if name == "random":
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).to(dtype).eval()
    from tidal.convert import ensure_model

    return AutoModelForCausalLM.from_pretrained(str(ensure_model(name)), dtype=dtype).eval()


def _timed_once(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _timed(fn, repeats: int) -> float:
    """The best of `repeats` timed calls, after one untimed."""
    fn()
    return min(_timed_once(fn) for _ in range(repeats))


def memory_bandwidth(device: str) -> float:
    """GB/s read by a sum over 1 GiB of fp32 (best of 5)."""
    a = torch.ones(2**28, device=device)
    return a.numel() * 4 / _timed(lambda: a.sum(), 5) / 1e9


def layer_products(model, kind: str, batch: int, device: str):
    """Callables computing each linear layer of `model` on a [batch, K] input, in format `kind`."""
    from tidal.engine.quant import QuantizedLinear

    dtype = next(model.parameters()).dtype
    fns = []
    for mod in model.modules():
        if type(mod) is not torch.nn.Linear:
            continue
        x = torch.randn(batch, mod.in_features, device=device, dtype=dtype)
        if kind == "none":
            fns.append(functools.partial(torch.nn.functional.linear, x, mod.weight))
        else:
            layer = QuantizedLinear(mod, kind)
            layer.refresh()
            fns.append(functools.partial(layer, x))
    return fns


def matmul_rates(fns, flops: float) -> dict:
    stream = _timed(lambda: [f() for f in fns], 5)
    hot = 0.0
    for f in fns:  # each matrix 20 times in a row (in cache after the first)
        hot += _timed(lambda f=f: [f() for _ in range(20)], 2) / 20
    return {"stream_s": stream, "stream_gflops": flops / stream / 1e9, "hot_gflops": flops / hot / 1e9}


def decode_step(model_name: str, dtype: torch.dtype, kind: str, batch: int, steps: int, device: str, products) -> dict:
    """The engine's step, each step timed right after one streamed pass of `products` (the
    model's matrix products in the same format): the machine's speed drifts, and pairing keeps
    the two medians comparable."""
    from tidal.contracts import SamplingParams
    from tidal.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        load_model(model_name, dtype),
        dtype=str(dtype).split(".")[-1],
        device=device,
        kv_cache_tokens=batch * (64 + steps + 16) * 2,
        quantization="none" if kind == PACKED else kind,
        pack_weights=kind == PACKED,
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40000, (40,), generator=gen).tolist() for _ in range(max(1, batch // 4))]
    for i in range(batch):
        engine.add_request(
            None,
            prompts[i // 4 % len(prompts)],
            SamplingParams(temperature=1.0, max_new_tokens=steps + 8, seed=i, ignore_eos=True),
        )
    engine.step()  # the prefill
    for _ in range(5):
        engine.step()
    times, passes = [], []
    for _ in range(steps):
        passes.append(_timed_once(lambda: [f() for f in products]))
        times.append(_timed_once(engine.step))
    running = engine.stats()["running"]
    engine.abort()
    times.sort()
    n = sum(m.weight.numel() for m in engine.model.modules() if type(m) is torch.nn.Linear)
    step = times[len(times) // 2]
    return {
        "step_s": step,
        "paired_stream_s": sorted(passes)[len(passes) // 2],
        "step_min_s": times[0],
        "running": running,
        "gflops": 2 * batch * n / step / 1e9,
        "tokens_per_s": batch / step,
        "quantize_s": engine.quant.refresh() if engine.quant else 0.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | random (its shape, random weights)")
    p.add_argument("--batch", type=int, nargs="+", default=[32])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument(
        "--quantization",
        nargs="+",
        default=None,
        help="formats (default: none packed fp16 int8 on a CPU, none fp8 on CUDA)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    packed = [PACKED] if packs(torch.device(args.device), dtype) else []
    kinds = args.quantization or (["none", *packed, "fp16", "int8"] if args.device == "cpu" else ["none", "fp8"])
    info = machine()
    print(
        f"{info['cpu_model']} ({info['cpu_capability']}, bf16 native: {info['bf16_native']}), "
        f"{torch.get_num_threads()} threads, {args.model}, {args.dtype}, device {args.device}",
        flush=True,
    )
    bw = memory_bandwidth(args.device)
    print(f"memory read bandwidth: {bw:.1f} GB/s", flush=True)
    model = load_model(args.model, dtype).to(args.device)
    rows = []
    for batch in args.batch:
        for kind in kinds:
            fns = layer_products(model, kind, batch, args.device)
            flops = 2 * batch * sum(m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear)
            rates = matmul_rates(fns, flops)
            step = decode_step(args.model, dtype, kind, batch, args.steps, args.device, fns)
            row = {
                "batch": batch,
                "quantization": kind,
                **rates,
                **step,
                "pct_of_stream": 100 * step["paired_stream_s"] / step["step_s"],
                "pct_of_best_stream": 100 * step["gflops"] / rates["stream_gflops"],
                "pct_of_hot": 100 * step["gflops"] / rates["hot_gflops"],
            }
            rows.append(row)
            print(
                f"batch {batch:3d} {kind:6s} step {1e3 * row['step_s']:7.1f} ms ({row['tokens_per_s']:6.0f} tok/s, "
                f"{row['gflops']:6.1f} GFLOP/s) | products streamed {1e3 * rates['stream_s']:7.1f} ms "
                f"({rates['stream_gflops']:6.1f}), hot {rates['hot_gflops']:6.1f} GFLOP/s | "
                f"step at {row['pct_of_stream']:5.1f}% of streamed (paired medians; "
                f"{row['pct_of_best_stream']:.1f}% of the best pass), {row['pct_of_hot']:5.1f}% of hot | "
                f"re-quantize {row['quantize_s']:.2f} s",
                flush=True,
            )
        full = [r for r in rows if r["batch"] == batch and r["quantization"] in ("none", PACKED)]
        if full:
            best = max(full, key=lambda r: r["stream_gflops"])
            for r in rows:
                if r["batch"] == batch:
                    r["pct_of_best_fp32"] = 100 * r["gflops"] / best["stream_gflops"]
            print(
                f"batch {batch:3d}: best {args.dtype} streamed products {best['stream_gflops']:.1f} GFLOP/s "
                f"({best['quantization']}); steps at "
                + ", ".join(f"{r['quantization']} {r['pct_of_best_fp32']:.1f}%" for r in rows if r["batch"] == batch),
                flush=True,
            )
    path = write_result(
        f"decode-{args.dtype}-{args.device}", {"machine": info, "settings": vars(args), "memory_gbps": bw, "rows": rows}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
