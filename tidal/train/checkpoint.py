"""Checkpoints: an HF-format model folder plus optimizer, data position and RNG state.

A checkpoint is written into a hidden temporary folder (`.step_N.*`), every file and the folder
are fsynced, and it is renamed into place as `step_N`; `latest` is updated after that and older
checkpoints beyond `keep` are deleted last. So a run killed at any point leaves at least the
previous complete checkpoint, and `latest_checkpoint` finds the newest complete one by looking at
the folders themselves (`latest` is a convenience for people and scripts, never trusted alone).
Temporary folders a killed save left behind are removed on the next save.

`state.json` also records every other file's size and CRC-32 (`files`): `verify_checkpoint` checks
them, and each safetensors file's header, before a resume or an export uses the folder, so a
truncated or damaged file is named instead of failing deep in a loader (or being copied out).
A save that runs out of disk names the disk, the space left and the checkpoint that is intact.

`trainer_state.pt` holds only tensors, numbers, strings, lists, tuples and dicts (optimizer and
scheduler state, the Python and torch RNG states), so it is read with `torch.load(weights_only=True)`:
a file holding any other Python object is refused before that object is built, since unpickling it
could run code (`--resume` on a folder someone else could write to must not be a way in).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import re
import shutil
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from tidal.hardware import CPU
from tidal.types import InputError, RunStopped
from tidal.utils import atomic_directory, atomic_write_json, atomic_write_text, remove_stale_temps

LATEST = "latest"
STATE_FILE = "state.json"  # written last: its presence marks a complete checkpoint
TRAINER_STATE_FILE = "trainer_state.pt"
_STEP_RE = re.compile(r"step_(\d+)")

log = logging.getLogger("tidal")


class CheckpointError(InputError):
    """A checkpoint file that cannot be loaded safely or at all; the message names the file."""


class CheckpointSaveError(RunStopped):
    """A checkpoint could not be written (a full disk, an I/O error); the message names the folder,
    why, and the checkpoint that is still intact."""


FULL_DISK_BYTES = 64 * 2**20  # less free than this after a failed write: the disk is what failed
CRC_CHUNK = 16 * 2**20


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
    try:
        with atomic_directory(final) as tmp:  # fsyncs every file and the folder before the rename
            try:
                save_model(tmp)
                if tokenizer is not None:
                    tokenizer.save_pretrained(str(tmp))
                rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
                torch.save({**trainer_state, "rng": rng}, tmp / TRAINER_STATE_FILE)
                # written last, with what every other file must be: its presence marks a complete checkpoint
                atomic_write_json(tmp / STATE_FILE, {**state, "step": step, "files": file_records(tmp)})
            except Exception as e:  # OSError, safetensors' error; torch's writer says "unexpected pos" when full
                raise _save_failed(e, final, tmp, output_dir) from e
    except OSError as e:  # the fsyncs and the rename
        raise _save_failed(e, final, final.parent, output_dir) from e
    atomic_write_text(root / LATEST, final.name + "\n")
    prune_checkpoints(output_dir, keep)
    return final


def _save_failed(error: BaseException, final: Path, where: Path, output_dir: str | Path) -> CheckpointSaveError:
    """The error a failed save ends the run with: the folder, whether the disk is full (ENOSPC, or
    almost no space left where the save was writing), and the newest checkpoint still intact (the
    temporary folder is removed on the way out)."""
    free = shutil.disk_usage(where).free
    full = (
        (isinstance(error, OSError) and error.errno == errno.ENOSPC)
        or "No space left on device" in str(error)
        or free < FULL_DISK_BYTES
    )
    why = f"the disk is full (ENOSPC: {free:,} bytes free)" if full else f"{type(error).__name__}: {error}"
    intact = latest_checkpoint(output_dir)
    kept = f"the newest intact checkpoint is {intact}" if intact is not None else "no earlier checkpoint exists"
    hint = "; free space there (or lower train.keep_checkpoints) and continue with --resume" if full else ""
    return CheckpointSaveError(f"saving checkpoint {final}: {why}; {kept}{hint}")


def file_records(folder: Path) -> dict[str, dict]:
    """{name: {"bytes", "crc32"}} of every file under `folder`, by path relative to it."""
    return {
        str(f.relative_to(folder)): {"bytes": f.stat().st_size, "crc32": file_crc32(f)}
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name != STATE_FILE
    }


def file_crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CRC_CHUNK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def check_safetensors(path: Path) -> None:
    """CheckpointError naming `path` unless its header reads and its tensors' bytes fit the file
    (a truncated copy ends before them)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"its header claims {n:,} bytes, the file has {size:,}")
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); the file is damaged") from None
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path}: damaged: its tensors need {8 + n + end:,} bytes, the file has {size:,} (a truncated copy?)"
        )


def verify_checkpoint(folder: str | Path) -> None:
    """Check a checkpoint folder before it is used: every file `state.json` records has the size
    and CRC-32 it was written with (checkpoints written before tidal recorded them are not
    checked this way), and every safetensors file's header and length. CheckpointError names the
    first damaged or missing file and the way out."""
    folder = Path(folder)
    way_out = "delete this checkpoint folder to use the one before it"
    for name, want in read_state(folder).get("files", {}).items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing from the checkpoint ({way_out})")
        got = path.stat().st_size
        if got != want.get("bytes"):
            raise CheckpointError(
                f"{path}: damaged: {got:,} bytes, the checkpoint wrote {want.get('bytes'):,} ({way_out})"
            )
        if file_crc32(path) != want.get("crc32"):
            raise CheckpointError(f"{path}: damaged: its CRC-32 differs from the one written at save ({way_out})")
    for path in sorted(folder.glob("*.safetensors")):
        check_safetensors(path)


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


def _refusal_detail(err: Exception) -> str:
    """The line of torch's weights-only refusal that names what was refused (torch's own advice,
    to load with weights_only=False, is exactly what must not be done with an untrusted file)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    for key in ("GLOBAL", "Unsupported", "unsupported"):
        for ln in lines:
            if key in ln and "weights_only" not in ln:
                return ln
    return lines[-1] if lines else type(err).__name__


def read_trainer_state(path: str | Path, mmap: bool = False) -> dict:
    """The dict in a checkpoint's `trainer_state.pt`, read with torch's weights-only unpickler.

    `mmap=True` maps the tensors instead of reading them (a cheap check that the file loads).
    Raises CheckpointError naming the file when it holds anything but tensors and plain data
    (nothing in it is built, so no code in it runs), or cannot be read at all."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=CPU, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused to load: it holds Python objects other than tensors, numbers, strings, lists and "
            f"dicts ({_refusal_detail(e)}), and building them could run code. tidal writes only those, so this "
            "file was not written by tidal or was changed since; resume from a checkpoint you trust (delete this "
            "checkpoint folder to resume from the one before it)"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(
            f"{path}: cannot be read as a checkpoint's trainer state ({e}); the file is damaged or not one "
            "tidal wrote. Delete this checkpoint folder to resume from the one before it"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of trainer state, got {type(state).__name__}")
    return state


def _restore_rng(rng: dict, path: Path) -> None:
    try:
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"{path}: 'rng' must hold the Python RNG state (random.getstate()) and the torch one "
            f"(torch.get_rng_state()): {type(e).__name__}: {e}"
        ) from None


def load_checkpoint(path: str | Path) -> tuple[dict, dict]:
    """Read (trainer_state, state) from a checkpoint folder and restore the RNG states.
    The model weights are loaded by the caller from the same folder (it is an HF model folder).

    Raises CheckpointError naming the file when `trainer_state.pt` holds anything but tensors and
    plain data (see `read_trainer_state`) or `state.json` is not a JSON object with a step."""
    path = Path(path)
    trainer_state = read_trainer_state(path / TRAINER_STATE_FILE)
    state = read_state(path)
    rng = trainer_state.pop("rng", None)
    if rng:
        _restore_rng(rng, path / TRAINER_STATE_FILE)
    return trainer_state, state


def read_state(path: str | Path) -> dict:
    """A checkpoint folder's `state.json` (step, data position, ...); CheckpointError names the
    file when it is not a JSON object with an integer `step`."""
    file = Path(path) / STATE_FILE
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot be read as JSON ({e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{file}: expected a JSON object with an integer 'step', got {str(state)[:100]!r}")
    return state


def export_checkpoint(
    output_dir: str | Path, out: str | Path, step: int | None = None, lora: str | None = None
) -> Path:
    """Copy checkpoint `step` of a run (default: the newest complete one) to `out` as a plain
    Hugging Face folder (model and tokenizer files, no optimizer or loop state), atomically.

    A LoRA run's checkpoint holds an adapter: `lora` "merged" (the default for one) writes the base
    model with the adapter folded in (`W + s · B A`, through peft), "adapter" the peft adapter
    folder (`peft.PeftModel.from_pretrained(base, out)` loads it) with the tokenizer.

    Raises:
        FileNotFoundError: the run has no complete checkpoint, or none at `step` (the message lists
            the steps it has).
        FileExistsError: `out` exists and is not empty (nothing is overwritten).
        ValueError: `lora` is given for a checkpoint without an adapter, or is not merged/adapter.
    """
    from tidal.train.lora import is_adapter

    if lora not in (None, "merged", "adapter"):
        raise ValueError(f"--lora: merged or adapter, got {lora!r}")
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
    folder = found[step]
    verify_checkpoint(folder)  # a damaged file is named, not copied out
    adapter = is_adapter(folder)
    if lora is not None and not adapter:
        raise ValueError(
            f"--lora {lora}: {folder} holds a full model, not a LoRA adapter (the run had train.lora_rank 0)"
        )
    with atomic_directory(out) as tmp:
        write_plain_folder(folder, tmp, merge=adapter and lora != "adapter", run_dir=output_dir)
    return out


def write_plain_folder(folder: Path, out: Path, merge: bool, run_dir: str | Path | None = None) -> None:
    """Write checkpoint `folder`'s model and tokenizer files into the folder `out` (no optimizer or
    loop state): with `merge`, a LoRA adapter's base model with the adapter folded in (the base
    is found by `adapter_base`), else the files as they are. `tidal export` writes this, and
    `tidal eval` / `tidal serve` load a LoRA checkpoint through it."""
    if merge:
        merge_adapter(folder, out, adapter_base(folder, run_dir))
    for src in folder.iterdir():
        if src.name in (STATE_FILE, TRAINER_STATE_FILE) or (merge and "adapter_" in src.name):
            continue
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, out / src.name)


def run_model(run_dir: str | Path | None) -> str | None:
    """`train.model` of the run whose `config.json` is in `run_dir`, or None when there is none."""
    if run_dir is None:
        return None
    try:
        saved = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    train = saved.get("train") if isinstance(saved, dict) else None
    model = train.get("model") if isinstance(train, dict) else None
    return model if isinstance(model, str) else None


def adapter_base(folder: Path, run_dir: str | Path | None = None) -> Path:
    """The base model folder of the LoRA adapter in `folder`: its `adapter_config.json`'s
    `base_model_name_or_path`, else the run's `train.model` (the bundled model's name too).
    A relative path is read from the current folder, as the run read it from the folder it was
    started in; FileNotFoundError names both and what to do when neither is a model folder."""
    from tidal.convert import BUNDLED_NAMES, ensure_model

    config_file = folder / "adapter_config.json"
    try:
        named = json.loads(config_file.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{config_file}: cannot read the adapter's config ({e})") from None
    tried = [c for c in dict.fromkeys([named, run_model(run_dir)]) if c]
    for candidate in tried:
        if candidate.lower() in BUNDLED_NAMES:
            return ensure_model(candidate)
        if (Path(candidate).expanduser() / "config.json").is_file():
            return Path(candidate).expanduser()
    also = f" or the run's train.model {tried[1]!r}" if len(tried) > 1 else ""
    raise FileNotFoundError(
        f"{config_file}: the adapter's base model {named!r} (base_model_name_or_path){also} is not a model "
        f"folder here (a relative path is read from the current folder {Path.cwd()}); run from the folder the run "
        "was started in, or export the adapter with `tidal export RUN --lora adapter` and merge it onto the base "
        "model where that lives"
    )


def merge_adapter(folder: Path, out: Path, base: Path) -> None:
    """The `base` model with the adapter in `folder` folded in (`W + s · B A`, through peft), saved
    to `out` as fp32 safetensors."""
    import warnings

    from peft import PeftModel

    from tidal.train.model import load_causal_lm

    with warnings.catch_warnings():
        # peft calls transformers' is_gradient_checkpointing, deprecated in transformers 5: its
        # FutureWarning is addressed to peft, not to whoever exports or serves a checkpoint
        warnings.simplefilter("ignore", FutureWarning)
        merged = PeftModel.from_pretrained(load_causal_lm(base), str(folder)).merge_and_unload()
    merged.save_pretrained(str(out), safe_serialization=True)
