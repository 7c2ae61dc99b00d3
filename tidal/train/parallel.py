"""Tensor parallelism for the trainer ranks: each decoder layer's attention and MLP split over the
`tp` dimension of a 2-D device mesh (dp × tp), FSDP2 over `dp` on top.

Megatron's split, with PyTorch's DTensor (`parallelize_module`): q/k/v and gate/up projections
column-parallel (each rank computes its heads and its slice of the MLP width from the whole
input), o and down projections row-parallel (each rank's partial product summed over the tp
ranks, so every rank holds the whole hidden state again). Which module gets which split is the
family's own declaration, transformers' `config.base_model_tp_plan`; this module accepts the
plans made only of `colwise` and `rowwise` (the Llama-like families) and refuses others naming
the style it does not run (per-head q/k norms need their gradients summed over the tp ranks; MoE
experts and GDN projections have styles of transformers' own).

The embeddings, norms and output projection stay whole on every tp rank (FSDP2 shards them over
dp), so each tp rank computes the same logits: log-probs and values are summed over the dp ranks
only, and each dp group of tp ranks takes the same share of a batch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tidal.options import ConfigError

STYLES = ("colwise", "rowwise")


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The family's split of a decoder layer: {module path in the layer: colwise | rowwise}."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    kind = model.config.model_type
    if not plan:
        raise ConfigError(f"cluster.tp_size: {kind} declares no tensor-parallel plan (config.base_model_tp_plan)")
    out = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(
                f"cluster.tp_size: {kind}'s plan splits {pattern} as {style!r}; tidal's tensor parallelism runs "
                f"{' and '.join(STYLES)} splits only (Llama-like families)"
            )
        if not pattern.startswith("layers.*."):
            raise ConfigError(f"cluster.tp_size: {kind}'s plan names {pattern}, outside the decoder layers")
        out[pattern.removeprefix("layers.*.")] = style
    return out


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """Split every decoder layer of `model` over `tp_mesh` by its family's plan (in place)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = tp_plan(model)
    make = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    if not layers:
        raise ConfigError(f"cluster.tp_size: {model.config.model_type} has no decoder layers to split")
    size = tp_mesh.size()
    config = model.config
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % size:
            raise ConfigError(f"cluster.tp_size: {size} does not divide the model's {name} ({value})")
    for layer in layers:
        parallelize_module(layer, tp_mesh, {path: make[style]() for path, style in plan.items()})


def grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The global 2-norm of the parameters' gradients, sqrt(sum_p |g_p|^2), for gradients that
    are DTensors on different meshes (FSDP2 alone over dp for some, dp × tp for others): each
    group of one mesh and placement gets its norm from torch, reduced over that mesh."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if hasattr(g, "device_mesh") else ("local",)
        groups.setdefault(key, []).append(g)
    total = 0.0
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        total += float(norm) ** 2
    return torch.tensor(math.sqrt(total))


def clip_grads(params: list[nn.Parameter], max_norm: float, norm: float) -> None:
    """Scale the gradients by max_norm / norm when the norm is above it (as `clip_grad_norm_`)."""
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
