"""Images in prompts: what the engine and the trainer need to run a vision-language model.

A prompt with images is its token ids, in which each image stands as a run of placeholder tokens
(the model's `image_token_id`, as its processor expanded them), plus one `Image` per image in
order: the tensors its image processor made. The model's vision tower turns an image into one
feature row per placeholder (`features`), and those rows replace the placeholders' embeddings
before the language model runs (`merge`); every family here merges the same way, in order.

Positions: most families number an image's placeholders like text. Qwen2-VL and Qwen2.5-VL
(`Family.mrope`) give each token three rotary positions (temporal, height, width): an image's
tokens take their place in its grid, and the text after it continues from the image's largest
position + 1, so from then on every position is the token's index plus one offset per sequence
(`rope_positions` returns both); decoding continues with that offset.

Images are keyed by their content (`Image.digest`, a SHA-256 of the processed tensors): the
engine's prefix cache and its twin detection see an image's placeholders as that key
(`token_keys`), so a group's samples share one image's K/V and two different images of the same
size never do.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Family:
    """What a vision-language family's engine and trainer need beyond its language model."""

    inputs: tuple[str, ...]  # the image processor's outputs its vision tower reads
    mrope: bool = False  # Qwen's 3-D rotary positions
    # Qwen3-VL: features of some vision layers are also added to the hidden states at the image
    # tokens after each of the first language layers (`visual_pos_masks`, `deepstack_visual_embeds`)
    deepstack: bool = False
    # Gemma 3: an image's tokens attend to each other both ways (each still sees every earlier
    # token, and a sliding window still hides those too far back); text attends causally
    bidirectional: bool = False


# model_type of the whole (vision + language) model -> its family
FAMILIES: dict[str, Family] = {
    "llava": Family(("pixel_values", "image_sizes")),
    "idefics3": Family(("pixel_values", "pixel_attention_mask")),
    "smolvlm": Family(("pixel_values", "pixel_attention_mask")),
    "qwen2_vl": Family(("pixel_values", "image_grid_thw"), mrope=True),
    "qwen2_5_vl": Family(("pixel_values", "image_grid_thw"), mrope=True),
    "qwen3_vl": Family(("pixel_values", "image_grid_thw"), mrope=True, deepstack=True),
    "qwen3_vl_moe": Family(("pixel_values", "image_grid_thw"), mrope=True, deepstack=True),
    "gemma3": Family(("pixel_values",), bidirectional=True),
}


class UnsupportedVisionModel(ValueError):
    """A vision-language model these paths do not run; the message says why."""


def family(config) -> Family | None:
    """The vision-language family of a model config, None for a text-only model; raises
    `UnsupportedVisionModel` for a vision-language model that is not run."""
    kind = getattr(config, "model_type", None)
    if kind in FAMILIES:
        return FAMILIES[kind]
    if getattr(config, "vision_config", None) is not None:
        raise UnsupportedVisionModel(
            f"{kind}: a vision-language model; the families run with images are {', '.join(FAMILIES)}"
        )
    return None


def runs(config) -> Family | None:
    """The family of a config these paths run with images, None for any other (a text model, or a
    vision-language model trained and served without images); never raises, unlike `family`."""
    return FAMILIES.get(getattr(config, "model_type", None))


def folder_family(path: str | Path) -> Family | None:
    """The family of a Hugging Face model folder's config.json (None: not one of `FAMILIES`)."""
    cfg = Path(path) / "config.json"
    return FAMILIES.get(json.loads(cfg.read_text()).get("model_type")) if cfg.is_file() else None


def load_pretrained(path: str | Path, dtype: torch.dtype) -> nn.Module:
    """The model of a Hugging Face folder: a vision-language model of `FAMILIES` whole (vision
    tower, projector, language model and head); any other as transformers' causal LM of its type
    (for some vision-language types, such as Qwen3.5's, that is their language model)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if folder_family(path) is not None else AutoModelForCausalLM
    return auto.from_pretrained(str(path), dtype=dtype)


def language_config(config):
    """The language model's config: `text_config` of a vision-language model, else `config`."""
    return config.text_config if family(config) is not None else config


def image_token(config) -> int:
    """The placeholder token id an image's features replace."""
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if not isinstance(token, int):
        raise UnsupportedVisionModel(f"{config.model_type}: the config names no image_token_id")
    return token


@dataclass(frozen=True, eq=False)
class Image:
    """One image as its model's image processor made it: the tensors for this image alone (the
    processor's batch of one), and a SHA-256 of them that keys it. `source`: the encoded file it
    was read from (PNG, JPEG...), what is sent to a served engine, whose processor reads it again
    (empty where it was not kept)."""

    tensors: dict[str, Tensor]
    digest: str
    source: bytes = b""

    @classmethod
    def of(cls, tensors: dict[str, Tensor], source: bytes = b"") -> Image:
        h = hashlib.sha256()
        for name in sorted(tensors):
            t = tensors[name].detach().cpu().contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return cls(dict(tensors), h.hexdigest(), bytes(source))

    def to_dict(self) -> dict:
        """JSON-ready: each tensor as dtype, shape and base64 bytes."""
        tensors = {
            k: {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "data": base64.b64encode(t.contiguous().view(torch.uint8).numpy().tobytes()).decode("ascii"),
            }
            for k, t in self.tensors.items()
        }
        out = {"digest": self.digest, "tensors": tensors}
        if self.source:
            out["source"] = base64.b64encode(self.source).decode("ascii")
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Image:
        tensors = {}
        for k, t in d["tensors"].items():
            raw = bytearray(base64.b64decode(t["data"]))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
            tensors[k] = flat.view(getattr(torch, t["dtype"])).reshape(t["shape"])
        image = cls.of(tensors, base64.b64decode(d.get("source", "")))
        if image.digest != d["digest"]:
            raise ValueError(f"image {d['digest'][:12]}: its tensors do not give its digest (corrupted)")
        return image

    def data_uri(self) -> str:
        """`source` as a data: URI (what a served engine's `/generate` takes in `image_data`)."""
        if not self.source:
            raise ValueError(f"image {self.digest[:12]}: its file was not kept; a served engine cannot be sent it")
        return "data:application/octet-stream;base64," + base64.b64encode(self.source).decode("ascii")

    @property
    def key(self) -> int:
        """The prefix cache's stand-in for each of this image's placeholder tokens: a negative
        number (no token id is) from the digest."""
        return -1 - int(self.digest[:15], 16)


def batch(images: list[Image], names: tuple[str, ...]) -> dict[str, Tensor]:
    """The images' tensors as one processor batch: concatenated along the first dimension (the
    images of Qwen's patch rows, llava's pixel batch, Idefics3's batch of tiled images)."""
    out = {}
    for name in names:
        parts = [im.tensors[name] for im in images if name in im.tensors]
        if parts:
            out[name] = torch.cat(parts) if len(parts) > 1 else parts[0]
    return out


def features(model: nn.Module, fam: Family, image: Image) -> Tensor:
    """One image's feature rows [placeholders, 1 + deepstack layers, hidden]: the model's vision
    tower and projector, as its own forward runs them (`get_image_features`); row [:, 0] replaces
    the placeholders' embeddings, [:, 1 + k] is added after language layer k (`Family.deepstack`)."""
    inner = model.model if hasattr(model, "model") else model
    param = next(inner.parameters())
    kw = {
        k: (v.to(param.device, param.dtype) if v.is_floating_point() else v.to(param.device))
        for k, v in batch([image], fam.inputs).items()
    }
    out = inner.get_image_features(**kw)
    rows = [_flat(out.pooler_output)]
    if fam.deepstack:
        rows += [_flat(layer) for layer in out.deepstack_features]
    return torch.stack(rows, dim=1)


def _flat(parts) -> Tensor:
    """Feature rows [n, hidden] of a tensor or a list of them (per image or tile)."""
    parts = parts if isinstance(parts, (list, tuple)) else [parts]
    return torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])


def placeholders(ids: list[int], token: int) -> list[int]:
    """Indices of the image placeholder tokens in `ids`."""
    return [i for i, t in enumerate(ids) if t == token]


def image_blocks(where: list[int]) -> list[tuple[int, int]]:
    """The contiguous runs [a, b) of the sorted indices `where`: one per image (a family whose
    image tokens attend both ways keeps text between two images, as Gemma 3's begin and end of
    image tokens; transformers groups them the same way)."""
    out: list[tuple[int, int]] = []
    for i in where:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def within_images(mask: Tensor, first: int, blocks: list[tuple[int, int]], window: int | None = None) -> Tensor:
    """A causal `mask` [queries, keys] (query i at position `first` + i, key j at position j)
    with each image's tokens also seeing that image's later tokens (`Family.bidirectional`), less
    those a sliding `window` hides (a query at position i sees keys j > i - window), as transformers
    composes Gemma 3's masks: window AND (causal OR same image). `blocks`: the images' runs [a, b)
    of positions. Changes and returns `mask`."""
    for a, b in blocks:
        q0, q1 = max(a, first), min(b, first + mask.shape[0])
        if q0 >= q1:
            continue
        seen = torch.ones(q1 - q0, b - a, dtype=torch.bool, device=mask.device)
        if window:
            qpos = torch.arange(q0, q1, device=mask.device)[:, None]
            seen &= torch.arange(a, b, device=mask.device)[None, :] > qpos - window
        mask[q0 - first : q1 - first, a:b] |= seen
    return mask


def check_counts(where: list[int], counts: list[int], what: str) -> None:
    """Raise ValueError (naming `what`) unless the images fill exactly the placeholders."""
    if sum(counts) != len(where):
        raise ValueError(
            f"{what}: the prompt has {len(where)} image placeholder tokens; its {len(counts)} image(s) "
            f"give {sum(counts)} feature rows ({', '.join(map(str, counts)) or 'none'})"
        )


def token_keys(ids: list[int], where: list[int], counts: list[int], images: list[Image]) -> list[int]:
    """`ids` with each image's placeholders replaced by the image's `key` (what the prefix cache
    hashes and compares)."""
    keys = list(ids)
    n = 0
    for image, count in zip(images, counts, strict=True):
        for i in where[n : n + count]:
            keys[i] = image.key
        n += count
    return keys


def rope_positions(model: nn.Module, ids: list[int], where: list[int], images: list[Image]) -> tuple[Tensor, int]:
    """Qwen's 3-D positions of a prompt [3, len(ids)] and the offset of every later position
    (token index + offset in all three), from the model's own `get_rope_index`."""
    inner = model.model if hasattr(model, "model") else model
    input_ids = torch.tensor([ids])
    kinds = torch.zeros_like(input_ids, dtype=torch.int32)
    kinds[0, where] = 1
    grid = batch(images, ("image_grid_thw",)).get("image_grid_thw")
    pos, delta = inner.get_rope_index(input_ids, mm_token_type_ids=kinds, image_grid_thw=grid)
    return pos[:, 0], int(delta.reshape(-1)[0])


def merge(model: nn.Module, ids: Tensor, at: Tensor, rows: Tensor) -> Tensor:
    """The input embeddings of `ids` [T] with rows `at` [K] replaced by image features
    [K, 1 + deepstack layers, hidden] (their first)."""
    embeds = model.get_input_embeddings()(ids)
    return embeds.index_copy(0, at, rows[:, 0].to(embeds.dtype))


def deepstack_inputs(at: Tensor, rows: Tensor, shape: tuple[int, ...]) -> dict:
    """A deepstack language model's extra inputs: `visual_pos_masks` (True at the image tokens `at`
    of a batch of `shape`, flattened) and `deepstack_visual_embeds` (per layer, the rows in order)."""
    mask = torch.zeros(shape, dtype=torch.bool, device=at.device)
    mask.view(-1)[at] = True
    return {"visual_pos_masks": mask, "deepstack_visual_embeds": [rows[:, k] for k in range(1, rows.shape[1])]}


def tower(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters of a vision-language model outside its language model and output head:
    the vision tower and the projector (or connector) into the language model's width."""
    language = {id(p) for p in model.get_decoder().parameters()}
    head = model.get_output_embeddings()
    language |= {id(p) for p in head.parameters()} if head is not None else set()
    return [(n, p) for n, p in model.named_parameters() if id(p) not in language]


def freeze_tower(model: nn.Module) -> None:
    """Stop the vision tower and projector from training (`train.train_vision: false`)."""
    for _, p in tower(model):
        p.requires_grad_(False)


@dataclass(frozen=True)
class PromptSpan:
    """Where a prompt with images sits in a batch of token rows: row `row`, columns
    [start, start + length), and `tails`, the column ranges [a, b) in the same row of the tokens
    that follow it (its samples' responses: after it in a padded row, later in a packed row whose
    samples share one copy of the prompt). Qwen's positions of the tails continue the prompt's."""

    row: int
    start: int
    length: int
    images: list[Image]
    tails: tuple[tuple[int, int], ...] = ()


def rope_rows(model: nn.Module, ids: Tensor, positions: Tensor, prompts: list[PromptSpan]) -> Tensor | None:
    """Qwen's 3-D positions [3, B, L] of token rows `ids` [B, L] whose text positions are
    `positions` [B, L]: a prompt's from `rope_positions`, its tails' their text position + the
    prompt's offset, any other token's its text position in all three; None for the other
    families. Reads the config only (no parameter)."""
    if not family(model.config).mrope:
        return None
    token = image_token(model.config)
    rope3 = positions[None].repeat(3, 1, 1)
    for span in prompts:
        if not span.images:
            continue
        prompt = ids[span.row, span.start : span.start + span.length].tolist()
        rope, delta = rope_positions(model, prompt, placeholders(prompt, token), span.images)
        rope3[:, span.row, span.start : span.start + span.length] = (
            rope.to(ids.device) + positions[span.row, span.start]
        )
        for a, b in span.tails:
            rope3[:, span.row, a:b] += delta
    return rope3


def token_types(model: nn.Module, ids: Tensor, prompts: list[PromptSpan]) -> Tensor | None:
    """Gemma 3's `token_type_ids` [B, L] of token rows `ids` (`Family.bidirectional`): 1 at the
    image placeholders of `prompts` (from which transformers makes each image's tokens attend
    both ways), 0 elsewhere, a placeholder id sampled in a response included; None for the other
    families. Reads the config only."""
    if not family(model.config).bidirectional:
        return None
    token = image_token(model.config)
    types = torch.zeros_like(ids)
    for span in prompts:
        if span.images:
            part = ids[span.row, span.start : span.start + span.length]
            types[span.row, span.start : span.start + span.length] = (part == token).long()
    return types


def image_rows(model: nn.Module, ids: Tensor, prompts: list[PromptSpan]) -> tuple[Tensor, Tensor] | None:
    """Where the images of `prompts` go in token rows `ids` [B, L] (flat indices [K] of their
    placeholders) and their feature rows [K, 1 + deepstack layers, hidden]; None without images.
    One vision forward per distinct image; a frozen tower's without autograd. A placeholder id
    the model sampled in a response is a plain token, as the engine ran it."""
    fam = family(model.config)
    token = image_token(model.config)
    width = ids.shape[1]
    distinct: dict[str, Tensor] = {}
    at, rows = [], []
    # a frozen tower (`train.train_vision: false`) keeps no activations for a backward
    frozen = not any(p.requires_grad for _, p in tower(model))
    for span in prompts:
        where = placeholders(ids[span.row, span.start : span.start + span.length].tolist(), token)
        feats = []
        for image in span.images:
            if image.digest not in distinct:
                with torch.no_grad() if frozen else contextlib.nullcontext():
                    distinct[image.digest] = features(model, fam, image)
            feats.append(distinct[image.digest])
        check_counts(where, [len(f) for f in feats], f"batch row {span.row} (columns from {span.start})")
        at.extend(span.row * width + span.start + w for w in where)
        rows.extend(feats)
    if not at:
        return None
    return torch.tensor(at, device=ids.device), torch.cat(rows)


def _merge_rows(embeds: Tensor, index: Tensor, rows: Tensor) -> Tensor:
    """`embeds` [B, L, hidden] with the flat positions `index` replaced by `rows[:, 0]`."""
    flat = embeds.reshape(-1, embeds.shape[-1])
    return flat.index_copy(0, index, rows[:, 0].to(flat.dtype)).view_as(embeds)


def model_inputs(model: nn.Module, ids: Tensor, prompts: list[PromptSpan]) -> dict[str, Tensor]:
    """A vision-language model's embeddings for token rows `ids` [B, L] (right-padded or packed),
    with the prompts that carry images at `prompts`: `inputs_embeds` [B, L, hidden] with each
    image's features at its prompt's placeholders (`image_rows`), and a deepstack family's
    `deepstack_inputs`. Gradients reach the vision tower where its parameters require them."""
    embeds = model.get_input_embeddings()(ids)
    out = {}
    merged = image_rows(model, ids, prompts)
    if merged is not None:
        embeds = _merge_rows(embeds, *merged)
        if family(model.config).deepstack:
            out.update(deepstack_inputs(merged[0], merged[1], tuple(ids.shape)))
    out["inputs_embeds"] = embeds
    return out


def position_inputs(model: nn.Module, ids: Tensor, positions: Tensor, prompts: list[PromptSpan]) -> dict[str, Tensor]:
    """What a family reads of where the images are, beside the embeddings, for token rows `ids`
    whose text positions are `positions`: Qwen's `position_ids` [3, B, L] (`rope_rows`), Gemma 3's
    `token_type_ids` (`token_types`), nothing for the others. Reads the config only."""
    out = {}
    rope3 = rope_rows(model, ids, positions, prompts)
    if rope3 is not None:
        out["position_ids"] = rope3
    types = token_types(model, ids, prompts)
    if types is not None:
        out["token_type_ids"] = types
    return out


@contextlib.contextmanager
def merged_in_forward(model: nn.Module, ids: Tensor, prompts: list[PromptSpan]):
    """A context in which `model`'s own forward on `ids` (the whole model's, called with
    `input_ids` and `rope_rows`' positions) merges the images of `prompts` as `model_inputs`
    does: a hook on the input embedding runs the vision tower and replaces the placeholders'
    rows, and a deepstack family's language model gets `deepstack_inputs`. For FSDP2, whose root
    module gathers the embedding and the tower only inside its forward.

    A trained tower's parameters all get a gradient, zero where this batch did not use them (no
    image in it, a layer past the one llava reads): FSDP2 reduces a unit's gradients in one
    collective whose size every rank must agree on. AdamW moves a weight with a zero gradient only
    by `train.weight_decay` (0 by default), and one no image ever reaches changes no output."""
    inner = model.model if hasattr(model, "model") else model
    state: dict = {}

    def embed(module, args, output):
        state["merged"] = merged = image_rows(model, ids, prompts)
        trained = [p for _, p in tower(model) if p.requires_grad]  # gathered now, inside the forward
        if trained:
            output = output + sum(p.reshape(-1)[:1].sum() for p in trained) * 0
        return output if merged is None else _merge_rows(output, *merged)

    def language(module, args, kwargs):
        merged = state.get("merged")
        if merged is None:
            return None
        return args, {**kwargs, **deepstack_inputs(merged[0], merged[1], tuple(ids.shape))}

    hooks = [model.get_input_embeddings().register_forward_hook(embed)]
    if family(model.config).deepstack:
        hooks.append(inner.language_model.register_forward_pre_hook(language, with_kwargs=True))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def hidden_states(model: nn.Module, inputs: dict, **kw) -> Tensor:
    """The last hidden states of a base vision-language model (`model.base_model`) for
    `model_inputs`' inputs: a deepstack family's through its language model, which takes the
    deepstack inputs (its own forward makes them from pixels only)."""
    if "deepstack_visual_embeds" in inputs:
        return model.language_model(**inputs, **kw).last_hidden_state
    return model(**inputs, **kw).last_hidden_state
