"""Checkpoints: an HF-format model folder plus optimizer, data position and RNG state.

A checkpoint is written into a hidden temporary folder (`.step_N.*`), every file and the folder
are fsynced, and it is renamed into place as `step_N`; `latest` is updated after that and older
checkpoints beyond `keep` are deleted last. So a run killed at any point leaves at least the
previous complete checkpoint, and `latest_checkpoint` finds the newest complete one by looking at
the folders themselves (`latest` is a convenience for people and scripts, never trusted alone).
Temporary folders a killed save left behind are removed on the next save.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from tidal.utils import atomic_directory, atomic_write_json, atomic_write_text, remove_stale_temps

LATEST = "latest"
STATE_FILE = "state.json"  # written last: its presence marks a complete checkpoint
TRAINER_STATE_FILE = "trainer_state.pt"
_STEP_RE = re.compile(r"step_(\d+)")

log = logging.getLogger("tidal")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def is_complete(path: str | Path) -> bool:
    """True when `path` holds a whole checkpoint (state.json and trainer_state.pt are written last)."""
    path = Path(path)
    return (path / STATE_FILE).is_file() and (path / TRAINER_STATE_FILE).is_file()


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints of a run as `(step, folder)`, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _STEP_RE.fullmatch(path.name)
        if m and path.is_dir() and is_complete(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def remove_stale_saves(output_dir: str | Path) -> list[Path]:
    """Delete the `.step_N.*` folders and `.latest.*` files a killed save or prune left behind.
    Call only while no save of this run is in progress (the loop's rank 0 is the only writer)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    removed = remove_stale_temps(root, "step_*") + remove_stale_temps(root, LATEST)
    for path in removed:
        log.warning("removed %s, left by an interrupted checkpoint save", path)
    return removed


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    save_model: Callable[[Path], None],
    tokenizer,
    trainer_state: dict,
    state: dict,
    keep: int = 0,
) -> Path:
    """Write `checkpoints/step_{step}` atomically, point `checkpoints/latest` at it, then keep only
    the newest `keep` complete checkpoints (0 = keep all).

    `save_model(folder)` writes the model as a Hugging Face folder (the trainer role's `save_model`;
    a model object's `save_pretrained` also fits).
    `trainer_state` (optimizer, scheduler tensors) goes to `trainer_state.pt`; `state`
    (JSON-serializable: step, data-source position, weight version) to `state.json`.
    """
    root = checkpoint_root(output_dir)
    remove_stale_saves(output_dir)
    final = root / f"step_{step}"
    with atomic_directory(final) as tmp:  # fsyncs every file and the folder before the rename
        save_model(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        torch.save({**trainer_state, "rng": rng}, tmp / TRAINER_STATE_FILE)
        atomic_write_json(tmp / STATE_FILE, {**state, "step": step})
    atomic_write_text(root / LATEST, final.name + "\n")
    prune_checkpoints(output_dir, keep)
    return final


def prune_checkpoints(output_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (`keep` 0 deletes nothing).

    Each old folder is first renamed to a hidden `.step_N.deleting` name, so a kill during the
    deletion never leaves a half-deleted folder that still looks like a checkpoint."""
    if keep <= 0:
        return []
    removed = []
    for _, path in list_checkpoints(output_dir)[:-keep]:
        doomed = path.with_name(f".{path.name}.deleting")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder of the run, or None when it has none.

    `checkpoints/latest` is not trusted: a kill between the rename and its update, or a hand-deleted
    folder, makes it name an older or missing checkpoint; a mismatch is logged."""
    found = list_checkpoints(output_dir)
    if not found:
        return None
    newest = found[-1][1]
    marker = checkpoint_root(output_dir) / LATEST
    named = marker.read_text().strip() if marker.is_file() else None
    if named != newest.name:
        log.warning("%s names %s; the newest complete checkpoint is %s", marker, named, newest.name)
    return newest


def load_checkpoint(path: str | Path) -> tuple[dict, dict]:
    """Read (trainer_state, state) from a checkpoint folder and restore the RNG states.
    The model weights are loaded by the caller from the same folder (it is an HF model folder)."""
    path = Path(path)
    trainer_state = torch.load(path / TRAINER_STATE_FILE, weights_only=False)
    state = json.loads((path / STATE_FILE).read_text())
    rng = trainer_state.pop("rng", None)
    if rng:
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
    return trainer_state, state


def export_checkpoint(output_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Copy checkpoint `step` of a run (default: the newest complete one) to `out` as a plain
    Hugging Face folder (model and tokenizer files, no optimizer or loop state), atomically.

    Raises:
        FileNotFoundError: the run has no complete checkpoint, or none at `step` (the message lists
            the steps it has).
        FileExistsError: `out` exists and is not empty (nothing is overwritten).
    """
    found = dict(list_checkpoints(output_dir))
    if not found:
        raise FileNotFoundError(f"{checkpoint_root(output_dir)}: no complete checkpoint to export")
    if step is None:
        step = max(found)
    if step not in found:
        raise FileNotFoundError(
            f"{checkpoint_root(output_dir)}: no complete checkpoint at step {step}; "
            f"steps saved: {', '.join(map(str, sorted(found)))}"
        )
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; export into a new or empty folder")
    with atomic_directory(out) as tmp:
        for src in found[step].iterdir():
            if src.name in (STATE_FILE, TRAINER_STATE_FILE):
                continue
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp / src.name)
    return out
