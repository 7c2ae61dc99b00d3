"""Loading new weights into an engine's model: by name from tensors, or from a safetensors folder."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch


@torch.no_grad()
def load_named_tensors(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], share: bool = False) -> None:
    """Copy tensors into `model`'s parameters and buffers by name (cast to their dtype).

    `share`: a parameter given a tensor of its own dtype and shape takes that tensor's storage
    instead of a copy (an in-process engine beside its trainer: no second copy of the weights, and
    the trainer's in-place updates need no copy at sync). Only for an engine that never generates
    while the trainer updates. A tensor that already is the parameter's storage is not copied.
    Every parameter must be given, except an output projection tied to the input embedding (it
    appears under one name only): a missing tensor would leave the engine on stale weights.
    """
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    seen = set()
    for name, tensor in named:
        if name not in params:
            raise KeyError(f"update_weights: engine model has no parameter {name!r}")
        target = params[name]
        if target.data_ptr() == tensor.data_ptr() and target.dtype == tensor.dtype:
            pass  # already shared
        elif (
            share
            and isinstance(target, torch.nn.Parameter)
            and (target.dtype, target.shape)
            == (
                tensor.dtype,
                tensor.shape,
            )
        ):
            target.data = tensor.detach()
        else:
            target.copy_(tensor)
        seen.add(name)
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = {n for n, _ in model.named_parameters()} - seen
    missing = {n for n in missing if not (tied and n == "lm_head.weight")}
    if missing:
        raise KeyError(f"update_weights: no tensor given for {sorted(missing)[:5]}")


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in a folder saved by `save_pretrained`."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"update_weights_from_disk: no *.safetensors in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors
