"""Two of a decoder layer's small ops as one Triton kernel each on a GPU, rounding where the
transformers modules round, so they compute the modules' numbers.

In a decode step replayed from a CUDA graph, launches cost nothing but each kernel still takes a
few microseconds however little it does; a bf16 RMSNorm in transformers is eight of them (widen,
square, mean, add, rsqrt, multiply, narrow, weight) and the rotary embedding of q and k a dozen.

- `rms_norm(x, w, eps)`: y = w · round(x / sqrt(mean(x²) + eps)), float32 inside, the normalised
  row rounded to x's dtype before the weight's product (rounded to the result's dtype), as
  Llama's RMSNorm module computes it. One program per row.
- `rotary(q, k, cos, sin)`: the rotate-half rotary embedding of q [B, H, D] and k [B, Hkv, D] at
  each row's cos/sin [B, D], x·cos + rotate_half(x)·sin with rotate_half(x) = (-x₂, x₁), every
  product and the sum rounded to x's dtype as the elementwise torch ops round them (products of
  two bf16 numbers are exact in float32, so the bits are transformers' `apply_rotary_pos_emb`'s).
  One launch for q and k.

The engine checks each against the module it replaces on a sample before using it
(`tidal.engine.fuse`, `tidal.engine.decode_path`); where Triton is missing or the check fails,
the modules' own ops run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.engine.paged_kernel import interpreting, triton
from tidal.hardware import is_cuda

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(X, W, Y, stride_x, stride_y, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < n
        x = tl.load(X + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / n
        normed = (x * tl.rsqrt(var + eps)).to(X.dtype.element_ty)  # rounded as the module rounds
        w = tl.load(W + cols, mask=inside, other=0.0)
        y = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=inside)

    @triton.jit
    def _rotary_kernel(
        Q, K, QO, KO, Cos, Sin,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_ob, stride_oh, stride_pb, stride_ph, stride_c,
        HQ: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)  # q heads first, then k heads
        i = tl.arange(0, BLOCK)
        inside = i < HALF
        if h < HQ:
            src = Q + b * stride_qb + h * stride_qh
            dst = QO + b * stride_ob + h * stride_oh
        else:
            src = K + b * stride_kb + (h - HQ) * stride_kh
            dst = KO + b * stride_pb + (h - HQ) * stride_ph
        dtype = Q.dtype.element_ty
        x1 = tl.load(src + i, mask=inside, other=0.0)
        x2 = tl.load(src + HALF + i, mask=inside, other=0.0)
        c1 = tl.load(Cos + b * stride_c + i, mask=inside, other=0.0).to(tl.float32)
        c2 = tl.load(Cos + b * stride_c + HALF + i, mask=inside, other=0.0).to(tl.float32)
        s1 = tl.load(Sin + b * stride_c + i, mask=inside, other=0.0).to(tl.float32)
        s2 = tl.load(Sin + b * stride_c + HALF + i, mask=inside, other=0.0).to(tl.float32)
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        # first half: x1·c1 + (-x2)·s1; second half: x2·c2 + x1·s2; each product and sum rounded
        a1 = (x1 * c1).to(dtype).to(tl.float32)
        r1 = (-x2 * s1).to(dtype).to(tl.float32)
        a2 = (x2 * c2).to(dtype).to(tl.float32)
        r2 = (x1 * s2).to(dtype).to(tl.float32)
        tl.store(dst + i, (a1 + r1).to(dtype), mask=inside)
        tl.store(dst + HALF + i, (a2 + r2).to(dtype), mask=inside)


def available(device: torch.device) -> bool:
    """Whether these kernels run for tensors on `device` (a GPU with Triton, or its interpreter)."""
    return triton is not None and (is_cuda(device) or interpreting())


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The module docstring's RMSNorm over x's last dimension (x [..., H], weight [H])."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, y, rows.stride(0), y.stride(0), n, float(eps), BLOCK=_pow2(n))
    return y.view(*x.shape[:-1], n)


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The module docstring's rotary embedding: q [B, H, D], k [B, Hkv, D], cos/sin [B, D] in
    q's dtype (the rotary module's output) → new q and k, contiguous."""
    b, hq, d = q.shape
    hk = k.shape[1]
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rotary: the head dimension of q, k, cos and sin must be contiguous")
    qo, ko = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k)
    ko = ko.contiguous()
    if b:
        _rotary_kernel[(b, hq + hk)](
            q, k, qo, ko, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
            cos.stride(0), HQ=hq, HALF=d // 2, BLOCK=_pow2(d // 2),
        )  # fmt: skip
    return qo, ko
