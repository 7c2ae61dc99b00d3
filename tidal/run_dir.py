"""Run folder safety: a new run never writes into an old one, a resumed run is the same run.

`check_run_dir` runs before anything is loaded or written and decides where a run starts:

* a new run (no `--resume`) needs `train.output_dir` missing or empty; otherwise it would
  truncate the old run's metrics and mix its checkpoints with the new ones;
* `--resume` continues from the newest complete checkpoint (`tidal.train.checkpoint`) and compares
  the config with the run's saved `config.json`, field by field. A field that only changes how the
  run is paced, watched or placed is allowed and logged:

      train.num_steps, train.save_interval, train.keep_checkpoints, train.num_threads,
      train.gradient_checkpointing, train.offload_optimizer, train.logits_chunk_tokens (same math,
      less memory), cluster.device,
      engine.request_timeout, reward.timeout, engine.urls, engine.api_key(_file),
      engine.max_num_seqs, engine.kv_cache_tokens, cluster.address, cluster.sync_timeout,
      cluster.sync_base_timeout, cluster.sync_min_mb_per_s, cluster.sync_dir, cluster.cpus_per_trainer,
      cluster.cpus_per_engine,
      and every field of the `log` and `eval` groups.

  Any other difference (model, data, algorithm, batch sizes, learning rate, seeds, precision,
  sampling, reward, cluster shape: everything that changes what the run learns, and fields added
  later, until someone puts them on the list above) is an error naming each field with its old and
  new value, unless the caller passes `allow_config_change` (`tidal train --allow-config-change`).
  A field missing from an older `config.json` counts as its default. A resume whose checkpoint is
  already at `train.num_steps` is an error too: it would train nothing, and so is a checkpoint
  whose `trainer_state.pt` holds anything but tensors and plain data (it is never unpickled as
  arbitrary Python, `tidal.train.checkpoint.read_trainer_state`).

`RunFolder` holds the folder for the run's life: an exclusive lock (`flock` on the folder, which
the kernel drops when the process ends, however it ends: a dead run's lock never blocks the next),
so a second run started on the same folder is refused instead of mixing its metrics and
checkpoints in. Its `start` writes `config.json` and clears what an interrupted checkpoint save
left; the loop calls it only once every check has passed: the config, user code, the model,
tokenizer and data, the engines answering and taking the first weight push. A start that fails
before that leaves the folder as it was: what it created there is removed (a new run's folder too).
The lock is local to a machine: two runs on two machines sharing a network folder are not kept apart.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.config import Config, redact, upgrade
from tidal.options import ConfigError
from tidal.train.checkpoint import (
    TRAINER_STATE_FILE,
    latest_checkpoint,
    read_state,
    read_trainer_state,
    remove_stale_saves,
    verify_checkpoint,
)
from tidal.utils import atomic_write_json

log = logging.getLogger("tidal")

CONFIG_FILE = "config.json"
HARMLESS_FIELDS = frozenset(
    {
        "train.num_steps",
        "train.save_interval",
        "train.keep_checkpoints",
        "train.num_threads",
        "train.gradient_checkpointing",
        "train.offload_optimizer",
        "train.logits_chunk_tokens",
        "cluster.device",
        "engine.request_timeout",
        "agent.request_timeout",
        "reward.timeout",
        "engine.urls",
        "engine.api_key",
        "engine.api_key_file",
        "engine.max_num_seqs",
        "engine.kv_cache_tokens",
        "cluster.address",
        "cluster.sync_timeout",
        "cluster.sync_base_timeout",
        "cluster.sync_min_mb_per_s",
        "cluster.sync_dir",
        "cluster.cpus_per_trainer",
        "cluster.cpus_per_engine",
        "debug.save_rollout",  # only writes a copy of each rollout
    }
)
HARMLESS_GROUPS = ("log", "eval")
NOT_COMPARED = frozenset({"train.output_dir"})  # the same folder, however it is spelled


class RunDirError(ConfigError):
    """The output folder does not fit the requested start (new run or resume)."""


@dataclass(frozen=True)
class ConfigChange:
    field: str
    old: Any
    new: Any

    @property
    def harmless(self) -> bool:
        return self.field in HARMLESS_FIELDS or self.field.partition(".")[0] in HARMLESS_GROUPS

    def __str__(self) -> str:
        return f"{self.field}: {self.old!r} -> {self.new!r}"


def _flatten(cfg: dict) -> dict[str, Any]:
    return {
        f"{group}.{key}": value
        for group, body in cfg.items()
        if isinstance(body, dict) and group != "resolved"
        for key, value in body.items()
    }


def config_changes(saved: dict, current: dict, defaults: dict | None = None) -> list[ConfigChange]:
    """The fields whose value differs between two `Config.to_dict()`s, in `current`'s order.
    A field `saved` lacks (written by an older tidal) is compared as its value in `defaults`.
    Secret fields are compared masked (`redact`), so no key reaches the log, even one an older
    tidal wrote into config.json."""
    old, new = _flatten(redact(upgrade(saved))), _flatten(redact(current))
    base = _flatten(defaults or Config().to_dict())
    missing = object()
    changes = []
    for name, value in new.items():
        before = old.get(name, base.get(name, missing))
        if name not in NOT_COMPARED and before != value:
            changes.append(ConfigChange(name, None if before is missing else before, value))
    return changes


def check_run_dir(cfg: Config, resume: bool, allow_config_change: bool = False) -> Path | None:
    """Validate `cfg.train.output_dir` for a new run or a resume; write nothing.

    Returns the checkpoint to resume from, or None to start at step 0.
    Raises RunDirError naming the folder or the changed fields and the ways out, CheckpointError
    naming the checkpoint file that cannot be loaded safely."""
    out = Path(cfg.train.output_dir)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"train.output_dir: {out} is a file, expected a folder for the run")
    if not resume:
        held = sorted(p.name for p in out.iterdir()) if out.exists() else []
        if held:
            raise RunDirError(
                f"train.output_dir: {out} already holds a run ({', '.join(held[:5])}); "
                "a new run there would overwrite its metrics and mix its checkpoints. Continue that run with "
                "--resume, or start this one in a new or empty folder with --train.output_dir=NEW_FOLDER"
            )
        return None

    saved_file = out / CONFIG_FILE
    if saved_file.is_file():
        try:
            saved = json.loads(saved_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RunDirError(f"{saved_file}: not valid JSON ({e}); cannot check the resumed config against it") from e
        _check_changes(config_changes(saved, cfg.to_dict()), saved_file, allow_config_change)

    ckpt = latest_checkpoint(out)
    if ckpt is None:
        log.warning("resume: no complete checkpoint in %s, starting from step 0", out / "checkpoints")
        return None
    step = read_state(ckpt)["step"]
    # refuse an unsafe or damaged trainer state now, before engines start and anything is written
    # (mapped, not read: the real load comes later, after the model is built)
    read_trainer_state(ckpt / TRAINER_STATE_FILE, mmap=True)
    verify_checkpoint(ckpt)  # then every file as it was written: a truncated one is named here
    if step >= cfg.train.num_steps:
        raise RunDirError(
            f"train.num_steps: the newest checkpoint {ckpt} is at step {step}, so num_steps "
            f"{cfg.train.num_steps} leaves nothing to train; set --train.num_steps above {step} to go on"
        )
    return ckpt


def _check_changes(changes: list[ConfigChange], saved_file: Path, allowed: bool) -> None:
    for c in changes:
        if c.harmless or allowed:
            log.info("resume: %s changed since %s: %r -> %r", c.field, saved_file, c.old, c.new)
    meaningful = [c for c in changes if not c.harmless]
    if meaningful and not allowed:
        raise RunDirError(
            f"--resume: the config differs from the run's {saved_file} in fields that change what it learns:\n  "
            + "\n  ".join(map(str, meaningful))
            + "\nresume with the saved values, start a new run in a new train.output_dir, or pass "
            "--allow-config-change to continue with the new ones"
        )


class RunFolder:
    """`train.output_dir`, held by this run: `with RunFolder(path) as folder: ...; folder.start(record)`.

    Entering creates the folder where it is missing and takes its exclusive lock, or raises
    RunDirError naming the folder when another run holds it. Leaving releases the lock; a run that
    leaves before `start` (an error anywhere in its start) removes what it created in the folder,
    and the folder itself when it created it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.started = False

    def __enter__(self) -> RunFolder:
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"train.output_dir: {self.path} is a file, expected a folder for the run")
        self.created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise RunDirError(
                f"train.output_dir: {self.path} is in use by another tidal run on this machine (it holds the "
                "folder's lock, which a run that ends or dies gives up at once); wait for that run to end, or give "
                "this one another --train.output_dir"
            ) from None
        self._before = set(os.listdir(self.path))
        return self

    def start(self, config_record: dict) -> None:
        """From here on the folder holds this run: remove temp folders a killed checkpoint save left
        and write `config.json` (`config_record`: the config dict, with what was resolved at start)."""
        remove_stale_saves(self.path)
        atomic_write_json(self.path / CONFIG_FILE, config_record)
        self.started = True

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None and not self.started:
                self._restore()
        finally:
            os.close(self._fd)  # the lock goes with it

    def _restore(self) -> None:
        """Remove what a failed start put in the folder (SGLang logs, a disk weight push), the
        folder itself when this run made it."""
        for name in set(os.listdir(self.path)) - self._before:
            path = self.path / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if self.created and not any(self.path.iterdir()):
            self.path.rmdir()
