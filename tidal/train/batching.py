"""Turn samples into padded tensors and split them into micro-batches."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager

import torch

from tidal import vision
from tidal.hardware import on_host
from tidal.moe import routing_tensor
from tidal.train.attention import NAME as PACKED_ATTENTION
from tidal.train.attention import implementation as attn_implementation
from tidal.train.attention import packed_layout, shared_prefix_layout
from tidal.types import Sample


@on_host
def collate(samples: Sequence[Sample], pad_id: int = 0, routing: bool = False) -> dict[str, torch.Tensor]:
    """Right-pad samples into a batch.

    Returns `input_ids`/`attention_mask` [B, L] over prompt + response, `prompt_lengths` [B],
    `response_ids`, `loss_mask`, `rollout_log_probs` [B, R] over response tokens only (R the
    longest response). Masks come from lengths, never from the pad id (pad may equal eos).
    `routing`: also the samples' recorded experts over the B * L flattened tokens (`routing_fields`).
    """
    b = len(samples)
    width = max(len(s.tokens) for s in samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
        attn[i, : len(s.tokens)] = 1
    out = {"input_ids": ids, "attention_mask": attn, **response_fields(samples, pad_id)}
    spans = []
    for i, s in enumerate(samples):
        if s.images:  # row i: the prompt at its start, the response after it
            p = len(s.tokens) - s.response_length
            spans.append(vision.PromptSpan(i, 0, p, s.images, ((p, len(s.tokens)),)))
    if spans:  # a vision-language model's prompts with images (`model_inputs`)
        out["image_prompts"] = spans
    if routing:  # sample i's position p is flattened token i * width + p
        slots = [i * width + torch.arange(max(len(s.tokens) - 1, 0)) for i, s in enumerate(samples)]
        out.update(routing_fields(samples, slots, b * width))
    return out


@on_host
def routing_fields(samples: Sequence[Sample], slots: Sequence[torch.Tensor], total: int) -> dict[str, torch.Tensor]:
    """The samples' recorded experts laid out like the forward's `total` flattened tokens (what
    the MoE routers see), for `tidal.moe.replay`: `routed_experts` [total, moe_layers, top_k]
    (int16) and `routed_mask` [total] (bool, True where a record is replayed).

    `slots[i]` [len(tokens_i) - 1]: the flattened token that computes sample i's position p, for
    p = 0 .. len - 2 (-1 where another sample's copy computes it: a shared prompt). Each
    sample's last token, the padding and the positions the engine did not record
    (`RoutedExperts`) keep the model's own routing."""
    shape = None
    routed = mask = None
    for i, s in enumerate(samples):
        if s.routed_experts is None:
            raise ValueError(
                f"sample {s.index} (micro-batch position {i}): algo.routing_replay is on but it carries no "
                "routed_experts (the engine did not record its routing)"
            )
        rec = routing_tensor(s.routed_experts)
        if rec.shape[0] != len(s.tokens) - 1 or (shape is not None and rec.shape[1:] != shape):
            raise ValueError(
                f"sample {s.index}: routed_experts has shape {tuple(rec.shape)}, expected "
                f"[{len(s.tokens) - 1}, {', '.join(map(str, shape or rec.shape[1:]))}] like the others"
            )
        if routed is None:
            shape = rec.shape[1:]
            routed = torch.zeros((total, *shape), dtype=torch.int16)
            mask = torch.zeros(total, dtype=torch.bool)
        slot = slots[i]
        keep = slot >= 0
        routed[slot[keep]] = rec[keep]
        mask[slot[keep]] = (rec[keep] >= 0).flatten(1).all(dim=1)
    return {"routed_experts": routed, "routed_mask": mask}


@on_host
def response_fields(samples: Sequence[Sample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The per-response-token tensors both layouts share: `prompt_lengths` [B] and
    `response_ids`, `loss_mask`, `rollout_log_probs` [B, R], right-padded (R >= 1), and
    `response_valid` [B, R] (bool): which grid positions hold a response token."""
    b = len(samples)
    resp = max(max(s.response_length for s in samples), 1)
    resp_ids = torch.full((b, resp), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, resp), dtype=torch.float32)
    rollout_lp = torch.zeros((b, resp), dtype=torch.float32)
    prompt_len = torch.zeros(b, dtype=torch.long)
    for i, s in enumerate(samples):
        n, r = len(s.tokens), s.response_length
        prompt_len[i] = n - r
        if r:
            resp_ids[i, :r] = torch.tensor(s.tokens[n - r :])
            loss_mask[i, :r] = torch.tensor(s.loss_mask, dtype=torch.float32)
            rollout_lp[i, :r] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
    return {
        "prompt_lengths": prompt_len,
        "response_ids": resp_ids,
        "loss_mask": loss_mask,
        "rollout_log_probs": rollout_lp,
        "response_valid": torch.arange(resp)[None, :] < (torch.tensor([s.response_length for s in samples]))[:, None],
    }


def micro_batches(n: int, size: int) -> list[slice]:
    """Consecutive slices of at most `size` items covering range(n)."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


# ---------------------------------------------------------------------------------------------
# Dynamic batching: token-budget micro-batches and padding-free packed rows.
#
# How transformers 5.23 handles a packed row (masking_utils.py): `create_causal_mask` calls
# `_preprocess_mask_arguments`, which, only when the 2D `attention_mask` is None AND
# `past_key_values` is None, runs `find_packed_sequence_indices(position_ids)`: every place where
# the position does not step by +1 starts a new sequence. `packed_sequence_compatibility_function`
# then turns the causal mask into a block-diagonal causal one and disables sdpa's `is_causal`
# shortcut, so with "sdpa" and "eager" (and "flex_attention") each token attends only within its own
# sample.
# The catch: `LlamaModel.forward` (other decoder models follow the same template) takes `use_cache` from the
# config (True by default) and then creates an empty `DynamicCache`, so `past_key_values` is no
# longer None, detection is skipped and every token attends to all earlier samples in the row.
# Nothing fails, the log-probs are just wrong. Gradient checkpointing in train mode turns the
# cache off, which hides the problem. The helpers below always pass `use_cache=False`, and
# `explicit_mask=True` builds the block-diagonal mask itself for models that do not detect
# packing at all.
# ---------------------------------------------------------------------------------------------

# attention implementations verified (tests/train/test_packing.py, CPU, log-probs and gradients) to
# give exact packed results. "flex_attention" also matched in a CPU forward check, but it has no
# backward on CPU and a slow compile, so it is not verified for training and not listed.
PACKING_ATTN_IMPLEMENTATIONS = frozenset({"sdpa", "eager", PACKED_ATTENTION})


@on_host
def collate_packed(
    samples: Sequence[Sample], pad_id: int = 0, share_prompts: bool = False, routing: bool = False
) -> dict[str, torch.Tensor]:
    """Concatenate samples into one row with no padding.

    Returns `input_ids`/`position_ids` [1, S] (S the total token count; positions restart at 0 for
    every sample), `response_index` [B, R]: for response token j of sample i, the position in the
    row of the token before it, whose hidden state predicts it (0 where j >= response_length), and
    `prompt_lengths`, `response_ids`, `loss_mask`, `rollout_log_probs` exactly as `collate`.

    `share_prompts`: samples with the same prompt tokens (a GRPO group) store the prompt once; each
    later one stores only its response, at positions continuing the prompt's. The row then needs
    `layout` (returned too), the attention layout of `tidal.train.attention.shared_prefix_layout`:
    only `packed_attention` computes it exactly. A group of 4 with 45-token prompts and 35-token
    responses becomes 185 row tokens instead of 320, with the same log-probs and gradients.

    `routing`: also the samples' recorded experts over the S row tokens (`routing_fields`); a
    shared prompt is replayed with the routing of the sample that stores it.
    """
    if not samples:
        raise ValueError("collate_packed: no samples")
    b = len(samples)
    resp = max(max(s.response_length for s in samples), 1)
    ids: list[int] = []
    pos: list[int] = []
    rows: list[list[int]] = []  # per sample: its tokens' row positions
    owned: list[list[int]] = []  # per sample: offsets into rows[i] whose outputs it provides
    prompts: dict[tuple, list[int]] = {}  # prompt (tokens, images) -> its tokens' row positions
    spans: dict[tuple, list] = {}  # prompt with images -> [start, length, images, tails]
    resp_index = torch.zeros((b, resp), dtype=torch.long)
    for i, s in enumerate(samples):
        n, r = len(s.tokens), s.response_length
        if r and n - r < 1:
            raise ValueError(f"collate_packed: sample {s.index} has a response but no prompt token to predict it")
        # the same tokens with other images are another prompt (an image is a run of placeholders)
        key = (tuple(s.tokens[: n - r]), tuple(image.digest for image in s.images))
        shared = prompts.get(key) if share_prompts else None
        start = len(ids)
        if shared is None:
            row = list(range(start, start + n))
            ids.extend(s.tokens)
            pos.extend(range(n))
            owned.append(list(range(n)))
            if share_prompts:
                prompts[key] = row[: n - r]
            if s.images:
                spans[key if share_prompts else (i,)] = [start, n - r, s.images, []]
        else:
            row = shared + list(range(start, start + r))
            ids.extend(s.tokens[n - r :])
            pos.extend(range(n - r, n))
            owned.append(list(range(n - r, n)))
        if s.images:  # its response: the last r tokens appended, numbered after its prompt
            spans[key if share_prompts else (i,)][3].append((len(ids) - r, len(ids)))
        rows.append(row)
        if r:
            resp_index[i, :r] = torch.tensor(row[n - r - 1 : n - 1])
    out = {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([pos], dtype=torch.long),
        "response_index": resp_index,
        **response_fields(samples, pad_id),
    }
    if share_prompts:
        out["layout"] = shared_prefix_layout(rows, owned, len(ids))
    if spans:  # a vision-language model's prompts with images (`model_inputs`)
        out["image_prompts"] = [vision.PromptSpan(0, a, n, im, tuple(tails)) for a, n, im, tails in spans.values()]
    if routing:
        slots = []
        for i, s in enumerate(samples):  # a position sample i does not own is computed by another sample
            row = torch.full((len(s.tokens),), -1, dtype=torch.long)
            row[owned[i]] = torch.tensor(rows[i], dtype=torch.long)[owned[i]]
            slots.append(row[:-1])
        out.update(routing_fields(samples, slots, len(ids)))
    return out


def token_budget_batches(
    lengths: Sequence[int], max_tokens: int, prompts: Sequence[tuple[Hashable, int]] | None = None
) -> list[list[int]]:
    """First-fit packing of sample indices into micro-batches of at most `max_tokens` tokens.

    Samples are taken in order; each goes into the first micro-batch (in opening order) whose
    total plus its length fits in `max_tokens`, else it opens a new one. A sample longer than
    `max_tokens` goes alone in its own micro-batch. Indices within a micro-batch are ascending.
    With `prompts` (per sample: a key of its prompt and the prompt's length), a sample joining a
    micro-batch that already holds its prompt costs only its response (`collate_packed` with
    `share_prompts` stores the prompt once).
    """
    if max_tokens < 1:
        raise ValueError(f"token_budget_batches: max_tokens must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    totals: list[int] = []
    keys: list[set] = []
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"token_budget_batches: length {n} of sample {i} is negative")
        key, plen = prompts[i] if prompts is not None else (None, 0)
        for b, t in enumerate(totals):
            cost = n - plen if key is not None and key in keys[b] else n
            if t + cost <= max_tokens:
                bins[b].append(i)
                totals[b] += cost
                keys[b].add(key)
                break
        else:
            bins.append([i])
            totals.append(n)
            keys.append({key})
    return bins


def supports_packing(model: torch.nn.Module) -> bool:
    """Whether `model` (a causal LM or its base model) computes a packed row exactly: its attention
    implementation is one whose transformers mask builder detects packed `position_ids`."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "is_causal", True):
        return False
    return attn_implementation(model) in PACKING_ATTN_IMPLEMENTATIONS


def packed_attention_mask(position_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Block-diagonal causal mask [1, 1, S, S] for a packed row ([1, S] positions restarting at 0).

    Boolean (True = attend) when `dtype` is None, else additive: 0 where attended, the dtype's
    minimum elsewhere (what eager attention expects). Full causal attention within each sample;
    not for sliding-window models.
    """
    seq = (torch.diff(position_ids[0], prepend=position_ids[0, :1] - 1) != 1).cumsum(0)
    idx = torch.arange(seq.shape[0], device=position_ids.device)
    mask = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])
    mask = mask[None, None]
    if dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def packed_response_hidden(
    base_model: torch.nn.Module, batch: dict[str, torch.Tensor], explicit_mask: bool = False
) -> torch.Tensor:
    """Hidden states [B, R, H] that predict each response token, from one packed row (see
    `collate_packed`). Entries past a sample's response length are meaningless (mask them).

    By default transformers detects the packing from `position_ids` (needs `supports_packing`);
    `explicit_mask=True` passes a ready 4D block-diagonal mask instead (boolean for sdpa, additive
    otherwise), for models whose mask code does not detect packing. A model switched to
    `tidal.train.attention` gets the row's layout and ignores the mask.
    """
    kwargs = {}
    if "layout" in batch and attn_implementation(base_model) != PACKED_ATTENTION:
        raise ValueError("packed_response_hidden: a row with shared prompts needs the tidal_packed attention")
    if attn_implementation(base_model) == PACKED_ATTENTION:
        kwargs["tidal_layout"] = batch.get("layout") or packed_layout(batch["position_ids"])
    if explicit_mask:
        dtype = None if attn_implementation(base_model) == "sdpa" else base_model.get_input_embeddings().weight.dtype
        kwargs["attention_mask"] = packed_attention_mask(batch["position_ids"], dtype)
    # use_cache=False: an (empty) cache turns off transformers' packed-sequence detection
    hidden = vision.hidden_states(base_model, model_inputs(base_model, batch), use_cache=False, **kwargs)
    # index_select, not hidden[0, index]: with shared prompts a group's samples all read their
    # prompt's last position, and the indexing's backward (an accumulating index_put) adds those
    # gradients from several threads at once in float32, in an order that varies from run to run;
    # index_select's (index_add) adds them in index order, so the step's gradient repeats bit for bit
    index = batch["response_index"]
    return hidden[0].index_select(0, index.reshape(-1)).view(*index.shape, hidden.shape[-1])


def _text_positions(batch: dict) -> torch.Tensor:
    """Each token's text position [B, L]: a packed row's own, or in a right-padded batch its index
    (0 on the padding, as transformers numbers it)."""
    if "position_ids" in batch:
        return batch["position_ids"]
    ids = batch["input_ids"]
    return torch.arange(ids.shape[1], device=ids.device)[None, :] * batch["attention_mask"]


def _image_positions(model: torch.nn.Module, batch: dict, prompts: list) -> dict[str, torch.Tensor]:
    """A batch's `vision.position_inputs`, its positions as the forward takes them: a packed row's
    Qwen positions lead with its text positions ([4, 1, S]), from which transformers' mask (and
    `packed_attention`'s layout) learn where each sample starts, as for a text row; another
    model's packed row keeps its text positions."""
    text = _text_positions(batch)
    out = vision.position_inputs(model, batch["input_ids"], text, prompts)
    if "position_ids" in batch:
        rope = out.pop("position_ids", None)
        out["position_ids"] = text if rope is None else torch.cat([text[None], rope])
    return out


def model_inputs(model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """A batch's token inputs (padded, or a packed row with its `position_ids`): its ids, or with
    images the embeddings they make (`vision.model_inputs`) and the positions that place them."""
    if "image_prompts" not in batch:
        return {k: batch[k] for k in ("input_ids", "position_ids") if k in batch}
    prompts = batch["image_prompts"]
    return {**vision.model_inputs(model, batch["input_ids"], prompts), **_image_positions(model, batch, prompts)}


def root_inputs(model: torch.nn.Module, batch: dict) -> tuple[dict[str, torch.Tensor], AbstractContextManager]:
    """A batch's inputs for the whole model's own forward (FSDP2's root: it gathers the embedding
    only inside that forward): its ids and positions, and a context in which that forward merges
    the batch's images (`vision.merged_in_forward`; a no-op for other models)."""
    inputs = {k: batch[k] for k in ("input_ids", "position_ids") if k in batch}
    if vision.runs(model.config) is None:
        return inputs, contextlib.nullcontext()
    # a micro-batch without images merges none, but its trained tower still gets (zero) gradients
    prompts = batch.get("image_prompts", [])
    inputs.update(_image_positions(model, batch, prompts))
    return inputs, vision.merged_in_forward(model, batch["input_ids"], prompts)


def padded_response_hidden(base_model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Hidden states [B, R, H] that predict each response token, from a right-padded batch (see
    `collate`): response token j of row i sits at prompt_len_i + j and is predicted from the
    position before it. Entries past a row's response length are meaningless (mask them)."""
    inputs = model_inputs(base_model, batch)
    hidden = vision.hidden_states(base_model, inputs, attention_mask=batch["attention_mask"], use_cache=False)
    r = batch["response_ids"].shape[1]
    pos = batch["prompt_lengths"][:, None] - 1 + torch.arange(r, device=hidden.device)[None, :]
    pos = pos.clamp(max=hidden.shape[1] - 1)
    return hidden.gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
