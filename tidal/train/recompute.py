"""Activation checkpointing of the decoder layers (`train.gradient_checkpointing`).

- `full` (or `true`): a layer keeps only its input; the backward runs its whole forward again,
  matmuls included (about a third more compute for the step).
- `selective`: a layer keeps what its matmuls and attention kernels produced and recomputes only
  the cheap ops between them (norms, rotary, activation, products, residual sums, gathers) from
  those. The backward sees the same values as without checkpointing, so the step is the same to
  the bit, and a layer holds the matmul outputs (q, k, v, attention, o, gate, up, down) instead of
  every intermediate: on SmolLM2 about 6.3k of ~10.5k numbers per token and layer.

Both go through transformers' per-layer checkpointing with torch's non-reentrant
`torch.utils.checkpoint`; `selective` passes a `context_fn` made by
`create_selective_checkpoint_contexts` with `policy`.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# ops whose outputs a `selective` layer keeps: the matmuls and attention kernels (the step's cost)
SAVED_OPS = frozenset(
    op
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_grouped_mm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(_aten, name)
    for op in [getattr(_aten, name).default]
)


def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep a matmul's or an attention kernel's output; recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_options(mode: bool | str) -> dict | None:
    """The keyword arguments transformers' checkpointing passes to `torch.utils.checkpoint` for
    `train.gradient_checkpointing` = `mode` (None: transformers' own, for `full`)."""
    if mode == "selective":
        return {"use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}
    return None


def enable(model: torch.nn.Module, mode: bool | str) -> None:
    """Turn on `mode` (a true value of `train.gradient_checkpointing`) on a transformers model."""
    # transformers 5 renamed the method (the old name warns); a model with neither is left as is
    on = getattr(model, "activation_checkpointing_enable", None)
    on = on or getattr(model, "gradient_checkpointing_enable", None)
    if on is not None:
        on(checkpoint_options(mode))
