"""The contract every rollout engine meets, in-process or behind HTTP: sample token ids with the
log-prob of each, and take new weights with a version. The rollout manager and the loop use
nothing else, so a faster engine drops in behind it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from tidal.engine.sampling import SamplingParams


@dataclass
class GenerationOutput:
    """One response: the sampled ids, the log-prob of each under the distribution it was drawn
    from, why it ended, its text, and the weight version that produced it."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" | "length" | "abort"
    text: str = ""
    weight_version: int = 0


class Engine(Protocol):
    weight_version: int

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationOutput]:
        """One response per prompt; `params[i]` applies to `prompts[i]`."""
        ...

    def update_weights_from_tensors(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def update_weights_from_disk(self, path: str | Path, version: int) -> None: ...
