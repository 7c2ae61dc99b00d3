"""Hostile and broken input through the real `tidal train`, run as a user runs it (a subprocess):
a checkpoint crafted to run code on `--resume`, data files that are broken or empty. Each ends
with one `tidal train: ...` line naming the file, exit status 1 and no traceback, and nothing
in the crafted file runs. The runs are forked from one process that imported tidal once
(`CliForks`): the same command line, output and exit status, without importing torch each time."""

from __future__ import annotations

import json
import os
import select
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_model

from tidal.train import checkpoint as ckpt

# one worker runs them all, so one process imports tidal for them (`CliForks`)
pytestmark = pytest.mark.xdist_group("cli_forks")

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


class CliForks:
    """`tidal_cli` for many runs: each run is a process forked from one that imported tidal, torch
    and transformers once (tests/cli_forks.py), with the same arguments, environment, working
    folder, output and exit status as `python -m tidal.cli ARGS` started on its own."""

    def __init__(self, tmp: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
        self.tmp, self.runs = tmp, 0
        self.server = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "cli_forks.py")],
            cwd=tmp,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def __call__(self, *args: str, cwd: Path) -> subprocess.CompletedProcess:
        self.runs += 1
        out, err = self.tmp / f"run{self.runs}.out", self.tmp / f"run{self.runs}.err"
        request = {"args": list(args), "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        # the answer comes when the run has ended: bounded as `tidal_cli` bounds a run
        if not select.select([self.server.stdout], [], [], CLI_TIMEOUT_S)[0]:
            self.server.kill()
            raise AssertionError(f"tidal {' '.join(args)} did not end within {CLI_TIMEOUT_S} s")
        reply = self.server.stdout.readline()
        assert reply, f"tests/cli_forks.py ended (exit status {self.server.wait(CLI_TIMEOUT_S)})"
        code = json.loads(reply)["returncode"]
        return subprocess.CompletedProcess(["tidal", *args], code, out.read_text(), err.read_text())

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(CLI_TIMEOUT_S)


@pytest.fixture(scope="module")
def tidal_cli_runs(tmp_path_factory):
    runs = CliForks(tmp_path_factory.mktemp("cli_forks"))
    yield runs
    runs.close()


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


def test_resume_refuses_a_checkpoint_that_would_run_code(tidal_cli_runs, tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    step = ckpt.save_checkpoint(run, 2, make_model().save_pretrained, None, {"optimizer": {}}, {"data": {}})
    marker = tmp_path / "code_ran"
    torch.save({"optimizer": {}, "rng": RunsCode(marker)}, step / "trainer_state.pt")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))

    proc = tidal_cli_runs(
        "train", "--resume", f"--train.output_dir={run}", f"--train.model={tiny_model_dir}", "--train.num_steps=4",
        cwd=tmp_path,
    )  # fmt: skip
    message = one_line_error(proc)
    assert message.startswith(f"{step / 'trainer_state.pt'}: refused to load: it holds Python objects other than ")
    assert "could run code" in message and "GLOBAL posix.system" in message
    assert not marker.exists()
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # refused before anything is written


def _empty(path: Path) -> None:
    path.write_text("")


def _blank_lines(path: Path) -> None:
    path.write_text("\n\n")


def _bad_json(path: Path) -> None:
    path.write_text('{"prompt": "1+1", "label": "2"}\n{"prompt": "2+2", "label": \n')


def _missing_key(path: Path) -> None:
    path.write_text('{"prompt": "1+1", "label": "2"}\n{"question": "2+2"}\n')


def _not_utf8(path: Path) -> None:
    path.write_bytes(b'{"prompt": "1+1"}\n{"prompt": "\xff\xfe"}\n')


def _all_too_long(path: Path) -> None:
    path.write_text("".join(json.dumps({"prompt": "x" * 400, "label": "1"}) + "\n" for _ in range(3)))


@pytest.mark.parametrize(
    "write, extra, expected",
    [
        (_empty, [], "data.path {f}: the file is empty: it holds no prompts"),
        (_blank_lines, [], "data.path {f}: the file is empty: it holds no prompts"),
        (
            _empty,
            ["--data.streaming=true"],
            "data.path {f}: the file is empty: it holds no prompts",
        ),
        (
            _empty,
            ["--algo.mode=sft"],
            "data.path {f}: the file is empty: it holds no sft samples",
        ),
        (_bad_json, [], "{f}:2: invalid JSON: Expecting value: line 1 column 28 (char 27)"),
        (
            _missing_key,
            [],
            "{f}:2: missing key 'prompt' (set data.input_key to the field that holds the prompt)",
        ),
        (_not_utf8, [], "{f}:2: not UTF-8: "),
        (
            _all_too_long,
            [],
            "data.path {f}: all 3 prompts are longer than data.max_prompt_length (256 tokens); "
            "raise data.max_prompt_length or shorten them",
        ),
    ],
    ids=["empty", "blank-lines", "empty-streamed", "empty-sft", "bad-json", "missing-key", "not-utf8", "too-long"],
)
def test_a_bad_data_file_is_one_line_naming_it(tidal_cli_runs, tiny_model_dir, tmp_path, write, extra, expected):
    data = tmp_path / "prompts.jsonl"
    write(data)
    run = tmp_path / "run"
    proc = tidal_cli_runs(
        "train", f"--data.path={data}", f"--train.model={tiny_model_dir}", f"--train.output_dir={run}", *extra,
        cwd=tmp_path,
    )  # fmt: skip
    assert one_line_error(proc).startswith(expected.format(f=data))
    assert not run.exists()  # the data is read before the run folder is made


def test_tidal_eval_names_a_bad_eval_set_in_one_line(tidal_cli_runs, tiny_model_dir, tmp_path):
    data = tmp_path / "eval.jsonl"
    _missing_key(data)
    proc = tidal_cli_runs("eval", str(tiny_model_dir), f"--dataset={data}", "--engine.dtype=float32", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"tidal eval: {data}:2: missing key 'prompt' (set data.input_key to the field that holds the prompt)"
    )
