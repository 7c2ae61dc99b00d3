"""The MODEL of `tidal eval` and `tidal serve`: what training writes, or any model folder.

`locate_model` reads what MODEL names without loading anything (so user code can be checked
first, and a wrong path is one line, not a traceback):

* a run folder (`train.output_dir`, or its `checkpoints/` folder): its newest complete checkpoint;
* a checkpoint folder (`RUN/checkpoints/step_N`), of a full run or a LoRA run;
* a LoRA adapter folder (`tidal export --lora adapter`, or peft's own);
* a Hugging Face model folder (`config.json` and weights, e.g. `tidal export`'s);
* `smollm2`, the bundled SmolLM2-135M-Instruct (converted on first use).

`model_folder` then gives the folder an engine loads, with the tokenizer beside the weights: a
checkpoint as it is; a LoRA adapter merged onto its base model by the code `tidal export` uses
(`tidal.train.checkpoint.write_plain_folder`), in a temporary folder removed afterwards. The
tokenizer is the checkpoint's own (the loop saves it with every checkpoint), else the adapter's
base model's or the run's `train.model`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tidal.convert import BUNDLED_NAMES, TOKENIZER_FILES, ensure_model
from tidal.train.checkpoint import (
    STATE_FILE,
    TRAINER_STATE_FILE,
    adapter_base,
    checkpoint_root,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    run_model,
    verify_checkpoint,
    write_plain_folder,
)
from tidal.types import InputError

log = logging.getLogger("tidal")

RUN_CONFIG = "config.json"  # a run folder's record of its config (tidal.run_dir.CONFIG_FILE)
ADAPTER_CONFIG = "adapter_config.json"  # a LoRA adapter folder's (tidal.train.lora.ADAPTER_CONFIG)
EXPECTED = (
    "expected a run folder (train.output_dir), a checkpoint folder (RUN/checkpoints/step_N, full or LoRA), "
    "a Hugging Face model folder (config.json and weights) or smollm2"
)


class ModelError(InputError):
    """MODEL names nothing `tidal eval` / `tidal serve` can load; the message says what was
    expected and what was found."""


@dataclass(frozen=True)
class ModelSource:
    """What a MODEL argument names.

    `folder` is the model, checkpoint or adapter folder (None for the bundled model until it is
    converted); `run_dir` the run it belongs to when it is one of a run's checkpoints (its
    `config.json` holds the run's config); `step` that checkpoint's step; `adapter` whether the
    folder holds a LoRA adapter, merged onto its base model on load."""

    given: str
    folder: Path | None
    run_dir: Path | None = None
    step: int | None = None
    adapter: bool = False

    @property
    def run_config(self) -> Path | None:
        """The run's `config.json`, when MODEL is a run or one of its checkpoints and it is there."""
        if self.run_dir is None or not (self.run_dir / RUN_CONFIG).is_file():
            return None
        return self.run_dir / RUN_CONFIG

    def describe(self) -> str:
        """One line for the log: what is loaded, from which run, merged or not."""
        if self.folder is None:
            return f"{self.given} (the bundled model)"
        what = str(self.folder)
        if self.step is not None:
            what += f" (step {self.step} of run {self.run_dir})" if self.run_dir else f" (step {self.step})"
        if self.adapter:
            what += ", a LoRA adapter merged onto its base model"
        return what


def _is_run_config(path: Path) -> bool:
    """Whether `path` is the config.json a tidal run writes (config groups), not a model's."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(saved, dict) and isinstance(saved.get("train"), dict) and "model_type" not in saved


def _is_run(path: Path) -> bool:
    return checkpoint_root(path).is_dir() or _is_run_config(path / RUN_CONFIG)


def _run_of(checkpoint: Path) -> Path | None:
    """The run folder a checkpoint folder sits in (`RUN/checkpoints/step_N`), if it is in one."""
    root = checkpoint.parent
    if root.name == checkpoint_root("").name and _is_run(root.parent):
        return root.parent
    return None


def _listing(path: Path, most: int = 6) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    if not names:
        return "it is empty"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return "it holds " + ", ".join(names[:most]) + more


def locate_model(model: str) -> ModelSource:
    """What `model` names (see the module's docstring), read from the folder's files alone.
    ModelError says what was expected and what was found."""
    if model.lower() in BUNDLED_NAMES:
        return ModelSource(model, None)
    path = Path(model).expanduser()
    if not path.exists():
        run = _run_of(path)
        steps = [str(step) for step, _ in list_checkpoints(run)] if run else []
        if steps:  # a checkpoint of a run that was not saved, or was pruned
            raise ModelError(
                f"model {model!r}: no such checkpoint; the complete checkpoints of run {run} are at steps "
                f"{', '.join(steps)} (or give the run folder for its newest)"
            )
        raise ModelError(f"model {model!r}: no such file or folder; {EXPECTED}")
    if not path.is_dir():
        raise ModelError(f"model {model!r}: a file, not a folder; {EXPECTED}")
    if path.name == checkpoint_root("").name and _is_run(path.parent):  # RUN/checkpoints
        path = path.parent
    if (path / STATE_FILE).is_file() or (path / TRAINER_STATE_FILE).is_file():  # a checkpoint
        if not is_complete(path):
            run = _run_of(path)
            newest = latest_checkpoint(run) if run else None
            alt = f"; the run's newest complete checkpoint is {newest}" if newest else ""
            raise ModelError(
                f"model {model!r}: an incomplete checkpoint ({STATE_FILE} and {TRAINER_STATE_FILE} are written last; "
                f"a save that was cut short leaves them out){alt}"
            )
        return _checkpoint(model, path, _run_of(path))
    if (path / ADAPTER_CONFIG).is_file():
        return ModelSource(model, path, adapter=True)
    if (path / "config.json").is_file() and not _is_run_config(path / RUN_CONFIG):
        return ModelSource(model, path)
    if _is_run(path):
        found = list_checkpoints(path)
        if not found:
            raise ModelError(
                f"model {model!r}: a run folder with no complete checkpoint in {checkpoint_root(path)} yet (the loop "
                "saves every train.save_interval steps and at the end); give a checkpoint or model folder instead"
            )
        return _checkpoint(model, latest_checkpoint(path) or found[-1][1], path)
    raise ModelError(f"model {model!r}: {path} is not a model, checkpoint or run folder ({_listing(path)}); {EXPECTED}")


def _checkpoint(given: str, folder: Path, run_dir: Path | None) -> ModelSource:
    step = int(folder.name.removeprefix("step_")) if folder.name.removeprefix("step_").isdigit() else None
    adapter = (folder / ADAPTER_CONFIG).is_file()
    if not adapter and not (folder / "config.json").is_file():
        raise ModelError(f"model {given!r}: checkpoint {folder} holds no model ({_listing(folder)})")
    return ModelSource(given, folder, run_dir, step, adapter)


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _tokenizer_donor(source: ModelSource) -> Path | None:
    """Where the tokenizer comes from when the folder has none: the adapter's base model, else the
    run's `train.model`; None when neither has one."""
    candidates = []
    if source.adapter:
        with contextlib.suppress(FileNotFoundError, InputError):
            candidates.append(adapter_base(source.folder, source.run_dir))
    model = run_model(source.run_dir)
    if model:
        candidates.append(ensure_model(model) if model.lower() in BUNDLED_NAMES else Path(model).expanduser())
    return next((c for c in candidates if c.is_dir() and has_tokenizer(c)), None)


def _copy_tokenizer(donor: Path, out: Path) -> None:
    """The tokenizer files of model folder `donor` (what `save_pretrained` of a tokenizer writes)."""
    for src in donor.iterdir():
        tokenizer_file = src.name.startswith(("tokenizer", "special_tokens_map", "added_tokens", "chat_template"))
        if src.is_file() and (tokenizer_file or src.name in TOKENIZER_FILES or src.name == "merges.txt"):
            (out / src.name).unlink(missing_ok=True)  # a link to the folder's own, partial, tokenizer
            shutil.copy2(src, out / src.name)


@contextlib.contextmanager
def model_folder(source: ModelSource) -> Iterator[Path]:
    """A folder an engine loads, with the model's tokenizer in it, for the life of the block.

    A checkpoint is verified first (every file's size and CRC-32, `verify_checkpoint`). A LoRA
    adapter is merged onto its base model into a temporary folder (fp32, removed on exit); so is
    a checkpoint without a tokenizer given one, by links to its files."""
    if source.folder is None:
        yield ensure_model(source.given)
        return
    folder = source.folder
    if source.step is not None:
        verify_checkpoint(folder)
    donor = None if has_tokenizer(folder) else _tokenizer_donor(source)
    if donor is None and not has_tokenizer(folder) and (source.step is not None or source.adapter):
        raise ModelError(
            f"model {source.given!r}: {folder} has no tokenizer (tokenizer.json or tokenizer.model), and neither "
            "has the model it was trained from (the adapter's base model, the run's train.model)"
        )
    if not source.adapter and donor is None:
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="tidal-model-") as tmp:
        out = Path(tmp)
        if source.adapter:
            log.info("merging the LoRA adapter of %s onto its base model", folder)
            write_plain_folder(folder, out, merge=True, run_dir=source.run_dir)
        else:
            for src in folder.iterdir():
                os.symlink(src.resolve(), out / src.name)
        if donor is not None and not has_tokenizer(out):
            log.info("tokenizer: %s has none; using %s's", folder, donor)
            _copy_tokenizer(donor, out)
        yield out
