"""Context parallelism for the trainer ranks: a packed micro-batch row's tokens split over the `cp`
ranks of a dp group, so a sample longer than one device's activations trains.

Each cp rank runs the model on its part of the row (its tokens, their positions for the rotary
embedding): everything but attention is per token. Attention is exact across the split by an
all-gather of keys and values: each rank's queries attend over the whole row's keys and values,
with a mask that keeps each query to its own sample's earlier tokens (a group's shared prompt
included) and its layer's sliding window. The backward sums the keys' and values' gradients
over the ranks (an all-reduce, each rank keeping its part), since every rank's queries read
every rank's keys.

Why an all-gather and not a ring (ring attention passes key/value blocks around the ranks while
computing, overlapping the transfers): the keys and values of a grouped-query model are a small
part of a layer's activations (SmolLM2: 3 of 9 heads, Qwen3-8B: 8 of 32), so gathering them costs
little memory, and one collective per layer with a dense mask handles any packing of samples
(Llama 3 trained its 128k context this way). What grows as S^2 / cp is the mask, and the score
matrix inside attention: for rows of tens of thousands of tokens, FlexAttention's block masks
would be the next step.

Causal attention gives later tokens more keys, so the row (padded to a multiple of 2·cp) is cut
into 2·cp equal chunks and rank r holds chunks r and 2·cp − 1 − r ("zigzag"): every rank gets
the same number of tokens and about the same attention work.

The log-probs and entropies of the response tokens each rank predicts are put on the batch's
[B, R] grid and summed over the cp ranks (`tidal.train.parallel.all_sum`: the gradient passes
unchanged), so every cp rank computes the whole micro-batch's loss, and its backward reaches its
own tokens only: the gradients summed over the ranks (FSDP2 shards over all of them) are the
micro-batch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from tidal.train.attention import PackedLayout


@dataclass(frozen=True)
class ContextSplit:
    """This rank's part of a packed row, and what its queries see.

    `keep` [S_l]: the (padded) row positions this rank computes, in its order.
    `order` [cp · S_l]: the row position of each gathered key (the ranks' `keep`s, rank by rank).
    `visible` [S_l, cp · S_l]: query i sees gathered key m (same sample, not later in the row).
    `query_pos`, `key_pos`: the tokens' positions in their samples, for sliding windows.
    `local_of` [P]: each row position's index in `keep`, -1 where another rank holds it.
    """

    group: object
    rank: int
    size: int
    keep: Tensor
    order: Tensor
    visible: Tensor
    query_pos: Tensor
    key_pos: Tensor
    local_of: Tensor

    def mask(self, window: int | None) -> Tensor:
        """[S_l, cp · S_l] True where a query attends a key, within a sliding `window` if given."""
        if not window:
            return self.visible
        return self.visible & (self.key_pos[None, :] > self.query_pos[:, None] - window)


def zigzag(length: int, size: int) -> tuple[int, list[Tensor]]:
    """(padded length P, each rank's row positions): P the smallest multiple of 2·size ≥ length,
    cut into 2·size chunks; rank r holds chunks r and 2·size − 1 − r."""
    chunk = -(-length // (2 * size))
    cuts = [torch.arange(c * chunk, (c + 1) * chunk) for c in range(2 * size)]
    return 2 * size * chunk, [torch.cat([cuts[r], cuts[2 * size - 1 - r]]) for r in range(size)]


def split_row(position_ids: Tensor, layout: PackedLayout, group) -> ContextSplit:
    """This rank's `ContextSplit` of a packed row ([1, S] `position_ids` and its attention
    `layout`, `tidal.train.attention`) over the ranks of `group`."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = position_ids.device
    s = position_ids.shape[1]
    padded, parts = zigzag(s, size)
    parts = [p.to(device) for p in parts]
    keep, order = parts[rank], torch.cat(parts)
    # which sample each row position belongs to (its query's), and each sample's keys: a shared
    # prompt is a key of every sample of its group
    owner = torch.full((padded,), -1, dtype=torch.long, device=device)
    owner[:s] = torch.div(layout.to_packed, layout.length, rounding_mode="floor")
    member = torch.zeros(layout.batch, padded, dtype=torch.bool, device=device)
    member[torch.arange(layout.batch, device=device).repeat_interleave(layout.length), layout.to_padded] = True
    q_owner = owner[keep]
    visible = member[q_owner.clamp(min=0)][:, order] & (order[None, :] <= keep[:, None])
    # a padding query (past the row) sees itself alone, so its softmax is defined; no real query sees it
    pad = q_owner < 0
    visible[pad] = order[None, :] == keep[pad][:, None]
    pos = torch.zeros(padded, dtype=torch.long, device=device)
    pos[:s] = position_ids[0]
    local_of = torch.full((padded,), -1, dtype=torch.long, device=device)
    local_of[keep] = torch.arange(keep.shape[0], device=device)
    return ContextSplit(group, rank, size, keep, order, visible, pos[keep], pos[order], local_of)


def local_inputs(batch: dict[str, Tensor], split: ContextSplit, pad_id: int) -> tuple[Tensor, Tensor]:
    """(input_ids, position_ids) [1, S_l] of this rank's tokens (padding past the row: `pad_id`
    at position 0)."""
    ids, pos = batch["input_ids"], batch["position_ids"]
    extra = split.local_of.shape[0] - ids.shape[1]
    if extra:
        ids = torch.cat([ids, ids.new_full((1, extra), pad_id)], dim=1)
        pos = torch.cat([pos, pos.new_zeros((1, extra))], dim=1)
    return ids[:, split.keep], pos[:, split.keep]


def local_rows(split: ContextSplit, routed: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """A row's recorded experts [S, layers, k] and their mask [S], cut to this rank's tokens in its
    order (the padding past the row: no record, the model's own routing)."""
    extra = split.local_of.shape[0] - routed.shape[0]
    if extra:
        routed = torch.cat([routed, routed.new_zeros((extra, *routed.shape[1:]))])
        mask = torch.cat([mask, mask.new_zeros(extra)])
    return routed[split.keep], mask[split.keep]


def gather_keys(x: Tensor, split: ContextSplit) -> Tensor:
    """[B, heads, cp · S_l, D]: every rank's keys (or values) [B, heads, S_l, D] in `order`;
    the gradient of each rank's part is summed over the ranks."""
    return _Gather.apply(x, split.group, split.rank, split.size)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, rank: int, size: int) -> Tensor:
        ctx.group, ctx.rank, ctx.n = group, rank, x.shape[2]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter: sum all, keep mine
        return grad[:, :, ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None, None
