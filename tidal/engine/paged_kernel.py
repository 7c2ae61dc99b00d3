"""Decode attention read from the paged KV cache through each sequence's block table, on the device.

One query token per sequence attends over its whole cached context: for sequence b, key/value
head h and the G query heads that share it (grouped-query attention: query head h·G + g),

    o[b, h·G + g] = Σ_j softmax_j(cap(q[b, h·G + g] · k[slot(b, j), h] · scale)) v[slot(b, j), h]

over the positions j of the context that the query sees (j < len[b]; with a sliding window w,
also len[b] - 1 - j < w, transformers' convention), where slot(b, j) = table[b, j // bs]·bs +
j mod bs and cap(x) = c·tanh(x / c) with soft-capping c (Gemma 2), else x.

`decode_attention` runs it as one Triton kernel per layer (one program per sequence and KV head,
an online softmax over tiles of the context, float32 accumulation): the block table and lengths
are read on the device, so nothing is planned per step on the host and a CUDA graph replays it
for any lengths. `reference_decode_attention` is the same formula in PyTorch ops (gather the
context, then `tidal.attend.attend`): the kernel's test reference, and the path on a device
without Triton (a CPU, which has its own C kernel for the common case: `tidal.engine.native`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from tidal.attend import attend, causal_mask
from tidal.hardware import CPU, is_cuda

triton = None
# Triton installs with CUDA torch; on a CPU only its interpreter (TRITON_INTERPRET=1, the tests)
# runs the kernels, and importing it there would only cost ~80 MB and 0.2 s of every process
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - depends on the install
        triton = None


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (on CPU tensors: the tests' mode)."""
    return triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def runs_on(device: torch.device) -> bool:
    """Whether `decode_attention`'s kernel runs for tensors on `device`."""
    if triton is None:
        return False
    return is_cuda(device) or interpreting()


if triton is not None:

    @triton.jit
    def _tanh(x):
        # tanh(x) = sign(x)·(1 - e^-2|x|) / (1 + e^-2|x|): no overflow for large |x|
        t = tl.exp(-2.0 * tl.abs(x))
        y = (1.0 - t) / (1.0 + t)
        return tl.where(x < 0, -y, y)

    @triton.jit
    def _tile(
        q, K, V, Tables, b, h, first, length, m, total, acc, scale, softcap,
        stride_kn, stride_kh, stride_vn, stride_vh, stride_tb,
        D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, BS: tl.constexpr,
        BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    ):  # fmt: skip
        """One tile of BLOCK_N context positions from `first`: the online softmax's update of the
        running max `m`, normaliser `total` and weighted sum `acc`."""
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        pos = first + tl.arange(0, BLOCK_N)
        seen = pos < length
        block = tl.load(Tables + b * stride_tb + pos // BS, mask=seen, other=0)
        slot = block.to(tl.int64) * BS + pos % BS
        k = tl.load(
            K + slot[:, None] * stride_kn + h * stride_kh + d[None, :],
            mask=seen[:, None] & (d[None, :] < D),
            other=0.0,
        )
        if INTERPRET:  # its dot reads 16-bit floats as integers: the same products in float32
            q, k = q.to(tl.float32), k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G_PAD, BLOCK_N]
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(
            V + slot[:, None] * stride_vn + h * stride_vh + dv[None, :],
            mask=seen[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        p = p.to(v.dtype)  # the weights rounded to the values' dtype, as the tensor cores take them
        if INTERPRET:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        return m_new, total, acc

    @triton.jit
    def _decode_kernel(
        Q, K, V, Out, Tables, Lens,
        scale, softcap, window,
        stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ob, stride_oh, stride_tb,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        DV: tl.constexpr, DV_PAD: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
        SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)  # KV head; its G query heads are h*G .. h*G + G - 1
        length = tl.load(Lens + b)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        heads = h * G + g
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=(g[:, None] < G) & (d[None, :] < D),
            other=0.0,
        )
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
        start = 0
        if WINDOW:  # keys before the window are never read
            start = tl.maximum(length - window, 0)
        if INTERPRET:  # the interpreter cannot take a loaded length as a range's bound
            first = start
            while first < length:
                m, total, acc = _tile(
                    q, K, V, Tables, b, h, first, length, m, total, acc, scale, softcap,
                    stride_kn, stride_kh, stride_vn, stride_vh, stride_tb,
                    D, D_PAD, DV, DV_PAD, BS, BLOCK_N, SOFTCAP, PRECISION, INTERPRET,
                )  # fmt: skip
                first += BLOCK_N
        else:
            for first in range(start, length, BLOCK_N):
                m, total, acc = _tile(
                    q, K, V, Tables, b, h, first, length, m, total, acc, scale, softcap,
                    stride_kn, stride_kh, stride_vn, stride_vh, stride_tb,
                    D, D_PAD, DV, DV_PAD, BS, BLOCK_N, SOFTCAP, PRECISION, INTERPRET,
                )  # fmt: skip
        out = acc / total[:, None]
        tl.store(
            Out + b * stride_ob + heads[:, None] * stride_oh + dv[None, :],
            out.to(Out.dtype.element_ty),
            mask=(g[:, None] < G) & (dv[None, :] < DV),
        )

    @triton.jit
    def _prefill_kernel(
        Q, K, V, Out, Tables, Starts, News, Cached,
        scale, softcap, window,
        stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh, stride_tb,
        G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
        BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    ):  # fmt: skip
        s = tl.program_id(0)  # the sequence
        mt = tl.program_id(1)  # its tile of BLOCK_M new tokens
        h = tl.program_id(2)  # the query head (KV head h // G)
        new = tl.load(News + s)
        if mt * BLOCK_M < new:
            cached = tl.load(Cached + s)
            start = tl.load(Starts + s)
            i = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # new tokens i, at positions cached + i
            rows = i < new
            qpos = cached + i
            d = tl.arange(0, D_PAD)
            dv = tl.arange(0, DV_PAD)
            q = tl.load(
                Q + (start + i)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=rows[:, None] & (d[None, :] < D),
                other=0.0,
            )
            hk = h // G
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            total = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
            hi = cached + tl.minimum(new, (mt + 1) * BLOCK_M)  # keys past the tile's last query are unseen
            lo = 0
            if WINDOW:  # keys before the first query's window are never read
                lo = tl.maximum(cached + mt * BLOCK_M - window + 1, 0)
            if INTERPRET:  # the interpreter cannot take loaded bounds in a range
                first = lo
                while first < hi:
                    m, total, acc = _prefill_tile(
                        q, K, V, Tables, s, hk, first, hi, qpos, m, total, acc, scale, softcap, window,
                        stride_kn, stride_kh, stride_vn, stride_vh, stride_tb,
                        D, D_PAD, DV, DV_PAD, BS, BLOCK_N, SOFTCAP, WINDOW, PRECISION, INTERPRET,
                    )  # fmt: skip
                    first += BLOCK_N
            else:
                for first in range(lo, hi, BLOCK_N):
                    m, total, acc = _prefill_tile(
                        q, K, V, Tables, s, hk, first, hi, qpos, m, total, acc, scale, softcap, window,
                        stride_kn, stride_kh, stride_vn, stride_vh, stride_tb,
                        D, D_PAD, DV, DV_PAD, BS, BLOCK_N, SOFTCAP, WINDOW, PRECISION, INTERPRET,
                    )  # fmt: skip
            out = acc / tl.where(rows, total, 1.0)[:, None]
            tl.store(
                Out + (start + i)[:, None] * stride_ot + h * stride_oh + dv[None, :],
                out.to(Out.dtype.element_ty),
                mask=rows[:, None] & (dv[None, :] < DV),
            )

    @triton.jit
    def _prefill_tile(
        q, K, V, Tables, s, hk, first, hi, qpos, m, total, acc, scale, softcap, window,
        stride_kn, stride_kh, stride_vn, stride_vh, stride_tb,
        D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, BS: tl.constexpr,
        BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):  # fmt: skip
        """`_tile` for BLOCK_M queries at positions `qpos`: causal (and windowed) per query."""
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        pos = first + tl.arange(0, BLOCK_N)
        inside = pos < hi
        block = tl.load(Tables + s * stride_tb + pos // BS, mask=inside, other=0)
        slot = block.to(tl.int64) * BS + pos % BS
        k = tl.load(
            K + slot[:, None] * stride_kn + hk * stride_kh + d[None, :],
            mask=inside[:, None] & (d[None, :] < D),
            other=0.0,
        )
        qq = q
        if INTERPRET:  # its dot reads 16-bit floats as integers: the same products in float32
            qq, k = q.to(tl.float32), k.to(tl.float32)
        sc = tl.dot(qq, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            sc = softcap * _tanh(sc / softcap)
        seen = inside[None, :] & (pos[None, :] <= qpos[:, None])
        if WINDOW:
            seen = seen & (qpos[:, None] - pos[None, :] < window)
        sc = tl.where(seen, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        # a row that has seen nothing yet (padding rows, or all keys of the tile unseen) keeps 0s
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(sc - safe[:, None])
        alpha = tl.exp(m - safe)
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(
            V + slot[:, None] * stride_vn + hk * stride_vh + dv[None, :],
            mask=inside[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        p = p.to(v.dtype)
        if INTERPRET:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        return m_new, total, acc


@functools.cache
def _pad(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    lens: Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Tensor:
    """The module docstring's formula: q [B, H, D] (one token per sequence), caches [slots, Hkv,
    D] and [slots, Hkv, Dv], tables [B, W] int32 block ids, lens [B] context lengths (the query
    at position lens - 1, its own key included) → [B, H, Dv] in q's dtype. One Triton kernel
    (`block_n` context positions a tile, default 64, 32 for heads over 128 wide; `num_warps` and
    `num_stages` as Triton takes them: `bench gpu --parts attention` times the choices)."""
    b, heads, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    out = q.new_empty(b, heads, dv)
    if b == 0:
        return out
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("decode_attention: the head dimension of q and the caches must be contiguous")
    group = heads // hkv
    # fp32 caches: exact float32 products (Triton's default for a float32 dot is tf32)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_kernel[(b, hkv)](
        q, k_cache, v_cache, out, tables, lens,
        float(scale), float(softcap or 0.0), int(window or 0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), tables.stride(0),
        G=group, G_PAD=_pad(group), D=d, D_PAD=_pad(d), DV=dv, DV_PAD=_pad(dv), BS=block_size,
        BLOCK_N=block_n or (64 if d <= 128 else 32), SOFTCAP=bool(softcap), WINDOW=bool(window),
        PRECISION=precision, INTERPRET=interpreting(), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def context_slots(tables: Tensor, lens: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Each sequence's cache slots [B, C] (C = the longest context; slot 0 past a sequence's end)
    and the mask [B, C] of the positions it has."""
    width = int(lens.max()) if lens.numel() else 1
    pos = torch.arange(width, device=tables.device)
    blocks = tables.long().gather(1, (pos // block_size).clamp(max=tables.shape[1] - 1).expand(tables.shape[0], -1))
    seen = pos[None, :] < lens[:, None]
    return torch.where(seen, blocks * block_size + pos % block_size, 0), seen


def reference_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    lens: Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """`decode_attention` in PyTorch ops: gather each context, mask, `tidal.attend.attend`."""
    b, heads, d = q.shape
    hkv = k_cache.shape[1]
    slots, seen = context_slots(tables, lens, block_size)
    if window:
        pos = torch.arange(slots.shape[1], device=q.device)
        seen = seen & (pos[None, :] >= (lens[:, None] - window))
    k = k_cache[slots].transpose(1, 2)  # [B, Hkv, C, D]
    v = v_cache[slots].transpose(1, 2)
    qd = q.reshape(b, hkv, heads // hkv, d)  # the G query heads of each KV head as G query rows
    o = attend(qd, k, v, seen[:, None, None, :], scale, softcap)
    return o.reshape(b, heads, -1)


@dataclass
class PrefillBatch:
    """The sequences a step prefills, for `prefill_attention`: sequence s's new tokens are rows
    starts[s] .. starts[s] + news[s] - 1 of the step's flat tokens, after cached[s] tokens in the
    cache; its blocks are tables[s] (int32)."""

    tables: Tensor  # [S, W]
    starts: Tensor  # [S]
    news: Tensor  # [S]
    cached: Tensor  # [S]
    longest: int  # the most new tokens of a sequence (sizes the kernel's grid)

    def to(self, device: torch.device) -> PrefillBatch:
        moved = (t.to(device, non_blocking=True) for t in (self.tables, self.starts, self.news, self.cached))
        return PrefillBatch(*moved, self.longest)


def prefill_attention(
    q: Tensor,
    out: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    batch: PrefillBatch,
    block_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Causal attention of `batch`'s new tokens over their cached context and themselves, into
    `out`: q [T, H, D] and out [T, H, Dv] hold the step's flat tokens; new token i of sequence s
    (at position cached[s] + i) sees keys j <= cached[s] + i (within the window), read through its
    block table from caches that already hold the new tokens' keys and values. One Triton kernel;
    rows of `out` that are no sequence's new tokens are left as they are."""
    heads, d = q.shape[1], q.shape[2]
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    n = batch.tables.shape[0]
    if n == 0 or batch.longest == 0:
        return
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("prefill_attention: the head dimension of q, out and the caches must be contiguous")
    block_m = 32 if d > 128 else 64
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _prefill_kernel[(n, triton.cdiv(batch.longest, block_m), heads)](
        q, k_cache, v_cache, out, batch.tables, batch.starts, batch.news, batch.cached,
        float(scale), float(softcap or 0.0), int(window or 0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), batch.tables.stride(0),
        G=heads // hkv, D=d, D_PAD=_pad(d), DV=dv, DV_PAD=_pad(dv), BS=block_size, BLOCK_M=block_m,
        BLOCK_N=64 if d <= 128 else 32, SOFTCAP=bool(softcap), WINDOW=bool(window), PRECISION=precision,
        INTERPRET=interpreting(), num_warps=4, num_stages=2,
    )  # fmt: skip


def reference_prefill_attention(
    q: Tensor,
    out: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    batch: PrefillBatch,
    block_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """`prefill_attention` in PyTorch ops, one sequence at a time (gather, mask, `attend`)."""
    rows = zip(batch.starts.tolist(), batch.news.tolist(), batch.cached.tolist(), strict=True)
    for s, (start, new, past) in enumerate(rows):
        lens = torch.tensor([past + new], device=q.device)
        slots, _ = context_slots(batch.tables[s : s + 1], lens, block_size)
        ks = k_cache[slots[0]].transpose(0, 1)[None]  # [1, Hkv, C, D]
        vs = v_cache[slots[0]].transpose(0, 1)[None]
        qs = q[start : start + new].transpose(0, 1)[None]  # [1, H, L, D]
        mask = causal_mask(new, past + new, past, window, q.device)
        out[start : start + new] = attend(qs, ks, vs, mask, scale, softcap)[0].transpose(0, 1)


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run both kernels once on a small random case against their references on `device`: None
    when they agree (within bf16's rounding), else why not (the engine then keeps the references)."""
    gen = torch.Generator(device=CPU).manual_seed(0)
    bs, hkv, group, d = 4, 2, 2, 64
    k = torch.randn(16 * bs, hkv, d, generator=gen, device=CPU).to(device, dtype)
    v = torch.randn(16 * bs, hkv, d, generator=gen, device=CPU).to(device, dtype)
    tables = torch.randperm(16, generator=gen, device=CPU)[:12].view(2, 6).to(device, torch.int32)
    q = torch.randn(11, hkv * group, d, generator=gen, device=CPU).to(device, dtype)
    on = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
    try:
        got = decode_attention(q[:2], k, v, tables, on([5, 21]), bs, 0.125)
        want = reference_decode_attention(q[:2], k, v, tables, on([5, 21]), bs, 0.125)
        args = (PrefillBatch(tables, on([0, 4]), on([4, 7]), on([3, 9]), 7), bs, 0.125)
        out, ref = torch.zeros_like(q), torch.zeros_like(q)
        prefill_attention(q, out, k, v, *args)
        reference_prefill_attention(q, ref, k, v, *args)
    except Exception as e:  # a kernel that does not compile or launch here
        return f"{type(e).__name__}: {e}"
    for name, a, b in (("decode", got, want), ("prefill", out, ref)):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        if not err < 2e-2:
            return f"the {name} kernel differs from its reference by {err:.3g} (relative)"
    return None
