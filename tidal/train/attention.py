"""Attention for packed training rows: the samples of a row attended as a right-padded batch.

transformers runs a packed row ([1, S], positions restarting per sample) through sdpa with an
[S, S] block-diagonal mask. On CPU that is slow twice over: the masked kernel scores all S^2
pairs (a row of 8 samples does 8x the work of attending each sample alone), and the bf16
backward of the CPU flash kernel is ~3x slower than the fp32 one. `packed_attention` gathers the
row's q/k/v into a right-padded [B, L] batch instead, where plain causal attention is exact (a
real token never attends to the padding after it, and padded queries are dropped, so they pass
no gradient), attends with `is_causal` (in fp32 on CPU), and gathers the result back into the row.
On SmolLM2's heads, a 692-token row of 8 samples: forward + backward 23.8 ms -> 8.6 ms per layer.

The padded view holds a group's prompt once per sample (the row stores it once), so the padded
q, k, v and output autograd would keep can be several times the row's. On a CPU, plain causal
attention (`_RowAttention`) keeps the row's q, k, v and output and the padded view's log-sum-exp
only; its backward gathers the padded view again and calls the same flash kernel's backward: the
same bits, no attention run twice. On the memory bench's groups (16 samples, 529 row tokens, 1,392
padded slots) that keeps 245 MB less over SmolLM2's 30 layers.

`use_packed_attention(model)` switches an sdpa model to it. Sliding-window and soft-capped layers
attend in the same padded view with their window's mask and the cap (`tidal.attend`). Calls
without a `tidal_layout` keyword (padded batches, generation) go to transformers' sdpa with its
usual mask (soft-capped ones to `attend` with that mask), so the switched model computes
everything else exactly as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tidal import invariant, recurrent, vision
from tidal.attend import attend, causal_mask
from tidal.hardware import CPU, on_host
from tidal.train.context import ContextSplit, gather_keys

NAME = "tidal_packed"


@dataclass(frozen=True)
class PackedLayout:
    """Where each token of a packed row sits in the padded [batch, length] view of it.

    `to_padded` [batch * length]: for each padded slot, the row position it copies (a padding slot
    copies its sample's first token: any finite value works, since no real query attends to it).
    `to_packed` [S]: for each row position, its padded slot (sample * length + offset).
    """

    batch: int
    length: int
    to_padded: Tensor
    to_packed: Tensor
    # Gemma 3's images (`vision.Family.bidirectional`): per sample, the runs [a, b) of its
    # positions whose tokens attend to each other both ways (`vision.within_images`)
    images: tuple[tuple[tuple[int, int], ...], ...] | None = None

    def to(self, device: str | torch.device) -> PackedLayout:
        return dataclasses.replace(self, to_padded=self.to_padded.to(device), to_packed=self.to_packed.to(device))

    def mask(self, window: int | None, device) -> Tensor:
        """The padded view's mask [batch, 1, length, length] with `images`: causal within each
        sample (within `window`), each image's tokens also seeing that image's later tokens."""
        causal = causal_mask(self.length, self.length, 0, window, device)
        masks = [vision.within_images(causal.clone(), 0, list(runs), window) for runs in self.images]
        return torch.stack(masks)[:, None]


def packed_layout(position_ids: Tensor) -> PackedLayout:
    """The layout of a packed row from its [1, S] `position_ids`: a new sample starts wherever the
    position does not step by +1 (the rule transformers uses to detect packing)."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"packed_layout: position_ids must be [1, S], got {tuple(position_ids.shape)}")
    pos = position_ids[0]
    s = pos.shape[0]
    starts = torch.ones(s, dtype=torch.bool, device=pos.device)
    starts[1:] = pos[1:] != pos[:-1] + 1
    seg = starts.long().cumsum(0) - 1
    first = torch.nonzero(starts)[:, 0]
    lengths = torch.diff(first, append=torch.tensor([s], device=pos.device))
    offset = torch.arange(s, device=pos.device) - first[seg]
    batch, length = int(first.shape[0]), int(lengths.max())
    to_packed = seg * length + offset
    to_padded = first.repeat_interleave(length)  # padding slots: the sample's first token
    to_padded[to_packed] = torch.arange(s, device=pos.device)
    return PackedLayout(batch, length, to_padded, to_packed)


@on_host
def shared_prefix_layout(rows: list[list[int]], owned: list[list[int]], row_length: int) -> PackedLayout:
    """The layout of a row in which samples share stored tokens (a group's prompt, stored once).

    `rows[b]`: the row positions of sample b's tokens in order (its prompt's, then its own);
    `owned[b]`: the offsets into `rows[b]` whose attention output sample b provides. Every row
    position must be owned by exactly one sample; the others attend over the same keys and values
    (duplicated in the padded view, so their gradients add up) and their outputs are dropped.
    Exact: a position's keys are its sample's earlier tokens, which are the same tokens whichever
    sample holds the shared ones."""
    batch, length = len(rows), max(len(r) for r in rows)
    to_padded = torch.empty(batch * length, dtype=torch.long)
    to_packed = torch.full((row_length,), -1, dtype=torch.long)
    for b, (row, own) in enumerate(zip(rows, owned, strict=True)):
        idx = torch.tensor(row, dtype=torch.long)
        to_padded[b * length : (b + 1) * length] = idx[0]  # padding slots: the sample's first token
        to_padded[b * length : b * length + len(row)] = idx
        own_t = torch.tensor(own, dtype=torch.long)
        to_packed[idx[own_t]] = b * length + own_t
    if (to_packed < 0).any():
        raise ValueError("shared_prefix_layout: some row positions belong to no sample")
    return PackedLayout(batch, length, to_padded, to_packed)


def _to_padded(x: Tensor, layout: PackedLayout) -> Tensor:
    """[1, heads, S, D] row → [B, heads, L, D] right-padded batch."""
    h, d = x.shape[1], x.shape[3]
    return x[0].index_select(1, layout.to_padded).view(h, layout.batch, layout.length, d).transpose(0, 1)


def packed_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    tidal_layout: PackedLayout | ContextSplit | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """A transformers attention function (query [1, H, S, D], key/value [1, KV, S, D]; returns
    [1, S, H, D]). Without a layout it attends with transformers' `attention_mask`; with a
    `ContextSplit` (context parallelism) the queries are this rank's part of the row and attend
    over every rank's keys and values (`tidal.train.context`)."""
    if kwargs.get("s_aux") is not None:  # attention sinks: not part of `attend`'s formula
        raise NotImplementedError(f"{type(module).__name__}: tidal's packed attention has no attention sinks")
    sliding = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    softcap = kwargs.get("softcap")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if invariant.active():
        return _invariant_attention(query, key, value, attention_mask, tidal_layout, scale, sliding, softcap), None
    if tidal_layout is None or query.shape[0] != 1:
        if softcap is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        # sdpa has no soft-capping: transformers' boolean mask (None: plain causal) with `attend`
        mask = attention_mask if attention_mask is not None else causal_mask(query.shape[2], key.shape[2])
        return attend(query, key, value, mask.to(query.device).bool(), scale, softcap).transpose(1, 2), None
    if isinstance(tidal_layout, ContextSplit):
        return _context_attention(query, key, value, tidal_layout, scale, sliding, softcap)
    lay = tidal_layout
    plain = lay.images is None and not sliding and softcap is None and not dropout
    # the flash kernel takes one head size (latent attention's values have another: sdpa's math)
    if plain and query.device.type == CPU and query.shape[-1] == key.shape[-1] == value.shape[-1]:
        return _RowAttention.apply(query, key, value, lay, scaling), None
    return _padded_attention(query, key, value, lay, dropout, scaling, scale, sliding, softcap), None


def _to_row(out: Tensor, lay: PackedLayout) -> Tensor:
    """[B, H, L, D] padded output → [S, H, D]: each row position's owner's slot."""
    h, d = out.shape[1], out.shape[3]
    return out.transpose(1, 2).reshape(lay.batch * lay.length, h, d).index_select(0, lay.to_packed)


class _RowAttention(torch.autograd.Function):
    """Causal attention of a packed row's samples as the padded batch `lay` describes, on a CPU in
    fp32 (the flash kernel's bf16 backward is ~3x slower): sdpa's own CPU flash kernel, keeping
    for the backward the row's q, k, v and output and the padded log-sum-exp.

    The backward needs the padded output only where the output's gradient is not zero (a slot's
    D = rowsum(dO * O) and its part of dk, dv vanish with dO): the owned slots, whose output is
    the row's; so the row's output, gathered into every slot, gives the kernel's own gradients."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, lay: PackedLayout, scaling: float | None):
        q, k, v = (_to_padded(x, lay).float() for x in (query, key, value))
        with torch.autocast(CPU, enabled=False):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scaling)
        rows = _to_row(out, lay)
        ctx.save_for_backward(query, key, value, rows, lse)
        ctx.lay, ctx.scaling = lay, scaling
        return rows[None].to(query.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        query, key, value, rows, lse = ctx.saved_tensors
        lay = ctx.lay
        b, n, (h, d) = lay.batch, lay.length, rows.shape[1:]
        q, k, v = (_to_padded(x, lay).float() for x in (query, key, value))
        out = rows.index_select(0, lay.to_padded).view(b, n, h, d).transpose(1, 2)
        g_out = grad[0].float().new_zeros(b * n, h, d).index_add_(0, lay.to_packed, grad[0].float())
        g_out = g_out.view(b, n, h, d).transpose(1, 2)
        with torch.autocast(CPU, enabled=False):
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                g_out, q, k, v, out, lse, 0.0, True, scale=ctx.scaling
            )
        return (*(_to_rows_grad(g, x, lay) for g, x in zip(grads, (query, key, value), strict=True)), None, None)


def _to_rows_grad(grad: Tensor, x: Tensor, lay: PackedLayout) -> Tensor:
    """The gradient of `_to_padded(x, lay).float()` back on x's row [1, heads, S, D]: padded slots
    that copy one row position (a shared prompt's copies, padding) add up in x's dtype, as
    autograd adds them (the cast's backward comes first)."""
    h, d = grad.shape[1], grad.shape[3]
    flat = grad.to(x.dtype).transpose(0, 1).reshape(h, lay.batch * lay.length, d)
    return flat.new_zeros(h, x.shape[2], d).index_add_(1, lay.to_padded, flat)[None]


def _padded_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    lay: PackedLayout,
    dropout: float,
    scaling: float | None,
    scale: float,
    sliding: int | None,
    softcap: float | None,
) -> Tensor:
    """The row's samples attended as the padded batch `lay` describes: [1, S, H, D]."""
    q, k, v = (_to_padded(x, lay) for x in (query, key, value))
    gqa = q.shape[1] != k.shape[1]
    with torch.autocast(CPU, enabled=False) if q.device.type == CPU else contextlib.nullcontext():
        if q.device.type == CPU:  # the CPU flash kernel's bf16 backward is ~3x slower than fp32's
            q, k, v = q.float(), k.float(), v.float()
        if lay.images is not None:  # Gemma 3's images attend both ways
            out = attend(q, k, v, lay.mask(sliding, q.device), scale, softcap)
        elif sliding or softcap is not None:  # each padded sample attends causally within its window
            mask = causal_mask(lay.length, lay.length, 0, sliding, q.device)
            out = attend(q, k, v, mask, scale, softcap)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa
            )
    return _to_row(out, lay)[None].to(query.dtype)


def _invariant_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    layout: PackedLayout | ContextSplit | None,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> Tensor:
    """`packed_attention` under batch-invariant numerics (`train.batch_invariant`): each query over
    its own sample's keys with `tidal.invariant.attend`, whose bits do not depend on the other
    samples or the padding, as the engine attends (`engine.batch_invariant`). [B, S, H, D]."""
    if isinstance(layout, ContextSplit):
        k, v = gather_keys(key, layout), gather_keys(value, layout)
        return invariant.attend(query, k, v, layout.mask(window)[None, None], scale, softcap).transpose(1, 2)
    if layout is None or query.shape[0] != 1:
        q_len, k_len = query.shape[2], key.shape[2]
        mask = attention_mask if attention_mask is not None else causal_mask(q_len, k_len, None, window, query.device)
        return invariant.attend(query, key, value, mask.to(query.device).bool(), scale, softcap).transpose(1, 2)
    q, k, v = (_to_padded(x, layout) for x in (query, key, value))
    if layout.images is not None:
        mask = layout.mask(window, q.device)
    else:
        mask = causal_mask(layout.length, layout.length, 0, window, q.device)
    return _to_row(invariant.attend(q, k, v, mask, scale, softcap), layout)[None]


def _context_attention(
    query: Tensor, key: Tensor, value: Tensor, split: ContextSplit, scale: float, window: int | None, softcap
) -> tuple[Tensor, None]:
    """This rank's queries [1, H, S_l, D] over the whole row's keys and values, gathered from the
    cp ranks, with the split's mask (each query's sample, causal, `window`)."""
    k, v = gather_keys(key, split), gather_keys(value, split)
    q = query
    with torch.autocast(CPU, enabled=False) if q.device.type == CPU else contextlib.nullcontext():
        if q.device.type == CPU:  # as the packed path: the CPU kernels' bf16 backward is slow
            q, k, v = q.float(), k.float(), v.float()
        out = attend(q, k, v, split.mask(window)[None, None], scale, softcap)
    return out.transpose(1, 2).to(query.dtype), None


AttentionInterface.register(NAME, packed_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the fallback path gets sdpa's masks


def implementation(model: torch.nn.Module) -> str | None:
    """The attention implementation of `model`'s language model (a vision-language model's vision
    tower keeps its own, and packed rows never reach it)."""
    config = getattr(model, "config", None)
    if config is not None and vision.runs(config) is not None:
        config = config.text_config
    return getattr(config, "_attn_implementation", None)


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch an sdpa or eager model (and its submodels; a vision-language model's language model
    only) to `packed_attention`; True if it now uses it. Eager models are those whose attention
    sdpa cannot compute (Gemma 2's soft-capping), which `attend` does. Other implementations
    (flash, custom) are left alone."""
    impl = implementation(model)
    if impl == NAME:
        recurrent.wrap(model)
        return True
    if impl not in ("sdpa", "eager"):
        return False
    model.set_attn_implementation({"text_config": NAME} if vision.runs(model.config) is not None else NAME)
    recurrent.wrap(model)  # a hybrid model's recurrent layers read the same layout
    return implementation(model) == NAME
