"""What actor and critic share: the micro-batch plan and the forward pass to response hidden states."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import torch

from tidal import recurrent, vision
from tidal.hardware import CPU, to_device
from tidal.moe import replay, routing_shape
from tidal.train import context
from tidal.train.attention import packed_layout, use_packed_attention
from tidal.train.batching import (
    collate,
    collate_packed,
    micro_batches,
    packed_response_hidden,
    padded_response_hidden,
    supports_packing,
    token_budget_batches,
)
from tidal.train.options import TrainConfig
from tidal.types import Sample


class Forward:
    """Cuts a batch into micro-batches and runs a model up to the hidden states that predict
    each response token (packed into one row when the model supports it, else right-padded)."""

    def __init__(
        self,
        cfg: TrainConfig,
        model: torch.nn.Module,
        pad_id: int = 0,
        device: str | torch.device = CPU,
        routing: bool = False,
    ) -> None:
        """`routing`: micro-batches carry the samples' recorded experts (`algo.routing_replay`)."""
        self.cfg = cfg
        self.pad_id = pad_id
        self.device = torch.device(device)
        self.routing = routing
        self.packing = cfg.packing and supports_packing(model)
        family = vision.runs(model.config) if hasattr(model, "config") else None
        # Gemma 3's images attend both ways within a sample: only the packed attention knows where
        self.images_both_ways = family is not None and family.bidirectional
        self.image_token = vision.image_token(model.config) if self.images_both_ways else None
        if self.packing and self.images_both_ways:
            self.packing = use_packed_attention(model)
        if self.packing and recurrent.mixers(model):
            # a hybrid model's recurrent layers run a packed row's samples as a padded batch from
            # no state; they learn where samples start from the row's layout, which only the
            # packed attention passes on (else a sample would start from the one before's state)
            self.packing = use_packed_attention(model)
        # the row's samples attended as a padded batch: exact, and 2-3x faster on CPU; it also lets
        # a group's samples share one copy of their prompt in the row
        self.share_prompts = self.packing and use_packed_attention(model) and cfg.share_prompts
        self.cp_group = None  # context parallel (`TrainedModel.shard`): each row is split over its ranks

    def plan(self, samples: Sequence[Sample]) -> list[list[int]]:
        """Indices into `samples`, one list per micro-batch: first-fit by token budget when
        `max_tokens_per_micro_batch` is set, else consecutive runs of `micro_batch_size`."""
        if self.cfg.max_tokens_per_micro_batch:
            prompts = None
            if self.share_prompts:
                # keyed as `collate_packed` shares them: the same tokens with other images differ
                prompts = [
                    (
                        (tuple(s.tokens[: len(s.tokens) - s.response_length]), tuple(im.digest for im in s.images)),
                        len(s.tokens) - s.response_length,
                    )
                    for s in samples
                ]
            return token_budget_batches([len(s.tokens) for s in samples], self.cfg.max_tokens_per_micro_batch, prompts)
        return [list(range(len(samples)))[sl] for sl in micro_batches(len(samples), self.cfg.micro_batch_size)]

    def collate(self, samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
        """The micro-batch's tensors, built on the host and copied to the model's device. On a
        context-parallel rank, also the row's split (`cp_split`, `tidal.train.context`), and the
        recorded experts of this rank's tokens only (the forward's tokens)."""
        if not self.packing:
            return to_device(collate(samples, self.pad_id, self.routing), self.device)
        batch = collate_packed(samples, self.pad_id, self.share_prompts, self.routing)
        if self.images_both_ways:  # each sample's image runs, in its own positions
            layout = batch.get("layout") or packed_layout(batch["position_ids"])
            batch["layout"] = dataclasses.replace(layout, images=tuple(self._image_runs(s) for s in samples))
        batch = to_device(batch, self.device)
        if self.cp_group is not None:
            layout = batch.get("layout") or packed_layout(batch["position_ids"])
            split = context.split_row(batch["position_ids"], layout, self.cp_group)
            batch["cp_split"] = split
            if "routed_experts" in batch:
                batch["routed_experts"], batch["routed_mask"] = context.local_rows(
                    split, batch["routed_experts"], batch["routed_mask"]
                )
        return batch

    def _image_runs(self, sample: Sample) -> tuple[tuple[int, int], ...]:
        """The runs of a sample's image placeholders in its prompt (none without images)."""
        if not sample.images:
            return ()
        prompt = sample.tokens[: len(sample.tokens) - sample.response_length]
        return tuple(vision.image_blocks(vision.placeholders(prompt, self.image_token)))

    def hidden(self, base_model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, R, H] hidden states at the positions that predict response tokens."""
        if "position_ids" in batch:
            return packed_response_hidden(base_model, batch)
        return padded_response_hidden(base_model, batch)


def replaying(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    """A context in which `model`'s forwards on `batch`, and backwards that recompute them
    (activation checkpointing), route with the batch's recorded experts (`tidal.moe.replay`);
    a no-op context for a batch without them."""
    if "routed_experts" not in batch:
        return contextlib.nullcontext()
    routed = batch["routed_experts"]
    shape = routing_shape(model)
    if shape is not None and routed.shape[1:] != shape and routed[0].numel() == shape[0] * shape[1]:
        routed = routed.reshape(-1, *shape)  # an HTTP engine's flat [layers x top-k] per position
    return replay(model, routed, batch["routed_mask"])
