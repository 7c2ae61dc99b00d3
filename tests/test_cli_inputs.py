"""Hostile input through the real `tidal train`, run as a user runs it (a subprocess): a
checkpoint crafted to run code on `--resume` ends with one `tidal train: ...` line naming the
file, exit status 1 and no traceback, and nothing in the crafted file runs."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from conftest import make_model

from tidal.train import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 600  # a bound, not a pace: these runs stop at start, in seconds


def tidal_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m tidal.cli ARGS` with this checkout (and the tests' helpers) importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run(
        [sys.executable, "-m", "tidal.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The `tidal train: ...` line a failed run printed last; no traceback anywhere."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tidal train: "), proc.stderr[-3000:]
    return last[len("tidal train: ") :]


class RunsCode:
    """Unpickling this runs `touch MARKER`, as the probe's crafted trainer_state.pt ran a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def test_resume_refuses_a_checkpoint_that_would_run_code(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    step = ckpt.save_checkpoint(run, 2, make_model().save_pretrained, None, {"optimizer": {}}, {"data": {}})
    marker = tmp_path / "code_ran"
    torch.save({"optimizer": {}, "rng": RunsCode(marker)}, step / "trainer_state.pt")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))

    proc = tidal_cli(
        "train", "--resume", f"--train.output_dir={run}", f"--train.model={tiny_model_dir}", "--train.num_steps=4",
        cwd=tmp_path,
    )  # fmt: skip
    message = one_line_error(proc)
    assert message.startswith(f"{step / 'trainer_state.pt'}: refused to load: it holds Python objects other than ")
    assert "could run code" in message and "GLOBAL posix.system" in message
    assert not marker.exists()
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # refused before anything is written
