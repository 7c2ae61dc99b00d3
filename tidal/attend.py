"""The attention formula the engine and the trainer share, with the pieces model families add:
a scale of their own, attention logit soft-capping (Gemma 2) and masks for sliding windows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float | None = None) -> Tensor:
    """softmax(cap(q·kᵀ · scale), masked) · v over grouped-query heads: q [B, H, L, D], k [B, Hkv,
    C, D], v [B, Hkv, C, Dv], `mask` broadcast to [B, H, L, C], True where a key is seen; query
    head h reads KV head h // (H / Hkv). cap(x) = c · tanh(x / c) with soft-capping c, else x."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.tanh(q @ k.transpose(-1, -2) * (scale / softcap)) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    # at least float32: a bf16 softmax loses the small weights; float64 inputs stay float64
    return torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype) @ v


def causal_mask(queries: int, keys: int, first: int | None = None, window: int | None = None, device=None) -> Tensor:
    """[queries, keys] True where query i (at position `first` + i; default keys - queries, the
    last positions) sees key j: j <= its position and, with a sliding `window`, position - j <
    window (transformers' convention)."""
    first = keys - queries if first is None else first
    qpos = torch.arange(first, first + queries, device=device)[:, None]
    kpos = torch.arange(keys, device=device)[None, :]
    mask = kpos <= qpos
    if window:
        mask = mask & (kpos > qpos - window)
    return mask
