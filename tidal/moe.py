"""MoE routers of a transformers model: find them and record the experts they choose.

(A first cut for the engine; routing replay extends it.)"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules (`mlp.gate` returning logits, weights, indices) in layer order."""
    return [m for n, m in model.named_modules() if n.endswith("mlp.gate") and hasattr(m, "top_k")]


def routing_shape(model: torch.nn.Module) -> tuple[int, int] | None:
    """(MoE layers, experts per token), or None for a dense model."""
    found = routers(model)
    return (len(found), found[0].top_k) if found else None


class Routing:
    """What `capture` recorded: each router's chosen experts, in call order."""

    def __init__(self) -> None:
        self.chosen: list[torch.Tensor] = []

    def take(self) -> torch.Tensor:
        """[tokens, MoE layers, top-k] expert ids of the last forward."""
        return torch.stack(self.chosen, 1)


@contextlib.contextmanager
def capture(model: torch.nn.Module) -> Iterator[Routing]:
    """Record the experts every router of `model` chooses while the block runs."""
    rec = Routing()
    hooks = [r.register_forward_hook(lambda m, i, o: rec.chosen.append(o[2])) for r in routers(model)]
    try:
        yield rec
    finally:
        for h in hooks:
            h.remove()
