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

Without either, the layers keep their activations, but a few cheap ops still keep only their
inputs (`inputs_only`): each RMSNorm keeps its input (not also its normalised row), and each
SwiGLU MLP keeps gate and up, not also act(gate) nor the product act(gate) * up that its down
projection reads; the backward runs those few elementwise ops again from them. On SmolLM2 that is
1,152 + 3,072 of ~10.5k numbers per token and layer, for the cost of the ops, not of a matmul.
"""

from __future__ import annotations

import functools
import types

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from tidal.invariant import recompute_contexts

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


def checkpoint_options(mode: bool | str) -> dict:
    """The keyword arguments transformers' checkpointing passes to `torch.utils.checkpoint` for
    `train.gradient_checkpointing` = `mode`: non-reentrant (transformers' default), the layer
    recomputed under the numerics its forward ran under (`tidal.invariant.recompute_contexts`)."""
    if mode == "selective":
        selective = functools.partial(create_selective_checkpoint_contexts, policy)
        return {"use_reentrant": False, "context_fn": functools.partial(recompute_contexts, selective)}
    return {"use_reentrant": False, "context_fn": recompute_contexts}


def enable(model: torch.nn.Module, mode: bool | str) -> None:
    """Turn on `mode` (a true value of `train.gradient_checkpointing`) on a transformers model."""
    # transformers 5 renamed the method (the old name warns); a model with neither is left as is
    on = getattr(model, "activation_checkpointing_enable", None)
    on = on or getattr(model, "gradient_checkpointing_enable", None)
    if on is not None:
        on(checkpoint_options(mode))


def inputs_only(model: torch.nn.Module) -> dict[str, int]:
    """Have `model`'s RMSNorms and SwiGLU MLPs keep only their inputs for the backward (see the
    module docstring); returns how many of each. An MLP is changed only where its new forward
    gives its own forward's bits on a sample."""
    done = {"norms": 0, "mlps": 0}
    gen = torch.Generator().manual_seed(0)
    for mod in model.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm"):
            mod.forward = types.MethodType(_recomputed(type(mod).forward), mod)
            done["norms"] += 1
        elif name.endswith("MLP") and _swiglu(mod, gen):
            mod.forward = types.MethodType(_swiglu_forward, mod)
            done["mlps"] += 1
    return done


def _recomputed(forward):
    """`forward` (a module's, unbound) keeping only its inputs where autograd records it."""

    def run(self, *args):
        if not torch.is_grad_enabled():
            return forward(self, *args)
        return torch.utils.checkpoint.checkpoint(forward, self, *args, use_reentrant=False)

    return run


def _act_mul(act: torch.nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act(gate) * up


class _SwiGLUDown(torch.autograd.Function):
    """y = down(h), h = act(gate) * up, for a bias-free `down` weight W [D, F], keeping gate and
    up only: the backward makes h again from them (elementwise) for W's gradient, dW = dyᵀ·h, and
    for dh = dy·W, then gate's and up's through act. Each matmul runs as autograd runs
    `F.linear`'s (`mm` on the rows, dW as (hᵀ·dy)ᵀ), so the gradients are autograd's bits."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, act: torch.nn.Module):
        ctx.act = act
        ctx.save_for_backward(gate, up, weight)
        return torch.nn.functional.linear(act(gate) * up, weight)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        with torch.enable_grad():
            g = gate.detach().requires_grad_(ctx.needs_input_grad[0])
            u = up.detach().requires_grad_(ctx.needs_input_grad[1])
            h = ctx.act(g) * u
        rows = dy.reshape(-1, dy.shape[-1])
        dw = h.detach().reshape(-1, h.shape[-1]).t().mm(rows).t() if ctx.needs_input_grad[2] else None
        dh = rows.mm(weight).view(h.shape)
        wanted = [t for t in (g, u) if t.requires_grad]
        got = iter(torch.autograd.grad(h, wanted, dh) if wanted else ())
        dg = next(got) if g.requires_grad else None
        du = next(got) if u.requires_grad else None
        return dg, du, dw, None


def _swiglu_forward(self, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) keeping only gate(x) and up(x) for the backward: the product
    too where `down` is a plain bias-free linear layer outside autocast (`_SwiGLUDown`), else the
    product's input ones (recomputed through torch's checkpoint; `down` keeps the product)."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not torch.is_grad_enabled():
        return self.down_proj(_act_mul(self.act_fn, gate, up))
    down = self.down_proj
    plain = type(down) is torch.nn.Linear and down.bias is None and type(down.weight) is torch.nn.Parameter
    # under autocast the product's matmuls cast their inputs, which a backward of its own would
    # have to repeat; that path keeps torch's checkpoint
    if plain and not torch.is_autocast_enabled(gate.device.type):
        return _SwiGLUDown.apply(gate, up, down.weight, self.act_fn)
    return down(torch.utils.checkpoint.checkpoint(_act_mul, self.act_fn, gate, up, use_reentrant=False))


def _swiglu(mod: torch.nn.Module, gen: torch.Generator) -> bool:
    """Whether `mod` is a gate/up/down MLP whose forward `_swiglu_forward` computes bit for bit."""
    parts = [getattr(mod, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
    weight = getattr(parts[0], "weight", None)
    act = getattr(mod, "act_fn", None)
    if not all(isinstance(p, torch.nn.Module) for p in parts) or not isinstance(act, torch.nn.Module):
        return False
    if not isinstance(weight, torch.Tensor) or weight.is_meta or weight.dim() != 2:
        return False
    x = torch.randn(3, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
    try:
        with torch.no_grad():
            return torch.equal(mod(x), _swiglu_forward(mod, x))
    except Exception:  # a shape or dtype this formula does not take: the module keeps its own
        return False
