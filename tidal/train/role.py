"""The trainer role the loop drives: one process (`tidal.train.actor.Actor`) or a group of FSDP2
ranks (`tidal.cluster.trainers.TrainerGroup`) behind the same methods."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from tidal.types import Sample


class Trainer(Protocol):
    has_reference: bool
    has_teacher: bool

    def compute_log_probs(self, samples: Sequence[Sample], which: str = "policy") -> Tensor:
        """[N, R] log-probs of the response tokens under the policy, `reference` or `teacher`."""
        ...

    def train_step(
        self,
        samples: Sequence[Sample],
        advantages: Tensor | None,
        old_log_probs: Tensor | None = None,
        ref_log_probs: Tensor | None = None,
    ) -> dict[str, float]:
        """Optimizer steps over the batch; returns metrics."""
        ...

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterable[tuple[str, Tensor]]:
        """The policy's weights by name (for weight sync)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def save_model(self, path: str | Path) -> None:
        """The policy as a Hugging Face model folder at `path` (safetensors, config)."""
        ...
