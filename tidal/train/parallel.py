"""Tensor parallelism for the trainer ranks: each decoder layer's attention and MLP split over the
`tp` dimension of a 2-D device mesh (dp × tp), FSDP2 over `dp` on top.

Megatron's split, with PyTorch's DTensor (`parallelize_module`): q/k/v and gate/up projections
column-parallel (each rank computes its heads and its slice of the MLP width from the whole
input), o and down projections row-parallel (each rank's partial product summed over the tp
ranks, so every rank holds the whole hidden state again). Which module gets which split is the
family's own declaration, transformers' `config.base_model_tp_plan`; tidal runs these of its
styles and refuses a plan with another, naming it:

- `colwise`, `rowwise`: as above; `colwise_gather_output` (a column split whose output is gathered
  whole on every rank: fused q/k/v or gate/up projections, GDN's input projections) and
  `rowwise_split_input` (a row split of a whole input, each rank taking its slice).
- `replicated_with_grad_allreduce` (Qwen3's per-head q/k norms): the weight stays whole on every
  tp rank, but each rank normalises only its heads, so its gradient is a partial sum; the ranks'
  gradients are summed before the optimizer step (`sum_replicated_grads`).
- `moe_tp_experts`: expert parallelism. Each tp rank holds num_experts / tp whole experts (the
  fused [E, ...] tensors split on their first dimension); every rank routes every token with the
  whole router, computes the tokens' outputs of its own experts only (the others' slots get
  transformers' expert-parallel sentinel id, which every experts implementation skips) and the
  outputs are summed over the ranks. In the backward the gradients of the experts' input and of
  the routing weights are summed over the ranks, as each rank's covers its experts only; then the
  router's gradient is whole on every rank. The plan's entries for the expert tensors themselves
  (`packed_colwise`, `rowwise`: transformers splits each expert's width instead) are not used.
- `embedding_rowwise` (the input embedding): tidal's own rule below decides.

The output projection is split by vocabulary rows too (and a tied input embedding with it, as a
vocabulary-parallel embedding whose lookups are summed over the tp ranks), so a rank computes
only its slice of each micro-batch's logits, [T, V / tp]: the log-softmax, the sampled token's
log-prob and the entropy take their maxima and sums over the tp ranks (`VocabSplit`,
`vocab_log_probs_and_entropy`). Norms stay whole on every tp rank (FSDP2 shards them over dp).
Every tp rank ends with the same log-probs: they are summed over the dp ranks only, and each dp
group of tp ranks takes the same share of a batch.
"""

from __future__ import annotations

import inspect
import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tidal.options import ConfigError

# DTensor's column and row splits, and the two forms whose other side is whole on every rank
SPLITS = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")
REPLICATED = "replicated_with_grad_allreduce"
EXPERTS = "moe_tp_experts"
EMBEDDING = "embedding_rowwise"  # the input embedding: split with the output projection when tied
STYLES = (*SPLITS, REPLICATED, EXPERTS, EMBEDDING)

# modules whose weights are whole on every tp rank but get a partial gradient there: their tp group
_GRAD_SUMMED: weakref.WeakKeyDictionary[nn.Module, object] = weakref.WeakKeyDictionary()


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The family's split of a decoder layer: {module path in the layer: one of `STYLES`}."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    kind = model.config.model_type
    if not plan:
        raise ConfigError(f"cluster.tp_size: {kind} declares no tensor-parallel plan (config.base_model_tp_plan)")
    experts = [p for p, style in plan.items() if style == EXPERTS]
    out = {}
    for pattern, style in plan.items():
        if any(pattern.startswith(e + ".") for e in experts):
            continue  # an expert tensor's own split: tidal splits whole experts instead
        if style not in STYLES:
            raise ConfigError(
                f"cluster.tp_size: {kind}'s plan splits {pattern} as {style!r}; tidal's tensor parallelism runs "
                f"the {', '.join(STYLES)} styles only"
            )
        if style == EMBEDDING and pattern == "embed_tokens":
            continue  # tidal's rule: split by rows with a tied output projection, else whole
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
    make = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        # each rank computes its columns, then they are gathered (the module's output is whole)
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        # a whole input, each rank taking its slice of it: the partial products summed
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    group = tp_mesh.get_group()
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
        # a family's plan covers every kind of layer (dense and MoE MLPs, attention and linear
        # attention): each layer takes the entries it has
        mine = {path: style for path, style in plan.items() if _has(layer, path)}
        parallelize_module(layer, tp_mesh, {path: make[style]() for path, style in mine.items() if style in SPLITS})
        for path, style in mine.items():
            if style == REPLICATED:
                _GRAD_SUMMED[layer.get_submodule(path)] = group
            elif style == EXPERTS:
                split_experts(layer.get_submodule(path), tp_mesh)
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


def _has(layer: nn.Module, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


def split_experts(experts: nn.Module, tp_mesh) -> None:
    """Expert parallelism for transformers' fused experts module (`num_experts` experts in [E, ...]
    tensors, forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])), in place:
    this rank keeps experts [start, start + E / tp) as the local shard of each tensor (DTensor,
    Shard(0)), and its forward computes with those only,

        y = sum_{tp ranks r} sum_{j : e_j in r's experts} w_j expert_{e_j}(x),

    the hidden states and the routing weights entering through `_GradSummed` (each rank's gradient
    covers its experts; the sum is the whole one) and the output leaving through `_Summed`."""
    from torch.distributed.tensor import Shard, distribute_tensor

    size = tp_mesh.size()
    total = experts.num_experts
    if total % size:
        raise ConfigError(f"cluster.tp_size: {size} does not divide the model's {total} experts")
    local = total // size
    start = tp_mesh.get_local_rank() * local
    group = tp_mesh.get_group()
    names = [name for name, _ in experts.named_parameters(recurse=False)]
    for name in names:
        p = getattr(experts, name)
        experts.register_parameter(name, nn.Parameter(distribute_tensor(p.data, tp_mesh, [Shard(0)]), p.requires_grad))
    # transformers' grouped and batched implementations mask the sentinel's rows only when told
    # (their kernels leave those rows unwritten)
    experts._is_expert_parallel = True
    forward = experts.forward
    bind = inspect.signature(forward).bind

    def local_forward(*args, **kwargs):
        call = bind(*args, **kwargs)
        hidden, index, weights = call.args[:3]
        index = index - start
        mine = (index >= 0) & (index < local)
        index = torch.where(mine, index, local)  # the sentinel id transformers' implementations skip
        weights = torch.where(mine, _GradSummed.apply(weights, group), 0.0)
        params = experts._parameters
        whole = {name: params[name] for name in names}
        for name in names:  # the forward indexes its experts' tensors: the local shards, as plain tensors
            params[name] = whole[name].to_local()
        experts.num_experts = local
        try:
            out = forward(_GradSummed.apply(hidden, group), index, weights, *call.args[3:], **call.kwargs)
        finally:
            params.update(whole)
            experts.num_experts = total
        return _Summed.apply(out, group)

    experts.forward = local_forward


def all_sum(x: Tensor, group) -> Tensor:
    """x summed over the ranks of `group`, its gradient passed to each rank as it is: for a value
    every rank then uses alike (each rank's part reaches its own inputs only)."""
    return _Summed.apply(x, group)


class _Summed(torch.autograd.Function):
    """x summed over the tp ranks; the gradient (the same on each) passes as it is."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GradSummed(torch.autograd.Function):
    """x as it is; its gradient (each tp rank's part) summed over the tp ranks."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_replicated_grads(model: nn.Module) -> None:
    """Sum over the tp ranks the gradients of the weights that are whole on each of them but were
    used on its part of the heads (`replicated_with_grad_allreduce`): called once per optimizer
    step, after the micro-batches' backward (the sum is linear, so FSDP2's reduction over dp may
    come first)."""
    for module in model.modules():
        group = _GRAD_SUMMED.get(module)
        if group is None:
            continue
        for p in module.parameters(recurse=False):
            if p.grad is not None:
                dist.all_reduce(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad, group=group)


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
