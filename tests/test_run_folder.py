"""Issue 48's run-folder defects, driven through the real loop and CLI: two runs cannot share one
output folder (an exclusive lock for the run's life, given up by a dead run at once), user code is
loaded and checked before the model, nothing is written until every check (the engines and their
key included) has passed, a repeated --config is read in order, and Ctrl-C ends a run with one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import loop_config

import tidal.cli
import tidal.loop
from tidal.convert import load_tokenizer
from tidal.hooks import FORMS
from tidal.options import ConfigError
from tidal.run_dir import RunDirError
from tidal.server.options import ServerConfig
from tidal.sync.base import SyncError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
WAIT_S = 600  # a bound on waiting for a run to get somewhere, never a speed claim

HOLD = """
import sys
from tidal.run_dir import RunFolder
folder = RunFolder(sys.argv[1]).__enter__()
print("held", flush=True)
sys.stdin.read()  # until killed
"""


def small_run(model_dir, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        f"--train.model={model_dir}",
        f"--train.output_dir={out}",
        "--train.num_steps=3",
        "--train.global_batch_size=4",
        "--train.micro_batch_size=4",
        "--train.dtype=float32",
        "--engine.dtype=float32",
        "--rollout.rollout_batch_size=2",
        "--rollout.n_samples_per_prompt=2",
        "--rollout.max_new_tokens=4",
        "--reward.fn=conftest:token_parity_reward",
        "--reward.workers=0",
        "--data.env_args={n: 8}",
        "--log.tensorboard=false",
        *extra,
    ]


def test_a_folder_a_live_run_holds_is_refused_and_a_dead_runs_is_not(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError) as err:
            tidal.loop.train(loop_config(tiny_model_dir, run, **{"train.num_steps": 1}))
        assert str(err.value) == (
            f"train.output_dir: {run} is in use by another tidal run on this machine (it holds the folder's lock, "
            "which a run that ends or dies gives up at once); wait for that run to end, or give this one another "
            "--train.output_dir"
        )
        assert list(run.iterdir()) == []  # nothing written by the refused run
    finally:
        holder.kill()  # SIGKILL: no clean-up ran, and the kernel gave the lock up with the process
        holder.wait(timeout=60)
    assert len(tidal.loop.train(loop_config(tiny_model_dir, run, **{"train.num_steps": 1}))) == 1


def test_two_runs_started_on_one_folder_never_share_it(tiny_model_dir, tmp_path):
    """The probe's case: `tidal train ... & sleep 0.3; tidal train ... &` on one folder. One run
    trains; the other is refused naming the folder (in use, or already holding the first run if the
    first got there and finished first), and the folder's metrics are one run's, every line JSON."""
    run = tmp_path / "run"
    procs = []
    for _ in range(2):
        cmd = [sys.executable, "-m", "tidal.cli", *small_run(tiny_model_dir, run, "--debug.rollout_only=true")]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        time.sleep(0.3)
    outs = [(p.wait(timeout=WAIT_S), p.stderr.read().decode()) for p in procs]
    codes = sorted(code for code, _ in outs)
    assert codes == [0, 2], [err[-2000:] for _, err in outs]
    refused = next(err for code, err in outs if code == 2).strip().splitlines()[-1]
    assert refused.startswith(f"tidal train: train.output_dir: {run} ")
    assert "is in use by another tidal run" in refused or "already holds a run" in refused
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_user_code_is_checked_before_the_model_loads(tmp_path):
    """A reward module that does not import is named with its option before anything is loaded:
    here the model folder does not even exist, and the reward is what the error is about."""
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        tidal.loop.train(
            loop_config(
                tmp_path / "no-model-here",
                out,
                **{"reward.fn": "no_such_module_x:score", "rollout.generate": "also_missing_y:generate"},
            )
        )
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid config:"
    assert lines[1].startswith("  reward.fn: cannot load 'no_such_module_x:score': module 'no_such_module_x' not found")
    assert lines[1].endswith("a user function is given as pkg.module:fn (a module importable from the working "
                             "directory or PYTHONPATH) or path/to/file.py:fn")  # fmt: skip
    assert lines[2].startswith("  rollout.generate: cannot load 'also_missing_y:generate'")
    assert not out.exists()  # a failed start leaves no folder behind


@pytest.fixture
def no_model(monkeypatch):
    """The loop's model and tokenizer loaders, made to fail the test when called; the calls made."""
    calls = []

    def loaded(*args, **kwargs):
        calls.append(args)
        raise AssertionError("a model or tokenizer was loaded")

    monkeypatch.setattr(tidal.loop, "ensure_model", loaded)
    monkeypatch.setattr(tidal.loop, "load_tokenizer", loaded)
    return calls


@pytest.fixture
def user_project(tmp_path, monkeypatch):
    """A user's folder as the working directory, with `myrl/rewards.py`; the import path and the
    imported modules as they were afterwards (the command puts the working directory on it)."""
    (tmp_path / "myrl").mkdir()
    (tmp_path / "myrl" / "__init__.py").write_text("")
    (tmp_path / "myrl" / "rewards.py").write_text("def reverse_reward(sample):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    yield tmp_path
    for name in ("myrl", "myrl.rewards"):
        sys.modules.pop(name, None)


def snapshot(folder: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every path under `folder` with its bytes (None for a folder) and modification time."""
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def test_a_bad_reward_in_tidal_train_is_named_before_the_model_loads_and_makes_no_folder(
    tiny_model_dir, user_project, no_model, capsys
):
    """The issue's case: `--reward.fn myrl.rewards:...` misspelt. The error names the option, the
    path, where the module was looked for and the forms that work; the model was never loaded and
    no folder was made (not even the parent `runs/`), so the corrected command simply starts."""
    out = user_project / "runs" / "reverse"
    assert tidal.cli.main(small_run(tiny_model_dir, out, "--reward.fn=myrl.reward:reverse_reward")) == 2
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "tidal train: invalid config:",
        "  reward.fn: cannot load 'myrl.reward:reverse_reward': module 'myrl.reward' not found (No module named "
        f"'myrl.reward'); looked in the working directory {user_project}, PYTHONPATH (unset) and the installed "
        f"packages; {FORMS}",
    ]
    assert no_model == []
    assert not (user_project / "runs").exists()
    # spelt right, the module is found in the working directory and the run goes on to the model
    with pytest.raises(AssertionError, match="a model or tokenizer was loaded"):
        tidal.cli.main(small_run(tiny_model_dir, out, "--reward.fn=myrl.rewards:reverse_reward"))
    assert len(no_model) == 1
    assert not out.exists()  # that start failed too (the loader here refuses): nothing left behind


@pytest.mark.parametrize("resume", [True, False])
def test_a_bad_hook_leaves_an_existing_run_folder_exactly_as_it_was(
    tiny_model_dir, user_project, no_model, capsys, resume
):
    """A retry on a run's folder (with --resume, or a new run by mistake) with a hook that does not
    load: refused naming the hook, every file and folder of the run untouched (bytes and times)."""
    out = user_project / "run"
    (out / "checkpoints" / "step_2").mkdir(parents=True)
    (out / "config.json").write_text('{"train": {"num_steps": 4}}\n')
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (out / "checkpoints" / "step_2" / "state.json").write_text('{"step": 2}\n')
    before = snapshot(out)
    extra = ["--rollout.generate=tools", "--tools.names=[calculator, myrl/tools.py:search]"]
    assert tidal.cli.main(small_run(tiny_model_dir, out, *extra, *(["--resume"] if resume else []))) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"  tools.names: cannot load 'myrl/tools.py:search': file '{user_project}/myrl/tools.py' not found; {FORMS}"
    )
    assert no_model == []
    assert snapshot(out) == before


def test_a_start_the_engines_refuse_writes_nothing_and_the_corrected_run_starts(tiny_model_dir, tmp_path):
    """A wrong API key fails at the first weight push, after the model and the trainer loaded: the
    folder is left as it was (none), so the same command with the right key simply runs."""
    from tidal.adapters.async_engine import AsyncEngine
    from tidal.engine.llm_engine import LLMEngine
    from tidal.server.app import BackgroundServer, build_app

    core = LLMEngine(tiny_model_dir, load_tokenizer(tiny_model_dir), dtype="float32", kv_cache_tokens=4096)
    served = AsyncEngine(core)
    server = BackgroundServer(build_app(served, "tiny", ServerConfig(api_key="the-right-key"))).start()
    out = tmp_path / "run"
    remote = {"engine.kind": "remote", "engine.urls": [server.url], "train.num_steps": 1}
    try:
        with pytest.raises(SyncError, match="401"):
            tidal.loop.train(loop_config(tiny_model_dir, out, **remote, **{"engine.api_key": "a-wrong-key"}))
        assert not out.exists()
        history = tidal.loop.train(loop_config(tiny_model_dir, out, **remote, **{"engine.api_key": "the-right-key"}))
        assert len(history) == 1 and (out / "config.json").is_file()
    finally:
        server.stop()
        served.close()


def test_config_files_are_read_in_order(tmp_path):
    from tidal.config import build_config

    (tmp_path / "a.yaml").write_text("train:\n  lr: 2.0e-5\n  num_steps: 7\n")
    (tmp_path / "b.yaml").write_text("train:\n  lr: 3.0e-5\n")
    cfg = build_config([tmp_path / "a.yaml", tmp_path / "b.yaml"], {"train.seed": 4})
    assert (cfg.train.num_steps, cfg.train.lr, cfg.train.seed) == (7, 3e-5, 4)  # b over a, the command line over b


def test_a_repeated_config_on_the_command_line_keeps_both_files(tmp_path, monkeypatch):
    import tidal.cli

    seen = []
    monkeypatch.setattr(tidal.loop, "train", lambda cfg, **kw: seen.append(cfg))
    (tmp_path / "a.yaml").write_text("train:\n  num_steps: 7\n")
    (tmp_path / "b.yaml").write_text("train:\n  lr: 3.0e-5\n")
    args = ["train", "--config", str(tmp_path / "a.yaml"), "--config", str(tmp_path / "b.yaml")]
    assert tidal.cli.main(args) == 0
    assert (seen[0].train.num_steps, seen[0].train.lr) == (7, 3e-5)  # what only a.yaml set is kept


def test_ctrl_c_ends_a_run_with_one_line_naming_the_checkpoint(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    # steps enough that the run is still going whenever the signal comes (a loaded machine may
    # leave this process asleep for seconds while the tiny run takes 30 ms a step)
    cmd = [sys.executable, "-m", "tidal.cli", *small_run(tiny_model_dir, run, "--train.num_steps=1000000")]
    cmd.append("--train.save_interval=1")
    # its output goes to files: a pipe nobody reads fills up after a few hundred steps' log lines,
    # and the run then blocks on a write and never sees the signal
    log = tmp_path / "stderr.log"
    with open(log, "wb") as err_file:
        # Ctrl-C's default handling, as in a terminal: a test run started in the background (nohup,
        # `cmd &`) passes SIGINT ignored to its children, and Python then never raises on it
        proc = subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            deadline = time.monotonic() + WAIT_S
            # any checkpoint: only the newest few are kept, so step_1's may be gone when this looks
            while not any(run.glob("checkpoints/step_*/state.json")):
                assert proc.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, "the run saved no checkpoint in time"
                time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    err = log.read_text()
    assert code == 130, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    # the run's own last word (a library may still log a line of its own while shutting down)
    last = [line for line in err.splitlines() if line.startswith("tidal train: ")][-1]
    assert last.startswith("tidal train: stopped by Ctrl-C (SIGINT); the newest checkpoint is ")
    assert last.endswith(": continue with --resume")
    assert Path(last.split("the newest checkpoint is ")[1].split(":")[0]).parent == run / "checkpoints"
