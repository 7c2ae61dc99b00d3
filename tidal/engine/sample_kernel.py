"""A GPU's draw for the RL rollout's rows in one Triton kernel: what `sampling.sample_planned`
computes for rows sampled at a temperature > 0 without top-k, top-p or min-p.

Through torch ops that draw is ~70 kernels a step (the counter-based uniforms' integer mixing
alone is ~30, the two-level inverse CDF ~20), each a launch the host pays for and a few
microseconds the GPU spends however little it does; at 512 sequences of a small model the host's
part bounds the decode step (docs/performance.md). Here each row is one program:

    u      = row_uniforms(seed, draw)      (or the caller's uniform for an unseeded row)
    z      = logits / t,  m = max z,  S = Σ exp(z - m),  p = exp(z - m) / S
    target = min(u · P, P⁻)                 P: the sum of the chunks' masses, P⁻ the float below it
    chunk  = the first 256-token chunk whose cumulative mass exceeds target, then the token in
             it whose cumulative mass does, at most the chunk's last token of non-zero mass
    log p  = log(p[token])

the same two-level inverse CDF in token order as `sampling._inverse_cdf` and the same uniforms
(the mixing in int64 with logical shifts, as `sampling.row_uniforms` computes them), so a row's
token depends only on its logits, temperature, seed and draw index. The sums run in another order
than torch's: a token can differ from the torch path's only where the target falls within a
float32 rounding of a cumulative mass. `sampling.kernel_check` compares the two on a sample
before `sampling.sample_planned` uses the kernel; where Triton is missing or they disagree, the
torch ops run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.engine.paged_kernel import interpreting, triton
from tidal.hardware import is_cuda

CHUNK = 256  # `sampling._inverse_cdf`'s chunk of tokens
TILE = 8  # chunks a program reads at once

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _shr(x, k: tl.constexpr):
        # a logical right shift of int64 (`>>` copies the sign bit), as `sampling._shr`
        return (x >> k) & ((1 << (64 - k)) - 1)

    @triton.jit
    def _mix(x):
        # splitmix64's finaliser in wrapping int64 arithmetic, as `sampling._mix`
        x = (x ^ _shr(x, 30)) * -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
        x = (x ^ _shr(x, 27)) * -7723592293110705685  # 0x94D049BB133111EB as int64
        return x ^ _shr(x, 31)

    @triton.jit
    def _draw_kernel(
        Z, T, U, SEEDS, SEEDED, DRAWS, MASS, TOK, LP,
        stride_z, stride_m, V,
        N_CHUNKS: tl.constexpr, CHUNK_: tl.constexpr, TILE: tl.constexpr,
        ANY_SEEDED: tl.constexpr, ALL_SEEDED: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        t = tl.load(T + row)
        u = tl.load(U + row)
        if ANY_SEEDED:
            seed = tl.load(SEEDS + row)
            draw = tl.load(DRAWS + row)
            state = _mix(seed ^ 6364136223846793005) + (draw + 1) * -7046029254386353131  # salt, gamma
            mine = _shr(_mix(state), 40).to(tl.float32) * (1.0 / 16777216.0)
            if ALL_SEEDED:
                u = mine
            else:
                u = tl.where(tl.load(SEEDED + row) != 0, mine, u)
        # the row as tiles of TILE chunks of CHUNK_ tokens
        tile_rows = tl.arange(0, TILE)[:, None]
        cols = tl.arange(0, CHUNK_)[None, :]
        base = Z + row * stride_z
        n_tiles = tl.cdiv(V, TILE * CHUNK_)
        # the tempered logits' maximum, then the softmax's denominator (lane-wise, reduced once)
        top = tl.full([TILE, CHUNK_], -float("inf"), tl.float32)
        for i in range(n_tiles):
            idx = (i * TILE + tile_rows) * CHUNK_ + cols
            top = tl.maximum(top, tl.load(base + idx, mask=idx < V, other=-float("inf")).to(tl.float32) / t)
        m = tl.max(tl.max(top, axis=1), axis=0)
        acc = tl.zeros([TILE, CHUNK_], tl.float32)
        for i in range(n_tiles):
            idx = (i * TILE + tile_rows) * CHUNK_ + cols
            acc += tl.exp(tl.load(base + idx, mask=idx < V, other=-float("inf")).to(tl.float32) / t - m)
        s = tl.sum(tl.sum(acc, axis=1), axis=0)
        # each chunk's mass of p, through this row's scratch, then the cumulative sum over chunks
        for i in range(n_tiles):
            idx = (i * TILE + tile_rows) * CHUNK_ + cols
            p = tl.exp(tl.load(base + idx, mask=idx < V, other=-float("inf")).to(tl.float32) / t - m) / s
            tl.store(MASS + row * stride_m + i * TILE + tl.arange(0, TILE), tl.sum(p, axis=1))
        tl.debug_barrier()  # every thread's masses written before any is read
        chunks = tl.arange(0, N_CHUNKS)
        cdf = tl.cumsum(tl.load(MASS + row * stride_m + chunks), axis=0)
        total = tl.max(cdf, axis=0)  # the last cumulative mass (they only grow)
        below = total.to(tl.int32, bitcast=True) - 1  # the float32 just below a positive total
        target = tl.minimum(u * total, below.to(tl.float32, bitcast=True))
        ci = tl.minimum(tl.sum((cdf <= target).to(tl.int32), axis=0), tl.cdiv(V, CHUNK_) - 1)
        before = tl.max(tl.where(chunks == ci - 1, cdf, 0.0), axis=0)
        at = tl.arange(0, CHUNK_)
        idx = ci * CHUNK_ + at
        p = tl.exp(tl.load(base + idx, mask=idx < V, other=-float("inf")).to(tl.float32) / t - m) / s
        inner = tl.cumsum(p, axis=0)
        ti = tl.sum((inner <= tl.maximum(target - before, 0.0)).to(tl.int32), axis=0)
        last = tl.max(tl.where(p > 0, at, -1), axis=0)  # the chunk's last token of non-zero mass
        ti = tl.minimum(ti, tl.where(last < 0, CHUNK_ - 1, last))
        tl.store(TOK + row, (ci * CHUNK_ + ti).to(tl.int64))
        tl.store(LP + row, tl.log(tl.sum(tl.where(at == ti, p, 0.0), axis=0)))


def runs_on(device: torch.device) -> bool:
    """Whether the kernel runs for tensors on `device` (a GPU with Triton, or its interpreter)."""
    return triton is not None and (is_cuda(device) or interpreting())


def _pow2(n: int) -> int:
    return max(2, 1 << (n - 1).bit_length())


def draw(
    logits: Tensor, temperature: Tensor, u: Tensor, seeds: Tensor | None, seeded: Tensor | None, draws: Tensor
) -> tuple[Tensor, Tensor]:
    """One token per row of `logits` [B, V] (float32 or bfloat16, unit stride in V) from
    softmax(logits / temperature) (every temperature > 0), as the module docstring says:
    `(tokens [B] int64, log_probs [B] float32)`. `u` [B]: the uniforms of unseeded rows; `seeds`
    [B] int64 (None: no row is seeded) with `seeded` [B] bool (None: every row is) and `draws`
    [B] int64: the seeded rows' generator and draw index."""
    b, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    # the scratch of chunk masses: tiles of TILE chunks, zeros past the last (so the cumulative
    # sum over a power-of-two range of chunks ends flat)
    n_chunks = _pow2(-(-v // (CHUNK * TILE)) * TILE)
    mass = torch.zeros(b, n_chunks, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(b, dtype=torch.long, device=logits.device)
    log_probs = torch.empty(b, dtype=torch.float32, device=logits.device)
    any_seeded = seeds is not None
    if b:
        _draw_kernel[(b,)](
            logits, temperature.float().contiguous(), u.float().contiguous(),
            seeds if any_seeded else tokens, seeded if seeded is not None else tokens,
            draws if any_seeded else tokens, mass, tokens, log_probs,
            logits.stride(0), mass.stride(0), v,
            N_CHUNKS=n_chunks, CHUNK_=CHUNK, TILE=TILE, ANY_SEEDED=any_seeded, ALL_SEEDED=any_seeded and seeded is None,
        )  # fmt: skip
    return tokens, log_probs
