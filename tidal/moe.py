"""Mixture-of-experts routing: find a model's routers, record the experts they choose, replay them.

Routing replay (R3): the engine that samples and the trainer that scores can choose different
experts for the same token (tiny numeric differences at near-ties), and then the trainer computes
a policy that did not sample. The engine records each MoE layer's top-k expert indices
(`capture`), the sample carries them (`tidal.types.RoutedExperts`), and the trainer's forward
uses those indices (`replay`) while computing the routing *weights* from its own router logits
with the family's normalisation (`route_weights`), so the router still gets gradients.

In transformers 5 every MoE family has a router module (`layer.mlp.gate`) whose forward takes
the flattened hidden states [T, H] and returns `(router_logits, top_k_weights, top_k_index)`,
[T, E], [T, k], [T, k]. The hooks here read or replace that output; nothing else changes.

    with capture(model) as rec:        # engine
        model(input_ids)
    routing = rec.take()               # [T, moe_layers, k] int16, row t = flattened token t
    with replay(model, routing, mask):  # trainer: forward (and backward) under that routing
        loss = ...; loss.backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import Tensor, nn

from tidal.hardware import CPU
from tidal.types import NO_RECORD, RoutedExperts


def softmax_topk_weights(logits: Tensor, indices: Tensor, normalize: bool, dtype: torch.dtype) -> Tensor:
    """Weights of a softmax top-k router (Qwen2/3-MoE, OLMoE, Mixtral, ...) for experts `indices`:

        p = softmax(logits) in fp32,   w_j = p[e_j],   w_j /= sum_j w_j if `normalize`,

    cast to `dtype` (Qwen casts to the logits' dtype, Mixtral keeps fp32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w = probs.gather(-1, indices)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(dtype)


def sigmoid_group_weights(logits: Tensor, indices: Tensor, normalize: bool, scale: float, eps: float = 1e-20) -> Tensor:
    """Weights of a sigmoid router (DeepSeek-V3, GLM-4.5 MoE: group-limited; LFM2-MoE: eps 1e-6)
    for experts `indices`; the score-correction (expert) bias and the group limit only decide the
    choice, so they do not appear here:

        s = sigmoid(logits),   w_j = s[e_j],   w_j /= (sum_j w_j + eps) if `normalize`,   w_j *= scale
    """
    w = logits.sigmoid().gather(-1, indices)
    if normalize:
        w = w / (w.sum(dim=-1, keepdim=True) + eps)
    return w * scale


def topk_softmax_weights(logits: Tensor, indices: Tensor, dtype: torch.dtype) -> Tensor:
    """Weights of a router that normalises over its chosen experts' logits only (Granite MoE):

    w = softmax([l_{e_1}, ..., l_{e_k}]) in fp32, cast to `dtype`."""
    return torch.softmax(logits.float().gather(-1, indices), dim=-1).to(dtype)


RouteWeights = Callable[[nn.Module, Tensor, Tensor], Tensor]


def _softmax_norm_attr(r: nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
    return softmax_topk_weights(logits, idx, bool(r.norm_topk_prob), logits.dtype)


def _softmax_renorm_cast(r: nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
    return softmax_topk_weights(logits, idx, True, logits.dtype)


def _softmax_renorm_fp32(r: nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
    return softmax_topk_weights(logits, idx, True, torch.float32)


def _sigmoid_eps6(r: nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
    return sigmoid_group_weights(logits, idx, bool(r.norm_topk_prob), r.routed_scaling_factor, 1e-6)


def _topk_softmax(r: nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
    return topk_softmax_weights(logits, idx, r.weight.dtype)


def _sigmoid_group(r: nn.Module, logits: Tensor, idx: Tensor) -> Tensor:
    return sigmoid_group_weights(logits, idx, bool(r.norm_topk_prob), r.routed_scaling_factor)


# Router classes of transformers 5.23 by the normalisation their forward applies, keyed by class
# name (importing every family's modeling file would cost seconds). Each group shares one forward
# source text, character for character (tests/test_moe.py checks it against the installed version).
ROUTE_WEIGHTS: dict[str, RouteWeights] = {
    **dict.fromkeys(
        (
            "Qwen3MoeTopKRouter",
            "Qwen2MoeTopKRouter",
            "Qwen3NextTopKRouter",
            "OlmoeTopKRouter",
            "FlexOlmoTopKRouter",
            "Qwen3OmniMoeThinkerTextTopKRouter",
        ),
        _softmax_norm_attr,
    ),
    **dict.fromkeys(("Qwen3VLMoeTextTopKRouter", "Qwen3_5MoeTopKRouter"), _softmax_renorm_cast),
    **dict.fromkeys(("MixtralTopKRouter", "MiniMaxTopKRouter"), _softmax_renorm_fp32),
    **dict.fromkeys(
        (
            "DeepseekV3TopkRouter",
            "Glm4MoeTopkRouter",
            "Glm4vMoeTextTopkRouter",
            "Glm4MoeLiteTopkRouter",
            "Dots1TopkRouter",
            "ExaoneMoeTopkRouter",
            "SolarOpenTopkRouter",
        ),
        _sigmoid_group,
    ),
    "GraniteMoeHybridTopKRouter": _topk_softmax,
    "Lfm2MoeTopKRouter": _sigmoid_eps6,
}


def _is_router(m: nn.Module) -> bool:
    """A known router class, or a module that looks like one of a family not listed: an integer
    `top_k`, a 2-D `weight` [experts, hidden] and Router or Gate in its class name (found, so that
    replaying it fails naming the class rather than treating the model as dense)."""
    if type(m).__name__ in ROUTE_WEIGHTS:
        return True
    name = type(m).__name__
    weight = getattr(m, "weight", None)
    return (
        isinstance(getattr(m, "top_k", None), int)
        and isinstance(weight, Tensor)
        and weight.dim() == 2
        and ("Router" in name or "Gate" in name)
    )


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE router modules in layer order (module registration order); [] for a dense
    model. Dense layers (DeepSeek's `first_k_dense_replace`, Qwen's `mlp_only_layers`) have none,
    so router i is the i-th MoE layer, not the i-th decoder layer."""
    return [m for m in model.modules() if _is_router(m)]


def routing_shape(model: nn.Module) -> tuple[int, int] | None:
    """(number of MoE layers, top_k) of `model`, None for a dense model."""
    found = routers(model)
    if not found:
        return None
    ks = {int(r.top_k) for r in found}
    if len(ks) != 1:
        raise ValueError(f"routing: the model's routers choose different numbers of experts {sorted(ks)}")
    return len(found), ks.pop()


def _kind(router: nn.Module) -> RouteWeights:
    fn = ROUTE_WEIGHTS.get(type(router).__name__)
    if fn is None:
        raise ValueError(
            f"routing: no routing-weight formula for the router class {type(router).__name__} "
            f"({type(router).__module__}); known: {', '.join(sorted(ROUTE_WEIGHTS))}"
        )
    return fn


def route_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """The routing weights [T, k] `router` gives experts `indices` [T, k] (int64) from its
    `logits` [T, E]: exactly what the router returns (values and dtype) when the indices are its
    own choice. Differentiable in `logits`. Unknown router classes raise ValueError naming them."""
    return _kind(router)(router, logits, indices)


def _supported(model: nn.Module) -> list[nn.Module]:
    found = routers(model)
    for r in found:
        _kind(r)
    return found


class RoutingCapture:
    """What `capture` records: each router's chosen indices per forward, on the model's device."""

    def __init__(self, n_layers: int) -> None:
        self._layers: list[list[Tensor]] = [[] for _ in range(n_layers)]

    def _record(self, layer: int, indices: Tensor) -> None:
        self._layers[layer].append(indices.detach().to(torch.int16))  # an async cast: no host sync

    def take(self) -> Tensor | None:
        """[T, moe_layers, top_k] int16 on the model's device: row t holds the experts every MoE
        layer chose for flattened token t of the forwards run since the last `take` (for an input
        [B, S], token t = b * S + s; several forwards are concatenated in call order), each row in
        the router's own order. Cleared after. None for a dense model or when nothing ran.
        No host synchronisation: the caller copies it to the host once (`routing_record`)."""
        if not self._layers or not self._layers[0]:
            if any(self._layers):
                raise RuntimeError("routing capture: some MoE layers ran and others did not")
            return None
        counts = {len(rows) for rows in self._layers}
        per_layer = [torch.cat(rows) if len(rows) > 1 else rows[0] for rows in self._layers]
        self.clear()
        if len(counts) != 1 or len({t.shape for t in per_layer}) != 1:
            raise RuntimeError(
                "routing capture: the MoE layers routed different numbers of tokens (a forward stopped "
                "part-way, or activations were recomputed); take() after whole forwards only"
            )
        return torch.stack(per_layer, dim=1)

    def clear(self) -> None:
        for rows in self._layers:
            rows.clear()


@contextlib.contextmanager
def capture(model: nn.Module) -> Iterator[RoutingCapture]:
    """Record the experts every router of `model` chooses, for inference forwards (under
    activation checkpointing a recomputed forward would be recorded twice). Hooks are removed on
    exit. Raises ValueError for a router class `route_weights` does not know (its record could
    not be replayed)."""
    found = _supported(model)
    rec = RoutingCapture(len(found))
    handles = [r.register_forward_hook(_capture_hook(rec, i)) for i, r in enumerate(found)]
    try:
        yield rec
    finally:
        for h in handles:
            h.remove()


def _capture_hook(rec: RoutingCapture, layer: int):
    def hook(router: nn.Module, args, out) -> None:
        rec._record(layer, out[2])

    return hook


@contextlib.contextmanager
def replay(model: nn.Module, indices: Tensor, mask: Tensor | None = None) -> Iterator[None]:
    """Run `model`'s forwards (and backwards that recompute activations) with the expert choice of
    `indices` [T, moe_layers, top_k] (any int dtype): each router returns
    `(logits, route_weights(router, logits, chosen), chosen)` with its own logits, so the weights
    and their gradients are the trainer's; `chosen` is `indices[:, layer]`, or the router's own
    choice where `mask` [T] (bool) is False (positions with no record).

    Row t must be flattened token t of every forward run inside (for [B, S] inputs, b * S + s); a
    router that sees another number of tokens raises ValueError. Recorded indices (where `mask`
    is True) must be valid expert ids."""
    found = _supported(model)
    if not found:
        raise ValueError("routing replay: the model has no MoE router")
    n, k = len(found), int(found[0].top_k)
    if indices.dim() != 3 or tuple(indices.shape[1:]) != (n, k):
        raise ValueError(
            f"routing replay: indices must be [tokens, {n} MoE layers, top_k {k}] for this model, "
            f"got {tuple(indices.shape)}"
        )
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (indices.shape[0],)):
        raise ValueError(
            f"routing replay: mask must be bool [{indices.shape[0]}], got {mask.dtype} {tuple(mask.shape)}"
        )
    experts = min(int(r.weight.shape[0]) for r in found)
    ok = (indices >= 0) & (indices < experts)
    if mask is not None:
        ok |= ~mask[:, None, None]
    if not bool(ok.all()):  # one host sync per call: an id out of range would silently drop an expert
        raise ValueError(f"routing replay: recorded expert ids must be in 0..{experts - 1} where the mask is True")
    handles = [r.register_forward_hook(_replay_hook(i, indices, mask)) for i, r in enumerate(found)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _replay_hook(layer: int, indices: Tensor, mask: Tensor | None):
    def hook(router: nn.Module, args, out):
        logits, _, own = out
        if logits.shape[0] != indices.shape[0]:
            raise ValueError(
                f"routing replay: MoE layer {layer} ({type(router).__name__}) routed {logits.shape[0]} tokens but "
                f"the replayed routing has {indices.shape[0]} rows; they must be the forward's flattened tokens"
            )
        chosen = indices[:, layer].to(device=own.device, dtype=own.dtype)
        if mask is not None:
            chosen = torch.where(mask.to(own.device)[:, None], chosen, own)
        return logits, route_weights(router, logits, chosen), chosen

    return hook


def routing_record(indices: Tensor) -> RoutedExperts:
    """A `RoutedExperts` from [positions, moe_layers, top_k] integer indices (`NO_RECORD` for
    positions without a record); one copy to the host."""
    if indices.dim() != 3:
        raise ValueError(f"routing record: indices must be [positions, layers, top_k], got {tuple(indices.shape)}")
    host = indices.detach().to(device=CPU, dtype=torch.int16).contiguous().numpy()
    return RoutedExperts(tuple(host.shape), host.astype("<i2", copy=False).tobytes())


def routing_tensor(record: RoutedExperts) -> Tensor:
    """The [positions, moe_layers, top_k] int16 host tensor of a `RoutedExperts`."""
    arr = np.frombuffer(record.data, dtype="<i2").astype(np.int16)  # a writable copy in native order
    return torch.from_numpy(arr).view(record.shape)


__all__ = [
    "NO_RECORD",
    "ROUTE_WEIGHTS",
    "RoutingCapture",
    "capture",
    "replay",
    "route_weights",
    "routers",
    "routing_record",
    "routing_shape",
    "routing_tensor",
    "sigmoid_group_weights",
    "softmax_topk_weights",
]
