"""The Python API (`tidal.make_config`, `tidal.run`, `tidal.evaluate`): the config the command
line builds, its error messages, and a run whose metrics come back to the caller."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import loop_values

import tidal
from tidal.config import build_config
from tidal.options import ConfigError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = "examples/quickstart/config.yaml"


def test_import_tidal_loads_neither_torch_nor_the_config_until_asked():
    code = (
        "import sys, tidal; before = sorted({'torch', 'tidal.config', 'yaml'} & set(sys.modules)); "
        "tidal.make_config; after = sorted({'torch', 'tidal.config'} & set(sys.modules)); print(before, after)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[] ['tidal.config']"  # making a config needs no torch either


def test_every_public_name_is_the_object_its_module_defines():
    import importlib

    assert set(tidal.__all__) == {*tidal._LAZY, "__version__"}
    for name, module in tidal._LAZY.items():
        assert getattr(tidal, name) is getattr(importlib.import_module(module), name), name
    assert set(tidal.__all__) <= set(dir(tidal))
    with pytest.raises(AttributeError, match="module 'tidal' has no attribute 'trainer'"):
        tidal.trainer  # noqa: B018 - reading it is the test


def cli_config(monkeypatch, argv: list[str]):
    """The Config `tidal train ARGV` builds and hands to the loop (which is not run)."""
    import tidal.loop
    from tidal.cli import main

    seen = []
    monkeypatch.setattr(tidal.loop, "train", lambda cfg, **kw: seen.append(cfg) or [])
    assert main(["train", *argv]) == 0
    return seen[0]


def test_make_config_builds_the_config_the_command_line_builds(monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = ["--config", QUICKSTART, "--train.num_steps", "2", "--rollout.n_samples_per_prompt", "8"]
    argv += ["--sampling.temperature", "0.7", "--data.env_args", "{level: 2, n: 50}"]
    from_cli = cli_config(monkeypatch, argv)
    by_group = tidal.make_config(
        QUICKSTART,
        train={"num_steps": 2},
        rollout={"n_samples_per_prompt": 8},
        sampling={"temperature": 0.7},
        data={"env_args": {"level": 2, "n": 50}},
    )
    by_key = tidal.make_config(
        QUICKSTART,
        overrides={
            "train.num_steps": 2,
            "rollout.n_samples_per_prompt": 8,
            "sampling.temperature": 0.7,
            "data.env_args": {"level": 2, "n": 50},
        },
    )
    assert by_group == from_cli and by_key == from_cli
    assert from_cli.train.num_steps == 2 and from_cli.rollout.n_samples_per_prompt == 8
    assert from_cli.train.lr == 2.0e-5  # from the file
    assert from_cli.data.env_args == {"level": 2, "n": 50}


def test_files_then_groups_then_dotted_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    later = tmp_path / "later.yaml"
    later.write_text("train:\n  lr: 3.0e-5\n  num_steps: 7\n")
    cfg = tidal.make_config(QUICKSTART, later, train={"lr": 4.0e-5}, overrides={"train.lr": 5.0e-5})
    assert cfg.train.num_steps == 7 and cfg.train.lr == 5.0e-5
    assert tidal.make_config(QUICKSTART, later, train={"lr": 4.0e-5}).train.lr == 4.0e-5
    assert tidal.make_config(QUICKSTART, later).train.lr == 3.0e-5
    assert tidal.make_config().train.model == "smollm2"  # the defaults alone are a valid config


def test_an_unknown_option_is_named_as_in_a_config_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  learning_rate: 1.0e-5\n")
    with pytest.raises(ConfigError) as from_file:
        build_config(str(path), {})
    with pytest.raises(ConfigError) as from_code:
        tidal.make_config(overrides={"train.learning_rate": 1.0e-5})
    with pytest.raises(ConfigError) as from_group:
        tidal.make_config(train={"learning_rate": 1.0e-5})
    # a file's error starts with the file (and the key's line where the config reader knows it)
    where, sep, what = str(from_file.value).partition(": unknown option 'train.learning_rate'")
    assert sep and re.fullmatch(re.escape(str(path)) + r"(:2)?", where)
    assert str(from_code.value) == f"make_config{sep}{what}" == str(from_group.value)


def test_a_group_given_a_value_or_an_unknown_group_is_refused():
    with pytest.raises(ConfigError) as e:
        tidal.make_config(train=3)
    assert str(e.value) == (
        "make_config: train= takes a dict of the train group's options, e.g. train={'<option>': value}; got int"
    )
    with pytest.raises(ConfigError, match="^make_config: unknown config group 'trian'; did you mean 'train'"):
        tidal.make_config(trian={"num_steps": 1})


def test_invalid_values_raise_the_command_lines_message(monkeypatch, capsys):
    from tidal.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["train", "--config", QUICKSTART, "--rollout.n_samples_per_prompt", "1", "--train.lr", "-1"]) == 2
    printed = capsys.readouterr().err
    with pytest.raises(ConfigError) as e:
        tidal.make_config(QUICKSTART, rollout={"n_samples_per_prompt": 1}, train={"lr": -1})
    assert printed == f"tidal train: {e.value}\n"
    assert str(e.value).startswith("invalid config:\n  ")
    assert "rollout.n_samples_per_prompt: grpo compares samples within a group, so it needs >= 2 (got 1)" in printed


def test_run_returns_each_steps_metrics_and_evaluate_matches_the_command(tiny_model_dir, tmp_path):
    from tidal.cli import main

    values = loop_values(tiny_model_dir, tmp_path / "run", **{"train.num_steps": 2})
    cfg = tidal.make_config(overrides=values)
    history = tidal.run(cfg)
    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        for key in ("reward/mean", "response/length_mean", "loss/pg", "actor/grad_norm", "time/step"):
            assert isinstance(row[key], float), key
        assert 0.0 <= row["reward/mean"] <= 1.0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == history  # what the run folder holds, no more
    checkpoint = tmp_path / "run" / "checkpoints" / "step_2"
    assert (checkpoint / "state.json").is_file()

    # what scoring reads (the reward, the engine, the prompts), as `tidal eval` takes it
    eval_values = {key: values[key] for key in ("reward.fn", "engine.dtype", "data.env_args")}
    eval_values["rollout.max_new_tokens"] = 4
    result = tidal.evaluate(
        tidal.make_config(overrides=eval_values, for_training=False), checkpoint, 6, n=1, temperature=0.0
    )
    scores = result["datasets"]["arithmetic"]
    assert scores["prompts"] == 6 and scores["samples"] == 6
    assert scores["mean_reward"] in {i / 6 for i in range(7)}
    out = tmp_path / "eval.json"
    argv = ["eval", str(checkpoint), "--greedy", "--num-prompts", "6", "--out", str(out)]
    argv += [f"--{key}={json.dumps(value)}" for key, value in eval_values.items()]
    assert main(argv) == 0
    assert json.loads(out.read_text()) == result
