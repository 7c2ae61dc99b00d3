"""Seeded sampling's random numbers: per-row CPU generators (the engine's way before) against
`row_uniforms` (counter-based, on the logits' device), side by side in one run.

    python -m bench sampling                      # cpu, 64 and 512 rows, SmolLM2's vocabulary
    python -m bench sampling --device cuda        # on a GPU: the per-row way syncs once a row

Each measured call makes one Uniform[0, 1) number per seeded row, as one decode step of the
rollout does (every row seeded, its draw index its token count): `generators` keeps a
`torch.Generator` per row and draws its number on the CPU, then writes it into the device tensor
(one `.item()` and one host-to-device copy a row); `row_uniforms` builds the seed and count
tensors from the rows' Python lists (two copies a step) and computes every number on the device.
`sample_tokens` is the whole draw of a step with the latter (temperature 1, no filters: the RL
case), for scale. The two ways alternate (A B A B) within each repeat; medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import machine, machine_kind, write_result


def per_row_generators(gens: list, device) -> object:
    import torch

    u = torch.rand(len(gens), device=device)
    for j, g in enumerate(gens):
        u[j] = torch.rand(1, generator=g, device=g.device).item()
    return u


def counter_based(seeds: list[int], draws: list[int], device) -> object:
    import torch

    from tidal.engine.sampling import row_uniforms

    s = torch.tensor(seeds, dtype=torch.long, device=device)
    return row_uniforms(s, torch.tensor(draws, dtype=torch.long, device=device))


def timed(sync, fn, *args, **kw) -> float:
    t0 = time.perf_counter()
    fn(*args, **kw)
    sync()
    return time.perf_counter() - t0


def main() -> None:
    import torch

    from tidal.engine.sampling import sample_tokens

    p = argparse.ArgumentParser(prog="python -m bench sampling")
    p.add_argument("--rows", default="64,512")
    p.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for b in (int(x) for x in args.rows.split(",")):
        seeds = [(1_000_003 * i) % (1 << 63) for i in range(b)]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        logits = torch.randn(b, args.vocab, device=dev)
        old, new, whole = [], [], []
        for k in range(args.repeats + 5):
            draws = [k] * b
            times = (
                timed(sync, per_row_generators, gens, dev),
                timed(sync, counter_based, seeds, draws, dev),
                timed(sync, sample_tokens, logits, 1.0, 1.0, 0, seeds, draws=draws),
            )
            if k >= 5:  # warm-up
                for acc, t in zip((old, new, whole), times, strict=True):
                    acc.append(t)
        med = [statistics.median(x) * 1e3 for x in (old, new, whole)]
        rows.append({"rows": b, "generators_ms": med[0], "row_uniforms_ms": med[1], "sample_tokens_ms": med[2]})
    where = f"{dev.type} ({machine_kind()})" if dev.type == "cpu" else torch.cuda.get_device_name(dev)
    print(f"seeded sampling's numbers: {where}, vocab {args.vocab}, {args.threads} threads, {args.repeats} repeats")
    print(f"{'rows':>5} {'generators ms':>14} {'row_uniforms ms':>16} {'speed-up':>9} {'sample_tokens ms':>17}")
    for r in rows:
        ratio = r["generators_ms"] / r["row_uniforms_ms"]
        print(
            f"{r['rows']:>5} {r['generators_ms']:>14.3f} {r['row_uniforms_ms']:>16.3f} {ratio:>8.1f}x "
            f"{r['sample_tokens_ms']:>17.3f}"
        )
    settings = {k: getattr(args, k) for k in ("vocab", "device", "threads", "repeats")}
    path = write_result(f"sampling-{dev.type}", {"machine": machine(), "settings": settings, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
