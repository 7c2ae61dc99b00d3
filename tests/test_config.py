"""tidal.config: defaults, YAML loading, command-line overrides, validation messages."""

from __future__ import annotations

import dataclasses

import pytest

from tidal.adapters.options import API_KEY_ENV, EngineConfig
from tidal.algo.options import AlgoConfig
from tidal.cluster.options import ClusterConfig
from tidal.config import (
    GROUPS,
    REDACTED,
    RENAMED,
    SECRET_FIELDS,
    Config,
    DebugConfig,
    apply_overrides,
    build_config,
    load_yaml,
    parse_value,
    redact,
    upgrade,
    validate,
)
from tidal.data.options import DataConfig
from tidal.eval_sets import EvalConfig
from tidal.log import LogConfig
from tidal.options import ConfigError
from tidal.reward.options import CodeSandboxConfig, JudgeConfig, RewardConfig, RewardModelConfig
from tidal.rollout.options import AgentConfig, OverlapConfig, RolloutConfig, SamplingConfig, ToolsConfig
from tidal.train.options import TrainConfig


def write(tmp_path, text: str, name: str = "cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def errors_of(cfg: Config) -> list[str]:
    """The individual lines of validate()'s error, without the `invalid config:` header."""
    with pytest.raises(ConfigError) as exc:
        validate(cfg)
    head, *lines = str(exc.value).split("\n")
    assert head == "invalid config:"
    assert all(line.startswith("  ") for line in lines)
    return [line[2:] for line in lines]


# --- defaults ---------------------------------------------------------------------------------------


def test_default_values():
    cfg = Config()
    assert GROUPS == [
        "data",
        "rollout",
        "sampling",
        "engine",
        "reward",
        "judge",
        "rm",
        "tools",
        "agent",
        "algo",
        "train",
        "cluster",
        "overlap",
        "log",
        "eval",
        "debug",
        "sandbox",
    ]
    assert cfg.engine.kind == "tidal" and cfg.reward.fn == "math" and cfg.sampling.temperature == 1.0
    assert cfg.data.path == "env:arithmetic"
    assert cfg.data.env_args == {}
    assert cfg.data.system_prompt is None
    assert cfg.rollout.rollout_batch_size == 8
    assert cfg.rollout.n_samples_per_prompt == 4
    assert cfg.sampling.stop == []
    assert cfg.algo.advantage == "grpo"
    assert cfg.algo.eps_clip == 0.2
    assert cfg.algo.eps_clip_high is None
    assert cfg.algo.kl_kind == "k3"
    assert cfg.train.model == "smollm2"
    assert cfg.train.num_steps == 20
    assert cfg.train.global_batch_size == 32
    assert cfg.train.micro_batch_size == 8
    assert cfg.train.lr == 1e-6
    assert cfg.train.adam_betas == [0.9, 0.999]
    assert cfg.log.dir is None
    assert cfg.log.log_samples == 2
    assert cfg.log.save_samples is True and cfg.log.wandb is False and cfg.log.wandb_mode == "offline"
    assert cfg.debug == DebugConfig(rollout_only=False, save_rollout=None, load_rollout=None)
    assert cfg.sandbox.backend is None  # $TIDAL_SANDBOX_BACKEND, else auto


def test_mutable_defaults_are_not_shared():
    a, b = Config(), Config()
    a.train.adam_betas.append(0.5)
    a.data.env_args["level"] = 3
    a.sampling.stop.append("x")
    assert b.train.adam_betas == [0.9, 0.999]
    assert b.data.env_args == {}
    assert b.sampling.stop == []
    assert TrainConfig().adam_betas == [0.9, 0.999]


def test_defaults_validate():
    cfg = build_config(None, {})
    assert cfg == Config()
    validate(Config())  # does not raise


def test_to_dict_has_every_group_and_field():
    d = Config().to_dict()
    assert list(d) == GROUPS
    classes = [DataConfig, RolloutConfig, SamplingConfig, EngineConfig, RewardConfig, JudgeConfig, RewardModelConfig]
    classes += [ToolsConfig]
    classes += [AgentConfig, AlgoConfig, TrainConfig, ClusterConfig, OverlapConfig, LogConfig]
    classes += [EvalConfig, DebugConfig, CodeSandboxConfig]
    for group, cls in zip(GROUPS, classes, strict=True):
        assert list(d[group]) == [f.name for f in dataclasses.fields(cls)]
    assert d["train"]["lr"] == 1e-6


# --- secrets ----------------------------------------------------------------------------------------

KEY = "sk-tidal-test-0123456789"


def test_secret_fields_are_declared_in_one_place_and_masked_wherever_config_is_shown():
    assert SECRET_FIELDS == {"engine.api_key"}  # a new secret field: declare it with _opt(..., secret=True)
    cfg = build_config(None, {"engine.api_key": KEY})
    assert cfg.engine.api_key == KEY  # the live value, for the engine client
    assert cfg.to_dict()["engine"]["api_key"] == REDACTED  # config.json, the report, wandb
    assert KEY not in repr(cfg) and KEY not in str(cfg.engine)  # logs, tracebacks
    assert KEY not in str(cfg.to_dict())
    assert Config().to_dict()["engine"]["api_key"] is None  # unset stays visibly unset
    # a config.json an older tidal wrote with the key in it (under its old name too) is masked when read back
    assert redact({"rollout": {"api_key": KEY, "seed": 1}, "train": {}}) == {
        "rollout": {"api_key": REDACTED, "seed": 1},
        "train": {},
    }
    assert redact({"engine": {"api_key": KEY}}) == {"engine": {"api_key": REDACTED}}


def test_the_api_key_comes_from_the_option_else_a_file_else_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    key_file = write(tmp_path, KEY + "\n", "key.txt")
    assert build_config(None, {}).engine.api_key == "from-env"
    from_file = build_config(None, {"engine.api_key_file": str(key_file)})
    assert from_file.engine.api_key == KEY
    assert from_file.to_dict()["engine"]["api_key_file"] == str(key_file)  # the path, never the key
    assert from_file.to_dict()["engine"]["api_key"] == REDACTED
    given = {"engine.api_key": "explicit", "engine.api_key_file": str(key_file)}
    assert build_config(None, given).engine.api_key == "explicit"
    monkeypatch.delenv(API_KEY_ENV)
    assert build_config(None, {}).engine.api_key is None


def test_a_bad_key_file_is_named_and_its_content_never_shown(tmp_path):
    empty = write(tmp_path, "\n", "empty.txt")
    with pytest.raises(ConfigError, match=rf"^engine.api_key_file: {empty} is empty; its first line must be"):
        build_config(None, {"engine.api_key_file": str(empty)})
    with pytest.raises(ConfigError, match=r"^engine.api_key_file: cannot read .*nope.txt \(No such file"):
        build_config(None, {"engine.api_key_file": str(tmp_path / "nope.txt")})
    binary = tmp_path / "key.bin"
    binary.write_bytes(b"\xffsecret\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text$"):
        build_config(None, {"engine.api_key_file": str(binary)})


def test_a_secret_of_the_wrong_type_is_refused_without_quoting_it(tmp_path):
    path = write(tmp_path, "engine:\n  api_key: 8675309\n")
    with pytest.raises(ConfigError) as err:
        build_config(str(path), {})
    assert str(err.value) == f"{path}:2: engine.api_key: expected str or null, got a value of type int"
    assert "8675309" not in str(err.value)


# --- YAML loading -----------------------------------------------------------------------------------


def test_yaml_values_applied_with_types(tmp_path):
    path = write(
        tmp_path,
        """
data:
  env_args: {level: 1, n: 50}
  system_prompt: be brief
rollout:
  rollout_batch_size: 4
sampling:
  temperature: 1          # int → float
  stop: ["</answer>"]
algo:
  eps_clip_high: null     # stays None
  kl_coef: 0
train:
  lr: 1                   # int → float
  global_batch_size: 16
  num_steps: 3
  adam_betas: [0.9, 0.95]
log:
  tensorboard: false
""",
    )
    assert load_yaml(path)["train.lr"] == 1
    cfg = build_config(str(path), {})
    assert cfg.data.env_args == {"level": 1, "n": 50}
    assert cfg.data.system_prompt == "be brief"
    assert cfg.rollout.rollout_batch_size == 4
    assert cfg.sampling.temperature == 1.0 and type(cfg.sampling.temperature) is float
    assert cfg.sampling.stop == ["</answer>"]
    assert cfg.algo.eps_clip_high is None
    assert cfg.algo.kl_coef == 0.0 and type(cfg.algo.kl_coef) is float
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float
    assert cfg.train.global_batch_size == 16
    assert cfg.train.num_steps == 3
    assert cfg.train.adam_betas == [0.9, 0.95]
    assert cfg.log.tensorboard is False
    # untouched fields keep their defaults
    assert cfg.train.micro_batch_size == 8
    assert cfg.data.path == "env:arithmetic"


def test_yaml_float_without_dot(tmp_path):
    # PyYAML alone reads `1e-6` as the string '1e-6'; tidal reads it as a float, as YAML 1.2 does.
    path = write(tmp_path, "train:\n  lr: 1e-6\nalgo:\n  eps_clip_high: 2.8e-1\n")
    cfg = build_config(str(path), {})
    assert cfg.train.lr == 1e-6 and type(cfg.train.lr) is float
    assert cfg.algo.eps_clip_high == 0.28


def test_yaml_flattened(tmp_path):
    path = write(tmp_path, "train:\n  lr: 2.0e-5\n  num_steps: 5\nlog:\n  dir: null\n")
    assert load_yaml(path) == {"train.lr": 2e-5, "train.num_steps": 5, "log.dir": None}


def test_empty_yaml_is_defaults(tmp_path):
    path = write(tmp_path, "")
    assert load_yaml(path) == {}
    assert build_config(str(path), {}) == Config()


def test_yaml_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as exc:
        build_config(str(path), {})
    assert str(exc.value) == f"config file {path} does not exist"


def test_invalid_yaml_names_file(tmp_path):
    path = write(tmp_path, "train:\n  lr: [1, 2\n", name="broken.yaml")
    with pytest.raises(ConfigError) as exc:
        load_yaml(path)
    assert str(exc.value).startswith(f"{path}: invalid YAML: ")
    assert isinstance(exc.value.__cause__, Exception)


def test_yaml_top_level_not_mapping(tmp_path):
    path = write(tmp_path, "- train\n- lr\n")
    with pytest.raises(ConfigError) as exc:
        load_yaml(path)
    assert str(exc.value) == f"{path}: expected a mapping of config groups at the top level"


def test_yaml_group_not_mapping(tmp_path):
    path = write(tmp_path, "train: 5\n")
    with pytest.raises(ConfigError) as exc:
        load_yaml(path)
    assert str(exc.value) == f"{path}: group 'train' must be a mapping of options, got 5"


def test_yaml_unknown_group_suggests(tmp_path):
    path = write(tmp_path, "trian:\n  lr: 1.0e-5\n")
    with pytest.raises(ConfigError) as exc:
        build_config(str(path), {})
    assert str(exc.value) == f"{path}:2: unknown config group 'trian'; did you mean 'train'?"


def test_yaml_unknown_group_without_close_match_lists_groups(tmp_path):
    path = write(tmp_path, "zzzzzz:\n  a: 1\n")
    with pytest.raises(ConfigError) as exc:
        build_config(str(path), {})
    known = "data, rollout, sampling, engine, reward, judge, rm, tools, agent, algo, train, cluster, overlap, log, "
    known += "eval, debug, sandbox"
    assert str(exc.value) == f"{path}:2: unknown config group 'zzzzzz'; known: {known}"


def test_yaml_unknown_key_suggests(tmp_path):
    path = write(tmp_path, "train:\n  lrr: 1.0e-5\n")
    with pytest.raises(ConfigError) as exc:
        build_config(str(path), {})
    assert str(exc.value) == f"{path}:2: unknown option 'train.lrr'; did you mean 'train.lr'?"


def test_yaml_wrong_type(tmp_path):
    path = write(tmp_path, 'train:\n  num_steps: "ten"\n')
    with pytest.raises(ConfigError) as exc:
        build_config(str(path), {})
    assert str(exc.value) == f"{path}:2: train.num_steps: expected int, got 'ten'"


def test_yaml_collects_all_override_errors(tmp_path):
    path = write(tmp_path, 'train:\n  num_steps: "ten"\n  lrr: 1\n  seed: true\nalgo:\n  eps_clip_high: x\n')
    with pytest.raises(ConfigError) as exc:
        build_config(str(path), {})
    assert str(exc.value).split("\n") == [
        f"{path}:2: train.num_steps: expected int, got 'ten'",
        f"{path}:3: unknown option 'train.lrr'; did you mean 'train.lr'?",
        f"{path}:4: train.seed: expected int, got True",
        f"{path}:6: algo.eps_clip_high: expected float or null, got 'x'",
    ]


# --- overrides ---------------------------------------------------------------------------------------


def test_command_line_overrides_yaml(tmp_path):
    path = write(tmp_path, "train:\n  lr: 1.0e-5\n  num_steps: 7\n")
    cfg = build_config(str(path), {"train.lr": 3e-4})
    assert cfg.train.lr == 3e-4
    assert cfg.train.num_steps == 7


def test_command_line_errors_name_source():
    with pytest.raises(ConfigError) as exc:
        build_config(None, {"train.num_steps": "ten"})
    assert str(exc.value) == "command line: train.num_steps: expected int, got 'ten'"


def test_apply_overrides_coerces_and_checks():
    cfg = Config()
    apply_overrides(cfg, {"train.weight_decay": 0, "data.system_prompt": "hi", "log.dir": None}, "x")
    assert cfg.train.weight_decay == 0.0 and type(cfg.train.weight_decay) is float
    assert cfg.data.system_prompt == "hi"
    assert cfg.log.dir is None
    with pytest.raises(ConfigError, match=r"^x: train.lr: expected float, got True$"):
        apply_overrides(cfg, {"train.lr": True}, "x")
    with pytest.raises(ConfigError, match=r"^x: train.adam_betas: expected list, got 0.9$"):
        apply_overrides(cfg, {"train.adam_betas": 0.9}, "x")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1e-6", 1e-6),
        ("1e5", 1e5),
        ("-2.5e-3", -2.5e-3),
        ("1.0e-5", 1e-5),
        ("3", 3),
        ("0.5", 0.5),
        ("true", True),
        ("false", False),
        ("[1, 2]", [1, 2]),
        ("{level: 1}", {"level": 1}),
        ("null", None),
        ("abc", "abc"),
        ("env:arithmetic", "env:arithmetic"),
    ],
)
def test_parse_value(text, expected):
    value = parse_value(text)
    assert value == expected
    assert type(value) is type(expected)


def test_parse_value_unparseable_is_text():
    assert parse_value("[1, 2") == "[1, 2"


# --- validate ---------------------------------------------------------------------------------------


def test_validate_collects_several_errors():
    cfg = Config()
    cfg.train.num_steps = 0
    cfg.train.lr = 0.0
    cfg.sampling.top_p = 1.5
    assert errors_of(cfg) == [
        "sampling.top_p: must be in (0, 1], got 1.5",
        "train.num_steps: must be >= 1, got 0",
        "train.lr: must be > 0, got 0.0",
    ]


def test_validate_batch_divisibility():
    cfg = Config()
    cfg.rollout.rollout_batch_size = 3
    cfg.rollout.n_samples_per_prompt = 4
    cfg.train.global_batch_size = 8
    assert errors_of(cfg) == [
        "train.global_batch_size: rollout_batch_size × n_samples_per_prompt = 3 × 4 = 12 samples per step "
        "must be a multiple of global_batch_size (8); set train.global_batch_size to a divisor of 12"
    ]
    cfg.train.global_batch_size = 12
    validate(cfg)
    cfg.train.global_batch_size = 6
    cfg.train.micro_batch_size = 3
    validate(cfg)


def test_validate_group_size_for_grpo():
    cfg = Config()
    cfg.rollout.n_samples_per_prompt = 1
    cfg.rollout.rollout_batch_size = 32
    assert errors_of(cfg) == [
        "rollout.n_samples_per_prompt: grpo compares samples within a group, so it needs >= 2 (got 1)"
    ]
    cfg.algo.advantage = "dr_grpo"
    assert errors_of(cfg) == [
        "rollout.n_samples_per_prompt: dr_grpo compares samples within a group, so it needs >= 2 (got 1)"
    ]
    # a generate function that may fan a prompt out makes its own groups (ragged groups)
    cfg.rollout.generate = "my_module:fan_out"
    validate(cfg)
    cfg.rollout.generate = "agent"
    cfg.agent.fn = "my_agents:agent"
    cfg.agent.samples = "all"
    validate(cfg)


def test_validate_micro_batch_larger_than_global():
    cfg = Config()
    cfg.train.micro_batch_size = 64
    assert errors_of(cfg) == ["train.micro_batch_size: must be between 1 and train.global_batch_size (32), got 64"]


@pytest.mark.parametrize(
    "group, key, value, message",
    [
        ("train", "dtype", "float16", "train.dtype: one of auto, bfloat16, autocast, float32, got 'float16'"),
        ("engine", "dtype", "fp8", "engine.dtype: one of auto, bfloat16, float32, got 'fp8'"),
        ("algo", "kl_kind", "k4", "algo.kl_kind: k1, k2 or k3, got 'k4'"),
        (
            "algo",
            "advantage",
            "a2c",
            "algo.advantage: one of grpo, dr_grpo, gspo, cispo, rloo, reinforce_plus_plus, "
            "reinforce_plus_plus_baseline, ppo or a dotted path, got 'a2c'",
        ),
        ("algo", "policy_loss", "clip", "algo.policy_loss: one of auto, ppo, gspo, cispo or a dotted path, got 'clip'"),
        ("algo", "dual_clip", 1.0, "algo.dual_clip: must be > 1 or null, got 1.0"),
        ("algo", "kl_in_reward", True, "algo.kl_in_reward: needs algo.kl_coef > 0 to have any effect"),
        ("algo", "is_correction", "tis", "algo.is_correction: none, truncate or mask, got 'tis'"),
        ("algo", "is_low", 3.0, "algo.is_low: must be in [0, is_high) or null, got 3.0"),
        (
            "algo",
            "overlong_buffer",
            100,
            "algo.overlong_buffer: must be between 0 and rollout.max_new_tokens (64), got 100",
        ),
        ("algo", "teacher", "/nonexistent", "algo.teacher: '/nonexistent' is not a model folder"),
        ("train", "max_tokens_per_micro_batch", -1, "train.max_tokens_per_micro_batch: must be >= 0 (0 = off)"),
        ("sampling", "top_p", 0.0, "sampling.top_p: must be in (0, 1], got 0.0"),
        ("sampling", "top_p", 1.01, "sampling.top_p: must be in (0, 1], got 1.01"),
        ("sampling", "temperature", -0.1, "sampling.temperature: must be >= 0, got -0.1"),
        ("sampling", "top_k", -1, "sampling.top_k: must be >= 0, got -1"),
        ("sampling", "stop", [""], "sampling.stop: must be a list of non-empty strings"),
        ("sampling", "stop_token_ids", [1, "2"], "sampling.stop_token_ids: must be a list of integers"),
        ("algo", "eps_clip_high", 0.0, "algo.eps_clip_high: must be > 0 or null"),
        ("algo", "kl_coef", -1.0, "algo.kl_coef: must be >= 0, got -1.0"),
        ("train", "adam_betas", [0.9], "train.adam_betas: two numbers in [0, 1), got [0.9]"),
        ("train", "adam_betas", [0.9, 1.0], "train.adam_betas: two numbers in [0, 1), got [0.9, 1.0]"),
        ("train", "max_grad_norm", -1.0, "train.max_grad_norm: must be >= 0 (0 turns clipping off)"),
        ("data", "max_prompt_length", 0, "data.max_prompt_length: must be >= 1"),
    ],
)
def test_validate_single_field(group, key, value, message):
    cfg = Config()
    setattr(getattr(cfg, group), key, value)
    assert errors_of(cfg) == [message]


def test_validate_accepted_values():
    cfg = Config()
    cfg.train.dtype = cfg.engine.dtype = "float32"
    cfg.algo.kl_kind = "k1"
    cfg.sampling.top_p = 1.0
    cfg.sampling.temperature = 0.0
    cfg.algo.eps_clip_high = 0.28
    validate(cfg)


def test_validate_data_path(tmp_path):
    cfg = Config()
    missing = str(tmp_path / "missing.jsonl")
    cfg.data.path = missing
    assert errors_of(cfg) == [f"data.path: file {missing!r} does not exist (or use env:arithmetic)"]
    existing = tmp_path / "prompts.jsonl"
    existing.write_text('{"prompt": "1+1", "label": "2"}\n')
    cfg.data.path = str(existing)
    validate(cfg)
    cfg.data.path = "env:anything"  # env: paths are not checked against the file system
    validate(cfg)


# --- options that moved to groups of their own -------------------------------------------------------


def test_every_moved_option_names_a_real_one():
    fields = {f"{g}.{f.name}" for g in GROUPS for f in dataclasses.fields(getattr(Config(), g))}
    assert set(RENAMED.values()) <= fields
    assert not set(RENAMED) & fields  # an old name is never a live one


def test_an_option_that_moved_is_refused_naming_its_new_key(tmp_path):
    path = write(tmp_path, "rollout:\n  temperature: 0.7\n  reward: exact_match\n  rollout_batch_size: 4\n")
    with pytest.raises(ConfigError) as exc:
        build_config(str(path), {})
    assert str(exc.value).split("\n") == [
        f"{path}:2: rollout.temperature is now sampling.temperature; write it so",
        f"{path}:3: rollout.reward is now reward.fn; write it so",
    ]
    with pytest.raises(ConfigError, match=r"^command line: rollout.engine_urls is now engine.urls; write it so$"):
        build_config(None, {"rollout.engine_urls": ["http://127.0.0.1:1"]})


def test_a_config_json_of_an_older_tidal_reads_as_the_new_layout():
    old = {
        "rollout": {"temperature": 0.7, "reward": "math", "judge_url": "", "rollout_batch_size": 8},
        "train": {"lr": 1e-5},
        "resolved": {"machine": {}},
    }
    assert upgrade(old) == {
        "rollout": {"rollout_batch_size": 8},
        "sampling": {"temperature": 0.7},
        "reward": {"fn": "math"},
        "judge": {"url": ""},
        "train": {"lr": 1e-5},
        "resolved": {"machine": {}},
    }
    assert old["rollout"]["temperature"] == 0.7  # the caller's dict is left as it was


def test_context_parallel_needs_packing_and_a_divisible_layout():
    cfg = Config()
    cfg.cluster = ClusterConfig(trainers=4, cp_size=2, tp_size=2)
    cfg.train = dataclasses.replace(cfg.train, packing=False)
    assert errors_of(cfg) == ["cluster.cp_size: splits each packed row of samples; set train.packing true"]
    cfg.cluster = ClusterConfig(trainers=6, cp_size=2, tp_size=2)
    assert "cluster.cp_size: cp_size x tp_size (2 x 2) must divide cluster.trainers (6)" in errors_of(cfg)
