"""Checkpoints: an HF-format model folder plus optimizer, data position and RNG state.

A checkpoint is written into a temporary folder and renamed into place, and `latest` is
updated last, so a run killed mid-save leaves the previous checkpoint as the one to resume.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import torch

from tidal.utils import atomic_directory, atomic_write_json, atomic_write_text

LATEST = "latest"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    save_model: Callable[[Path], None],
    tokenizer,
    trainer_state: dict,
    state: dict,
) -> Path:
    """Write `checkpoints/step_{step}` atomically and point `checkpoints/latest` at it.

    `save_model(folder)` writes the model as a Hugging Face folder (the trainer role's `save_model`;
    a model object's `save_pretrained` also fits).
    `trainer_state` (optimizer, scheduler tensors) goes to `trainer_state.pt`; `state`
    (JSON-serializable: step, data-source position, weight version) to `state.json`.
    """
    root = checkpoint_root(output_dir)
    final = root / f"step_{step}"
    with atomic_directory(final) as tmp:
        save_model(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        torch.save({**trainer_state, "rng": rng}, tmp / "trainer_state.pt")
        atomic_write_json(tmp / "state.json", {**state, "step": step})
    atomic_write_text(root / LATEST, final.name + "\n")
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The folder named by `checkpoints/latest`, or None when the run has none."""
    root = checkpoint_root(output_dir)
    marker = root / LATEST
    if not marker.exists():
        return None
    path = root / marker.read_text().strip()
    if not (path / "state.json").exists():
        raise FileNotFoundError(f"{marker} names {path.name}, which is missing or incomplete")
    return path


def load_checkpoint(path: str | Path) -> tuple[dict, dict]:
    """Read (trainer_state, state) from a checkpoint folder and restore the RNG states.
    The model weights are loaded by the caller from the same folder (it is an HF model folder)."""
    path = Path(path)
    trainer_state = torch.load(path / "trainer_state.pt", weights_only=False)
    state = json.loads((path / "state.json").read_text())
    rng = trainer_state.pop("rng", None)
    if rng:
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
    return trainer_state, state
