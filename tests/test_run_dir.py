"""Run folders on the whole loop (tiny model): a new run never writes into an old one, a resume is
checked against the saved config, a failing start writes nothing, a kill during a checkpoint save
resumes from the previous checkpoint, and a resume at an epoch boundary trains the next epoch."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import loop_config

import tidal.loop
from tidal.config import REDACTED, Config
from tidal.run_dir import ConfigChange, RunDirError, config_changes

VOLATILE = ("time/", "perf/")  # wall-clock figures differ between any two runs


def stable(history):
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in history]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def one_step_run(tiny_model_dir, tmp_path_factory):
    """A finished 1-step run: (its folder, its files), copied by each test that changes it."""
    out = tmp_path_factory.mktemp("run")
    tidal.loop.train(loop_config(tiny_model_dir, out, **{"train.num_steps": 1}))
    return out


def copy_run(one_step_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(one_step_run, run)
    return run


def test_a_new_run_in_a_used_folder_is_an_error_and_changes_nothing(tiny_model_dir, one_step_run, tmp_path):
    run = copy_run(one_step_run, tmp_path)
    before = snapshot(run)
    with pytest.raises(RunDirError) as err:
        tidal.loop.train(loop_config(tiny_model_dir, run, **{"train.num_steps": 2}))
    assert str(err.value) == (
        f"train.output_dir: {run} already holds a run (checkpoints, config.json, metrics.jsonl, samples); "
        "a new run there would overwrite its metrics and mix its checkpoints. Continue that run with --resume, "
        "or start this one in a new or empty folder with --train.output_dir=NEW_FOLDER"
    )
    assert snapshot(run) == before
    # an empty folder is a fine place for a new run
    (tmp_path / "empty").mkdir()
    assert len(tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "empty", **{"train.num_steps": 1}))) == 1


def test_resume_names_the_changed_fields_and_refuses_meaningful_ones(tiny_model_dir, one_step_run, tmp_path, caplog):
    run = copy_run(one_step_run, tmp_path)
    before = snapshot(run)
    changed = {"train.num_steps": 2, "train.lr": 2e-3, "data.seed": 5, "log.log_samples": 0}
    with pytest.raises(RunDirError) as err:
        tidal.loop.train(loop_config(tiny_model_dir, run, **changed), resume=True)
    assert str(err.value) == (
        f"--resume: the config differs from the run's {run / 'config.json'} in fields that change what it learns:\n"
        "  data.seed: 0 -> 5\n"
        "  train.lr: 0.001 -> 0.002\n"
        "resume with the saved values, start a new run in a new train.output_dir, or pass --allow-config-change "
        "to continue with the new ones"
    )
    assert snapshot(run) == before

    # pace and logging may change: logged, and the run goes on from its checkpoint
    caplog.set_level("INFO", logger="tidal")
    history = tidal.loop.train(
        loop_config(tiny_model_dir, run, **{"train.num_steps": 2, "log.log_samples": 0}), resume=True
    )
    assert [h["step"] for h in history] == [1, 2]
    assert "train.num_steps changed since" in caplog.text and ": 1 -> 2" in caplog.text
    assert json.loads((run / "config.json").read_text())["train"]["num_steps"] == 2

    # a meaningful change goes through only when asked for explicitly
    cfg = loop_config(tiny_model_dir, run, **{"train.num_steps": 3, "train.lr": 2e-3})
    assert [h["step"] for h in tidal.loop.train(cfg, resume=True, allow_config_change=True)] == [1, 2, 3]
    assert json.loads((run / "config.json").read_text())["train"]["lr"] == 2e-3


def test_a_resume_that_would_train_nothing_is_an_error(tiny_model_dir, one_step_run, tmp_path):
    run = copy_run(one_step_run, tmp_path)
    with pytest.raises(RunDirError, match=r"newest checkpoint .*step_1 is at step 1, so num_steps 1 leaves nothing"):
        tidal.loop.train(loop_config(tiny_model_dir, run, **{"train.num_steps": 1}), resume=True)


def test_a_start_that_fails_writes_nothing(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    run = tmp_path / "run"
    tidal.loop.train(loop_config(model, run, **{"train.num_steps": 1}))
    before = snapshot(run)
    shutil.rmtree(model)  # the model folder moved away since
    with pytest.raises(FileNotFoundError, match="expected a local Hugging Face folder with config.json"):
        tidal.loop.train(loop_config(model, run, **{"train.num_steps": 2}), resume=True)
    assert snapshot(run) == before
    # a new run whose model is wrong leaves no folder behind either
    with pytest.raises(FileNotFoundError):
        tidal.loop.train(loop_config(model, tmp_path / "new"))
    assert not (tmp_path / "new").exists()


def test_config_changes_compare_field_by_field():
    saved = {"train": {"lr": 1e-3, "output_dir": "a"}, "log": {"console": True}, "resolved": {"x": 1}}
    current = {"train": {"lr": 1e-3, "output_dir": "./a", "keep_checkpoints": 3}, "log": {"console": False}}
    changes = config_changes(saved, current, defaults={"train": {"keep_checkpoints": 3}})
    assert changes == [ConfigChange("log.console", True, False)]  # a field missing before = its default
    assert changes[0].harmless and not ConfigChange("train.lr", 1, 2).harmless
    assert config_changes({}, {"train": {"new_field": 1}}, defaults={}) == [ConfigChange("train.new_field", None, 1)]


def test_a_key_an_older_run_saved_is_compared_masked_and_never_logged():
    saved = {"rollout": {"api_key": "sk-old-0123456789", "seed": 0}}
    current = Config().to_dict()
    changes = [c for c in config_changes(saved, current) if c.field == "engine.api_key"]
    assert changes == [ConfigChange("engine.api_key", REDACTED, None)]  # it was set, now it is not
    assert "sk-old" not in str(config_changes(saved, current))
    same = {"rollout": {"api_key": "sk-new-9876543210"}}  # a different key is not a change worth a line
    assert not [c for c in config_changes(saved, same, defaults=current) if c.field == "engine.api_key"]


KILL_DURING_SAVE = """
import os, signal, sys
from conftest import loop_config
import tidal.loop
from tidal.train.actor import Actor

real = Actor.save_model

def save_then_die(self, path):
    real(self, path)  # the model files of step 4 are in the temp folder; the rest is not written yet
    if os.path.basename(path).startswith(".step_4."):
        os.kill(os.getpid(), signal.SIGKILL)

Actor.save_model = save_then_die
tidal.loop.train(loop_config(sys.argv[1], sys.argv[2], **{"train.save_interval": 2}))
"""


def test_a_run_killed_during_a_save_resumes_from_the_previous_checkpoint(tiny_model_dir, tmp_path):
    full = tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "full", **{"train.save_interval": 2}))
    run = tmp_path / "cut"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.getcwd()])}
    proc = subprocess.run(
        [sys.executable, "-c", KILL_DURING_SAVE, str(tiny_model_dir), str(run)], env=env, capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    root = run / "checkpoints"
    [stale] = root.glob(".step_4.*")  # the killed save's temp folder, model files only
    assert (stale / "model.safetensors").exists() and not (stale / "state.json").exists()
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["latest", "step_2"]

    resumed = tidal.loop.train(loop_config(tiny_model_dir, run, **{"train.save_interval": 2}), resume=True)
    assert stable(resumed) == stable(full)  # steps 3 and 4 redone from step 2, exactly
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_4"]  # temp folder gone


def test_a_resume_at_an_epoch_boundary_trains_the_next_epoch(tiny_model_dir, tmp_path):
    # 8 prompts, 4 per step: an epoch is 2 steps. The first run stops (and saves) exactly at its end.
    over = {"data.env_args": {"n": 8}}
    full = tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "full", **over))
    first = tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "cut", **over, **{"train.num_steps": 2}))
    assert [h["data/epoch"] for h in first] == [0.0, 1.0]
    resumed = tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "cut", **over), resume=True)
    assert [h["step"] for h in resumed] == [1, 2, 3, 4]
    assert [h["data/epoch"] for h in resumed] == [0.0, 1.0, 1.0, 2.0]
    assert stable(resumed) == stable(full)


def test_the_cli_prints_the_run_folder_error_and_exits_2(tiny_model_dir, one_step_run, capsys):
    from tidal.cli import main

    argv = ["train", f"--train.output_dir={one_step_run}", f"--train.model={tiny_model_dir}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tidal train: train.output_dir: {one_step_run} already holds a run (")
    assert "Continue that run with --resume, or start this one in a new or empty folder" in err
