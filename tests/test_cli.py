"""tidal.cli: `tidal train --help`, overrides, error exits; training itself is replaced by a stub."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing

import pytest

from tidal.cli import main
from tidal.config import GROUPS, Config
from tidal.options import type_name as _type_name


@pytest.fixture
def fake_loop(monkeypatch):
    """Stand-in for `tidal.loop` (imported inside main), recording each train() call.

    A fake module instead of patching the real one keeps torch/transformers out of these tests."""
    calls: list[tuple[Config, bool]] = []
    mod = types.ModuleType("tidal.loop")
    mod.train = lambda cfg, resume=False, allow_config_change=False: calls.append((cfg, resume))
    mod.setup_logging = lambda: None
    monkeypatch.setitem(sys.modules, "tidal.loop", mod)
    return calls


def collapse(text: str) -> str:
    """argparse wraps help text at the terminal width; compare with whitespace collapsed."""
    return " ".join(text.split())


def test_train_help_lists_every_option_with_default(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    flat = collapse(out)
    defaults = Config()
    n = 0
    for group in GROUPS:
        assert f"{group} options:" in out
        group_cfg = getattr(defaults, group)
        hints = typing.get_type_hints(type(group_cfg))
        for f in dataclasses.fields(group_cfg):
            option = f"--{group}.{f.name}"
            assert option in out
            metavar = _type_name(hints[f.name]).upper()
            default = getattr(group_cfg, f.name)
            assert f"{option} {metavar} {f.metadata['help']} (default: {default!r})" in flat
            n += 1
    assert n == sum(len(dataclasses.fields(getattr(defaults, g))) for g in GROUPS) > 100
    assert "--train.lr FLOAT AdamW learning rate (default: 1e-06)" in flat
    assert "(default: 1e-06)" in flat
    assert "--algo.eps_clip_high FLOAT OR NULL" in flat
    assert "--config FILE" in flat
    assert "--resume" in flat


def test_invalid_override_exits_2_without_training(fake_loop, capsys):
    assert main(["train", "--train.num_steps=0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "tidal train: invalid config:\n  train.num_steps: must be >= 1, got 0\n"
    assert fake_loop == []


def test_wrong_type_override_exits_2(fake_loop, capsys):
    assert main(["train", "--train.num_steps=ten"]) == 2
    assert capsys.readouterr().err == "tidal train: command line: train.num_steps: expected int, got 'ten'\n"
    assert fake_loop == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--train.lrr=1"], "unknown option '--train.lrr'; did you mean '--train.lr'?"),
        (["--train.num_step", "3"], "unknown option '--train.num_step'; did you mean '--train.num_steps'?"),
        (["--train.num=1"], "unknown option '--train.num'; did you mean '--train.num_steps'?"),  # no prefixes
        (["--rollout.rewardkey=acc"], "unknown option '--rollout.rewardkey'; did you mean '--reward.key'?"),
        (["--zzzzzz"], "unknown option '--zzzzzz'; see tidal train --help"),
    ],
)
def test_a_typo_on_the_command_line_names_the_closest_option(fake_loop, capsys, argv, message):
    # argparse alone says "unrecognized arguments"; the YAML path already suggests a key
    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"tidal train: error: {message}"
    assert fake_loop == []


def test_a_typo_in_eval_options_names_the_closest_option(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "model", "--num-promts=3"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "tidal eval: error: unknown option '--num-promts'; did you mean '--num-prompts'?"
    )


@pytest.mark.parametrize("argv", [["--train.lr=1e-5"], ["--train.lr", "1e-5"]])
def test_lr_override_both_forms(fake_loop, argv):
    assert main(["train", *argv]) == 0
    [(cfg, resume)] = fake_loop
    assert cfg.train.lr == 1e-5 and type(cfg.train.lr) is float
    assert resume is False


def test_overrides_reach_train(fake_loop):
    argv = [
        "train",
        "--resume",
        "--rollout.rollout_batch_size=2",
        "--rollout.n_samples_per_prompt",
        "8",
        "--train.global_batch_size=16",
        "--train.micro_batch_size=4",
        "--train.adam_betas=[0.9, 0.95]",
        "--data.env_args={level: 2, n: 10}",
        "--algo.eps_clip_high=null",
        "--log.tensorboard=false",
        "--sampling.temperature=1",
    ]
    assert main(argv) == 0
    [(cfg, resume)] = fake_loop
    assert resume is True
    assert cfg.rollout.rollout_batch_size == 2
    assert cfg.rollout.n_samples_per_prompt == 8
    assert cfg.train.global_batch_size == 16
    assert cfg.train.micro_batch_size == 4
    assert cfg.train.adam_betas == [0.9, 0.95]
    assert cfg.data.env_args == {"level": 2, "n": 10}
    assert cfg.algo.eps_clip_high is None
    assert cfg.log.tensorboard is False
    assert cfg.sampling.temperature == 1.0 and type(cfg.sampling.temperature) is float
    # everything else is the default
    assert cfg.train.num_steps == Config().train.num_steps
    assert cfg.data == dataclasses.replace(Config().data, env_args={"level": 2, "n": 10})


def test_defaults_reach_train(fake_loop):
    assert main(["train"]) == 0
    assert fake_loop == [(Config(), False)]


def test_config_file_then_command_line(fake_loop, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1.0e-5\n  num_steps: 3\n")
    assert main(["train", "--config", str(path), "--train.lr=2e-5"]) == 0
    [(cfg, _)] = fake_loop
    assert cfg.train.lr == 2e-5
    assert cfg.train.num_steps == 3


def test_config_file_errors_exit_2(fake_loop, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lrr: 1.0e-5\n")
    assert main(["train", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (f"tidal train: {path}:2: unknown option 'train.lrr'; did you mean 'train.lr'?\n")
    assert fake_loop == []


def test_convert_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["convert", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: tidal convert" in out
    assert "--out" in out and "--force" in out


def test_no_command_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "the following arguments are required: command" in capsys.readouterr().err


def test_a_run_that_stops_itself_exits_1_with_its_reason(fake_loop, monkeypatch, capsys):
    from tidal.types import RunStopped

    def stop(cfg, **kw):
        raise RunStopped("16 of 16 samples failed (100%), more than rollout.max_failed_ratio 0.5; ...")

    monkeypatch.setattr(sys.modules["tidal.loop"], "train", stop)
    assert main(["train"]) == 1
    assert capsys.readouterr().err == (
        "tidal train: 16 of 16 samples failed (100%), more than rollout.max_failed_ratio 0.5; ...\n"
    )


def test_a_key_on_the_command_line_is_taken_verbatim_and_the_user_warned(fake_loop, capsys):
    # read as YAML, 0123 would be the number 123 and `null` no key at all
    for key in ("0123", "null", "1e5"):
        assert main(["train", f"--engine.api_key={key}"]) == 0
        assert fake_loop[-1][0].engine.api_key == key
        err = capsys.readouterr().err
        assert "note: --engine.api_key on a command line is visible to other users of this machine (ps)" in err
        assert key not in err


def test_serve_takes_its_limit_on_weight_bodies(monkeypatch, tmp_path):
    """`tidal serve --max-weights-body-bytes` sets the largest `/update_weights_from_tensor` body
    (64 MiB unless given); fake modules keep the model and the web server out of this test (a
    folder with a config.json is a model folder to `tidal serve` until an engine loads it)."""
    served = []
    fakes = {
        "tidal.server.app": types.SimpleNamespace(serve=lambda model, host, port, config, **kw: served.append(config)),
        "tidal.log": types.SimpleNamespace(setup_logging=lambda: None),
    }
    for name, module in fakes.items():
        monkeypatch.setitem(sys.modules, name, module)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(["serve", str(tmp_path), "--max-weights-body-bytes", "200000000"]) == 0
    assert main(["serve", str(tmp_path)]) == 0
    assert [c.max_weights_body_bytes for c in served] == [200_000_000, 64 * 2**20]


# --- unknown options: nearest by spelling and by meaning ------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # other frameworks' names for tidal's options, in the group the user guessed or none
        (["--train.learning_rate", "1e-5"], "unknown option '--train.learning_rate'; did you mean '--train.lr'?"),
        (["--num_generations=8"], "unknown option '--num_generations'; did you mean '--rollout.n_samples_per_prompt'?"),
        (
            ["--train.max_completion_length=64"],
            "unknown option '--train.max_completion_length'; did you mean '--rollout.max_new_tokens'?",
        ),
        (["--beta=0.04"], "unknown option '--beta'; did you mean '--algo.kl_coef'?"),
        (["--model_name_or_path=x"], "unknown option '--model_name_or_path'; did you mean '--train.model'?"),
        # a real key's last part without its group
        (["--temperature=0.7"], "unknown option '--temperature'; did you mean '--sampling.temperature'?"),
        (
            ["--seed=1"],
            "unknown option '--seed'; did you mean one of '--data.seed', '--sampling.seed', '--train.seed', "
            "'--eval.seed'?",
        ),
        (
            ["--batch_size=8"],
            "unknown option '--batch_size'; did you mean one of '--rollout.rollout_batch_size', "
            "'--train.global_batch_size'?",
        ),
    ],
)
def test_an_unknown_option_is_one_line_naming_what_it_means(fake_loop, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"tidal train: error: {message}\n"  # one line: no usage dump
    assert fake_loop == []


def test_unknown_keys_in_a_yaml_file_name_the_file_line_and_nearest_option(fake_loop, tmp_path, capsys):
    path = tmp_path / "grpo.yaml"
    path.write_text("num_generations: 8\ntrain:\n  lr: 1.0e-6\n  learning_rate: 1.0e-5\n  lrr: 2\n")
    assert main(["train", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"tidal train: {path}:1: unknown option 'num_generations'; did you mean 'rollout.n_samples_per_prompt'?\n"
        f"{path}:4: unknown option 'train.learning_rate'; did you mean 'train.lr'?\n"
        f"{path}:5: unknown option 'train.lrr'; did you mean 'train.lr'?\n"
    )
    assert fake_loop == []


def test_every_alias_names_real_options():
    from tidal.aliases import ALIASES
    from tidal.config import KEYS

    assert ALIASES and all(targets and set(targets) <= set(KEYS) for targets in ALIASES.values())
    assert not set(ALIASES) & set(KEYS)  # a real key is never an alias


# --- each command's own options ------------------------------------------------------------------


def config_options(help_text: str) -> set[str]:
    return {word for word in help_text.split() if word.startswith("--") and "." in word}


def test_eval_help_shows_only_the_options_scoring_reads(capsys):
    from tidal.cli import COMMAND_OPTIONS
    from tidal.config import KEYS

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: tidal eval MODEL [--config FILE]")
    shown = config_options(out)
    declared = COMMAND_OPTIONS["eval"]
    assert shown == {f"--{k}" for k in KEYS if k in declared or k.partition(".")[0] in declared}
    assert {"--reward.fn", "--engine.kind", "--sampling.top_p", "--eval.datasets", "--cluster.device"} <= shown
    assert not {"--train.lr", "--algo.kl_coef", "--cluster.trainers", "--rollout.rollout_batch_size"} & shown
    assert "--greedy" in out and "--num-prompts N" in out
    assert "score the first N prompts of each set\n" in out  # its help says what unset means: no "(default: None)"


def test_train_help_has_a_short_usage_line(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "usage: tidal train [--config FILE] [--resume] [--allow-config-change] [--GROUP.KEY VALUE ...]"
    )


def test_eval_names_a_training_option_it_does_not_take(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "model", "--train.lr=1e-5", "--cluster.trainers=2"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "tidal eval: error: option '--train.lr' is not used by tidal eval (it reads no train options; see tidal "
        "eval --help)\n"
        "tidal eval: error: option '--cluster.trainers' is not used by tidal eval (of the cluster group it reads "
        "only --cluster.device; see tidal eval --help)\n"
    )


# --- tidal config --------------------------------------------------------------------------------


def test_tidal_config_prints_a_yaml_file_that_reads_back_to_the_same_config(tmp_path, capsys, monkeypatch):
    from tidal.config import build_config

    monkeypatch.delenv("TIDAL_API_KEY", raising=False)
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  lr: 1.0e-5\n  num_steps: 7\nsampling:\n  stop: ['1e5', 'null']\n")
    args = ["--rollout.n_samples_per_prompt=8", "--data.env_args={n: 40}", "--train.adam_betas=[0.9, 0.95]"]
    assert main(["config", "--config", str(base), *args]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("data:\n  path: env:arithmetic\n")
    out = tmp_path / "resolved.yaml"
    out.write_text(printed)
    expected = build_config(str(base), {"rollout.n_samples_per_prompt": 8, "data.env_args": {"n": 40}})
    expected.train.adam_betas = [0.9, 0.95]
    assert build_config(str(out), {}) == expected
    assert build_config(str(out), {}).sampling.stop == ["1e5", "null"]  # strings stay strings
    assert main(["config", "--config", str(out)]) == 0
    assert capsys.readouterr().out == printed  # a fixed point


def test_tidal_config_leaves_a_secret_out_and_its_file_gives_it_back(tmp_path, capsys, monkeypatch):
    from tidal.config import build_config

    monkeypatch.delenv("TIDAL_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    assert main(["config", f"--engine.api_key_file={key_file}"]) == 0
    printed = capsys.readouterr().out
    assert "sk-from-file" not in printed
    assert printed.endswith("# engine.api_key: set, not shown (a secret): give it by file or environment\n")
    out = tmp_path / "resolved.yaml"
    out.write_text(printed)
    assert build_config(str(out), {}).engine.api_key == "sk-from-file"
    assert main(["config", "--engine.api_key=sk-typed"]) == 0
    assert "sk-typed" not in capsys.readouterr().out


def test_tidal_config_checks_like_train(capsys):
    assert main(["config", "--train.num_steps=0"]) == 2
    assert capsys.readouterr().err == "tidal config: invalid config:\n  train.num_steps: must be >= 1, got 0\n"
    assert main(["config", "--reward.fn=reverse"]) == 2
    assert capsys.readouterr().err.startswith(
        "tidal config: invalid config:\n  reward.fn: 'reverse' is neither built in (math, exact_match, code_tests, "
        "judge, rm) nor a path to a function;"
    )
