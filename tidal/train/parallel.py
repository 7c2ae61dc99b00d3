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

The output projection is split by vocabulary rows too (and a tied input embedding with it, as a
vocabulary-parallel embedding whose lookups are summed over the tp ranks), so a rank computes
only its slice of each micro-batch's logits, [T, V / tp]: the log-softmax, the sampled token's
log-prob and the entropy take their maxima and sums over the tp ranks (`VocabSplit`,
`vocab_log_probs_and_entropy`). Norms stay whole on every tp rank (FSDP2 shards them over dp).
Every tp rank ends with the same log-probs: they are summed over the dp ranks only, and each dp
group of tp ranks takes the same share of a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

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


@dataclass(frozen=True)
class VocabSplit:
    """This rank's slice of the vocabulary, [start, start + size), and the tp ranks' group."""

    start: int
    size: int
    group: object


def apply_tp(model: nn.Module, tp_mesh) -> VocabSplit | None:
    """Split every decoder layer of `model` over `tp_mesh` by its family's plan, and its output
    projection (with a tied embedding) by vocabulary rows (in place). Returns this rank's slice
    of the vocabulary, or None for a model without an output projection (the critic's backbone)."""
    from torch.distributed.tensor import Replicate, Shard
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
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    vocab = head.weight.shape[0]
    if vocab % size:
        raise ConfigError(f"cluster.tp_size: {size} does not divide the vocabulary ({vocab} rows of the output)")
    embed = model.get_input_embeddings()
    tied = embed.weight is head.weight
    if tied:  # the lookup of a row-split embedding: each rank's rows, summed over the tp ranks
        parallelize_module(embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    parallelize_module(
        head, tp_mesh, ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=True)
    )
    if tied:  # one parameter again: both split by rows alike
        head.weight = embed.weight
    local = vocab // size
    return VocabSplit(tp_mesh.get_local_rank() * local, local, tp_mesh.get_group())


def vocab_log_probs_and_entropy(
    logits: Tensor, labels: Tensor, split: VocabSplit, temperature: float = 1.0, entropy_grad: bool = True
) -> tuple[Tensor, Tensor]:
    """(log p(labels), entropy) [T] of softmax(z), z = logits / temperature, from this rank's
    slice of the logits [T, V / tp] (`split`), as `tidal.algo.log_probs_and_entropy` computes them
    from the whole: with m = max_v z (over the ranks), S = sum_v exp(z_v - m) (summed over them),

        log p(y) = z_y - m - log S,   H = log S - sum_v p_v (z_v - m).

    The gradient is local to the slice (Megatron's vocabulary-parallel cross entropy):
    d log p(y) / dz_v = [v = y] - p_v, dH / dz_v = -p_v (z_v - m - sum_u p_u (z_u - m))."""
    logp, ent = _VocabLogProbs.apply(logits, labels.long(), split, float(temperature))
    return logp, ent if entropy_grad else ent.detach()


class _VocabLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, split: VocabSplit, temperature: float):
        z = logits.float() / temperature
        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=split.group)
        u = z - m[:, None]
        e = u.exp()
        local = labels - split.start
        mine = (local >= 0) & (local < split.size)
        picked = torch.where(mine, u.gather(-1, local.clamp(0, split.size - 1)[:, None])[:, 0], 0.0)
        sums = torch.stack([e.sum(-1), picked, (e * u).sum(-1)])  # one reduction for the three
        dist.all_reduce(sums, group=split.group)
        total, picked, eu = sums
        p = e / total[:, None]
        mean_u = eu / total  # sum_v p_v (z_v - m)
        ctx.save_for_backward(p, u, mean_u, local, mine)
        ctx.temperature = temperature
        ctx.dtype = logits.dtype
        return picked - total.log(), total.log() - mean_u

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_ent: Tensor):
        p, u, mean_u, local, mine = ctx.saved_tensors
        grad = -p * grad_logp[:, None]
        rows = torch.nonzero(mine)[:, 0]
        grad[rows, local[rows]] += grad_logp[rows]
        if grad_ent is not None:
            grad = grad - p * (u - mean_u[:, None]) * grad_ent[:, None]
        return (grad / ctx.temperature).to(ctx.dtype), None, None, None


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
