"""LoRA on the trained model, through `peft`: adapters on chosen linear layers, the base weights
frozen.

A targeted linear layer computes `y = W x + s · B (A x)` with `A` [r, in], `B` [out, r] and the
scale `s = lora_alpha / r`; `B` starts at zero, so step 0 is the base model exactly. Only `A`
and `B` are trained (the optimizer holds their state alone), and:

- the reference policy is the same model with the adapters switched off (`adapters_off`): no
  second copy of the weights for the KL;
- an engine gets `W' = W + s · B A` for each targeted matrix (`merged_weights`), under the base
  model's own parameter names, so every engine and transport takes it as it takes a full model,
  and a sync of what changed moves the targeted matrices only;
- checkpoints and exports hold the adapter as a `peft` adapter folder (`save_adapter`), which
  `peft.PeftModel.from_pretrained` loads.

The adapters are injected in place (`peft.inject_adapter_in_model`): the model stays the
transformers model it was, so packing, chunked logits and FSDP2 see the module tree they know.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

from tidal import recurrent, vision
from tidal.train.options import TrainConfig

ADAPTER = "default"  # peft's adapter name; tidal trains one adapter
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # how a PeftModel's saved adapter names the wrapped model's modules


class LoraError(ValueError):
    """A LoRA option or adapter folder that cannot be used; the message says what was expected."""


def enabled(cfg: TrainConfig) -> bool:
    return cfg.lora_rank > 0


def linear_names(model: torch.nn.Module) -> list[str]:
    """The short names (last path part) of the model's linear layers, the output projection aside."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted(
        {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    )


def expert_names(model: torch.nn.Module) -> set[str]:
    """Target names that peft (0.21, transformers 5) maps onto an MoE block's fused expert tensors
    ([experts, out, in] parameters such as `gate_up_proj`, `down_proj`) instead of linear layers:
    the tensors' own names, and for a fused `gate_up_proj` also `gate_proj` and `up_proj`."""
    fused = {n.rpartition(".")[2] for n, p in model.named_parameters() if p.dim() == 3 and ".experts." in n}
    if "gate_up_proj" in fused:
        fused |= {"gate_proj", "up_proj"}
    return fused


def lora_config(cfg: TrainConfig, model: torch.nn.Module):
    """The `peft.LoraConfig` of `train.lora_*`; a target that names no linear layer of `model` is a
    LoraError that lists the ones it has."""
    from peft import LoraConfig

    targets = cfg.lora_target_modules
    have = linear_names(model)
    experts = expert_names(model)
    if targets == "all-linear":
        # named here rather than by peft's "all-linear", which also wraps an MoE block's fused
        # expert tensors (no matrices tidal can merge for an engine) and the Mamba-2 mixers'
        # out_proj (read directly by their fused training kernel)
        skip = recurrent.lora_excluded(model) | experts
        targets = [n for n in have if n not in skip]
    fused = [t for t in targets if t in experts]
    if fused:
        raise LoraError(
            f"train.lora_target_modules: {', '.join(map(repr, fused))} would adapt the model's fused expert "
            "tensors (peft maps those names onto them), which tidal cannot merge into an engine's weights; "
            "leave them out (all-linear does)"
        )
    missing = [t for t in targets if t not in have]
    if missing:
        raise LoraError(
            f"train.lora_target_modules: {', '.join(map(repr, missing))} name no linear layer of the model; "
            f"its linear layers are {', '.join(have)} (or use all-linear)"
        )
    if vision.runs(model.config) is not None:  # a vision-language model: its language model's layers only
        language = {id(m) for m in model.get_decoder().modules()}
        wanted = set(targets)
        targets = sorted(
            n
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m) in language and n.rpartition(".")[2] in wanted
        )
    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(targets),
        bias="none",
    )


def apply_lora(
    model: torch.nn.Module, cfg: TrainConfig, adapter: str | Path | None = None, trainable: Sequence[str] = ()
) -> None:
    """Inject LoRA adapters into `model` in place and freeze everything else, except the modules
    named in `trainable` (the critic's value head), which get no adapter and train whole. With
    `adapter` (a folder `save_adapter` or peft wrote), the adapters start from its weights."""
    from peft import inject_adapter_in_model

    config = lora_config(cfg, model)
    if trainable:
        config.exclude_modules = list(trainable)
    # A's random init from train.seed alone: every trainer rank (and a rerun) starts the same
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        if name.partition(".")[0] in trainable:
            p.requires_grad_(True)
    if adapter is not None:
        load_adapter(model, adapter)


def mirror(engine_model: torch.nn.Module, trained: torch.nn.Module) -> None:
    """Give `engine_model` (the base model, as an engine loaded it) the LoRA layers `trained`
    has, under the same names, so it can take `trained`'s tensors as they are."""
    from peft import inject_adapter_in_model

    if has_lora(engine_model):
        return
    config = copy.deepcopy(trained.peft_config[ADAPTER])
    inject_adapter_in_model(config, engine_model, adapter_name=ADAPTER)
    engine_model.requires_grad_(False)


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's LoRA layers by module path."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_lora(model: torch.nn.Module) -> bool:
    return bool(lora_layers(model))


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """The base model inside the block: every LoRA layer computes `W x` alone (peft's switch;
    the adapters' `requires_grad` comes back on exit)."""
    layers = list(lora_layers(model).values())
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)


def scalings(model: torch.nn.Module) -> dict[str, tuple[float, bool]]:
    """(scale `s`, whether the layer stores its weight transposed) of each LoRA layer by path."""
    return {
        path: (m.scaling[ADAPTER], bool(getattr(m, "fan_in_fan_out", False))) for path, m in lora_layers(model).items()
    }


@torch.no_grad()
def merge_named(
    named: Iterable[tuple[str, Tensor]], scales: dict[str, tuple[float, bool]], changed_only: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """The weights of a model with LoRA layers (`named`: its parameters in `named_parameters`
    order, full tensors) under the base model's names, each targeted matrix merged:
    `W' = W + s · B A` (transposed for a layer that stores `W` transposed). `changed_only`: only
    the merged matrices, the weights a step of training changes."""
    held: dict[str, dict[str, Tensor]] = {}
    for name, t in named:
        if ".lora_A." in name or ".lora_B." in name:
            path, _, rest = name.partition(".lora_")
            held.setdefault(path, {})[rest[0]] = t
        else:
            owner, _, leaf = name.rpartition(".")
            path = owner.removesuffix(".base_layer")
            if path == owner or path not in scales:
                if not changed_only:
                    yield name, t
                continue
            if leaf != "weight":
                if not changed_only:
                    yield f"{path}.{leaf}", t
                continue
            held.setdefault(path, {})["W"] = t
        parts = held.get(path, {})
        if len(parts) == 3:  # the base weight and both factors: merge
            del held[path]
            scale, transposed = scales[path]
            delta = (parts["B"].float() @ parts["A"].float()) * scale
            w = parts["W"]
            yield f"{path}.weight", w + (delta.T if transposed else delta).to(w.dtype)
    if held:
        raise RuntimeError(f"LoRA layers without their base weight or a factor: {sorted(held)[:3]}")


def base_name(name: str) -> str:
    """A parameter's name in the base model (`...q_proj.base_layer.weight` → `...q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def adapter_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The adapter's tensors in peft's saved form (`base_model.model.<module>.lora_A.weight`),
    full tensors (on FSDP2 ranks a collective: every rank must call it)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    return {PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in full.items()}


def save_adapter(
    model: torch.nn.Module,
    cfg: TrainConfig,
    folder: str | Path,
    base: str | Path | None,
    state: dict[str, Tensor] | None = None,
) -> None:
    """Write the adapter (`state`, else `adapter_state(model)`) as a peft adapter folder:
    `adapter_config.json` naming the `base` model, and `adapter_model.safetensors`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # the config the adapters were made with: `lora_config` checks target names against the
    # model's plain linear layers, which the targets no longer are once they hold adapters
    made = getattr(model, "peft_config", {}).get(ADAPTER)
    config = copy.deepcopy(made) if made is not None else lora_config(cfg, model)
    config.base_model_name_or_path = None if base is None else str(base)
    config.inference_mode = True
    config.save_pretrained(str(folder))
    state = adapter_state(model) if state is None else state
    save_file(state, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def is_adapter(folder: str | Path | None) -> bool:
    return folder is not None and (Path(folder) / ADAPTER_CONFIG).is_file()


def read_adapter(folder: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """(adapter_config.json, the adapter's tensors keyed as peft saves them) of an adapter folder;
    LoraError names the file when either cannot be read."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LoraError(f"{folder / ADAPTER_CONFIG}: cannot read the adapter's config ({e})") from None
    try:
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    except Exception as e:  # safetensors raises its own error types
        raise LoraError(f"{folder / ADAPTER_WEIGHTS}: cannot read the adapter's weights ({e})") from None
    return config, tensors


def load_adapter(model: torch.nn.Module, folder: str | Path) -> None:
    """Set the model's adapters from a peft adapter folder. Its rank and targets must be the
    model's: LoraError names what differs, and which tensors are missing or left over."""
    from peft import set_peft_model_state_dict

    config, tensors = read_adapter(folder)
    have = adapter_state(model)
    given = {k if k.startswith(PEFT_PREFIX) else PEFT_PREFIX + k: v for k, v in tensors.items()}
    where = Path(folder) / ADAPTER_WEIGHTS
    missing, extra = sorted(have.keys() - given.keys()), sorted(given.keys() - have.keys())
    if missing or extra:
        raise LoraError(
            f"{where}: the adapter does not fit the model's LoRA layers (train.lora_target_modules "
            f"{config.get('target_modules')!r} in the folder); missing {missing[:3]}, not in the model {extra[:3]}"
        )
    for k, v in given.items():
        if v.shape != have[k].shape:
            raise LoraError(
                f"{where}: {k} has shape {tuple(v.shape)}, the model's is {tuple(have[k].shape)} "
                f"(the folder's rank is {config.get('r')})"
            )
    plain = {k.removeprefix(PEFT_PREFIX): v for k, v in given.items()}
    set_peft_model_state_dict(model, plain, adapter_name=ADAPTER)
