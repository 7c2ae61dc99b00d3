"""One forward pass over a mixed batch of prefill and decode tokens, with a paged KV cache.

The transformer's own modules (embeddings, norms, projections, MLPs, rotary embedding) do the
math, so the numbers are those of the transformers model; only attention is done here, because
it reads keys and values from cache blocks. The batch is flat: every scheduled sequence
contributes its uncached tokens. Per layer, the new keys/values of *all* sequences are written to
their slots first and only then does any sequence attend, so a sequence admitted in the same step
can read prompt blocks that another one is computing (prefix sharing within a GRPO group).

Supports decoder-only models built like Llama (Llama, Mistral without sliding window, Qwen2,
Qwen3, SmolLM): `model.model.layers[i].self_attn.{q,k,v,o}_proj`, optional q/k norms.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from tidal.engine.sequence import Sequence
from tidal.hardware import CPU, on_host, to_device

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class BatchPlan:
    """Index tensors for one step, built once and used by every layer."""

    input_ids: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T] cache slot of each new token
    last: Tensor  # [S] flat index of each sequence's last token (its next-token logits)
    single_tok: Tensor  # [Bd] flat index of the token of each single-token sequence
    single_slots: Tensor  # [Bd, C] cache slots of their contexts (padded with 0)
    single_mask: Tensor  # [Bd, 1, 1, C] True where the slot is part of the context
    multi: list[tuple[int, int, Tensor, int]]  # (flat start, end, context slots, cached) per prefill

    def to(self, device: torch.device) -> BatchPlan:
        moved = {f.name: to_device(getattr(self, f.name), device) for f in fields(self) if f.name != "multi"}
        multi = [(start, end, ctx.to(device, non_blocking=True), cached) for start, end, ctx, cached in self.multi]
        return BatchPlan(**moved, multi=multi)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, device: torch.device) -> None:
        cfg = model.config
        if cfg.model_type not in SUPPORTED:
            raise ValueError(
                f"the tidal engine runs {', '.join(SUPPORTED)} models, not {cfg.model_type!r}; "
                "use HFEngine (rollout.engine: hf) for other architectures"
            )
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            if cfg.model_type == "mistral":
                raise ValueError("sliding-window attention is not supported by the tidal engine")
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layers = model.model.layers
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.cache_dtype = next(model.parameters()).dtype
        self.cache_shape = (len(self.layers), num_blocks * block_size, self.num_kv_heads, self.head_dim)
        self.allocate()
        self._offsets = torch.arange(block_size, device=CPU)

    def allocate(self) -> None:
        """The KV cache (pages are only resident once a block is written)."""
        self.k_cache = torch.zeros(self.cache_shape, dtype=self.cache_dtype, device=self.device)
        self.v_cache = torch.zeros(self.cache_shape, dtype=self.cache_dtype, device=self.device)

    def release(self) -> None:
        self.k_cache = self.v_cache = torch.empty(0, dtype=self.cache_dtype, device=self.device)

    def kv_bytes(self) -> int:
        n = 1
        for d in self.cache_shape:
            n *= d
        return n * self.cache_dtype.itemsize * 2

    @on_host
    def _context_slots(self, seq: Sequence, end: int) -> Tensor:
        """Cache slots of positions 0..end-1 of `seq` (block b holds slots b*bs .. b*bs+bs-1)."""
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return (table[:, None] * self.block_size + self._offsets).view(-1)[:end]

    def plan(self, seqs: list[Sequence]) -> BatchPlan:
        """The step's index tensors, built on the host and copied to the device at once."""
        return self._host_plan(seqs).to(self.device)

    @on_host
    def _host_plan(self, seqs: list[Sequence]) -> BatchPlan:
        ids, pos, slots, last = [], [], [], []
        single_tok, single_ctx, multi = [], [], []
        flat = 0
        for seq in seqs:
            start, end = seq.num_cached, seq.num_tokens
            ctx = self._context_slots(seq, end)
            ids.extend(seq.tokens[start:end])
            pos.append(torch.arange(start, end))
            slots.append(ctx[start:])
            last.append(flat + end - start - 1)
            if end - start == 1:
                single_tok.append(flat)
                single_ctx.append(ctx)
            else:
                multi.append((flat, flat + end - start, ctx, start))
            flat += end - start
        if single_ctx:
            lengths = torch.tensor([len(c) for c in single_ctx])
            single_slots = torch.nn.utils.rnn.pad_sequence(single_ctx, batch_first=True)
            single_mask = (torch.arange(single_slots.shape[1])[None, :] < lengths[:, None])[:, None, None, :]
        else:
            single_slots = torch.zeros(0, 1, dtype=torch.long)
            single_mask = torch.zeros(0, 1, 1, 1, dtype=torch.bool)
        return BatchPlan(
            input_ids=torch.tensor(ids),
            positions=torch.cat(pos),
            slots=torch.cat(slots),
            last=torch.tensor(last),
            single_tok=torch.tensor(single_tok, dtype=torch.long),
            single_slots=single_slots,
            single_mask=single_mask,
            multi=multi,
        )

    def _attention(self, layer_idx: int, q: Tensor, plan: BatchPlan) -> Tensor:
        """q [T, H, D] → attention output [T, H, D], reading K/V from the cache."""
        kc, vc = self.k_cache[layer_idx], self.v_cache[layer_idx]
        out = torch.empty_like(q)
        if plan.single_tok.numel():
            b = plan.single_tok.numel()
            # grouped-query attention with one query token: the G query heads sharing a KV head
            # become G query rows of that head (query head h uses KV head h // G), which is about
            # twice as fast on CPU as sdpa's enable_gqa
            qd = q[plan.single_tok].view(b, self.num_kv_heads, -1, self.head_dim)  # [B, Hkv, G, D]
            shape = (*plan.single_slots.shape, *kc.shape[1:])
            flat = plan.single_slots.view(-1)  # index_select: much faster than advanced indexing on CPU
            kd = kc.index_select(0, flat).view(shape).transpose(1, 2)  # [B, Hkv, C, D]
            vd = vc.index_select(0, flat).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.single_mask)
            out[plan.single_tok] = o.reshape(b, -1, self.head_dim)
        for start, end, ctx, cached in plan.multi:
            qs = q[start:end].transpose(0, 1)[None]  # [1, H, L, D]
            ks = kc.index_select(0, ctx).transpose(0, 1)[None]  # [1, Hkv, C, D]
            vs = vc.index_select(0, ctx).transpose(0, 1)[None]
            if cached == 0:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                # query i sits at position cached + i and sees keys 0..cached + i
                qpos = torch.arange(cached, cached + end - start, device=q.device)[:, None]
                mask = torch.arange(len(ctx), device=q.device)[None, :] <= qpos
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _norm(norm: torch.nn.Module, x: Tensor) -> Tensor:
        """RMSNorm as one fused op (the module's five small ops cost more than the math on CPU);
        the same formula, computed in float32 inside the kernel."""
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence]) -> Tensor:
        """Compute the uncached tokens of `seqs`, write their K/V, and return the next-token
        logits of each sequence [S, V] in float32."""
        plan = self.plan(seqs)
        m = self.model.model
        h = m.embed_tokens(plan.input_ids)[None]  # [1, T, E]
        cos, sin = m.rotary_emb(h, plan.positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, D]
        h = h[0]
        t = h.shape[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = self._norm(layer.input_layernorm, h)
            q = attn.q_proj(x).view(t, -1, self.head_dim)
            k = attn.k_proj(x).view(t, -1, self.head_dim)
            v = attn.v_proj(x).view(t, -1, self.head_dim)
            if hasattr(attn, "q_norm"):  # qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.k_cache[i].index_copy_(0, plan.slots, k.to(self.k_cache.dtype))
            self.v_cache[i].index_copy_(0, plan.slots, v.to(self.v_cache.dtype))
            o = self._attention(i, q, plan)
            h = h + attn.o_proj(o.reshape(t, -1))
            h = h + layer.mlp(self._norm(layer.post_attention_layernorm, h))
        h = self._norm(m.norm, h[plan.last])
        return self.model.lm_head(h).float()
