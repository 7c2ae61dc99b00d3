"""The run's config: the option groups assembled, read from YAML and `--group.key=value`, and checked.

Each group is a dataclass beside the component it configures, with a `check` for what it can say
alone; each part of tidal receives the groups it needs, never the whole config:

    data      tidal.data.options.DataConfig          engine   tidal.adapters.options.EngineConfig
    rollout   tidal.rollout.options.RolloutConfig    reward   tidal.reward.options.RewardConfig
    sampling  tidal.rollout.options.SamplingConfig   judge    tidal.reward.options.JudgeConfig
    tools     tidal.rollout.options.ToolsConfig      sandbox  tidal.reward.options.CodeSandboxConfig
    agent     tidal.rollout.options.AgentConfig      algo     tidal.algo.options.AlgoConfig
    overlap   tidal.rollout.options.OverlapConfig    train    tidal.train.options.TrainConfig
    eval      tidal.eval_sets.EvalConfig          cluster  tidal.cluster.options.ClusterConfig
    log       tidal.log.LogConfig                    debug    DebugConfig (here: the loop's own)
    rm        tidal.reward.options.RewardModelConfig

`validate()` runs every group's check and then what spans groups (the engine kind against the
cluster, the algorithm against the rollout, ...), and reports every problem at once, each naming
the field and what to do. What an engine kind or transport can do is read from `tidal.backends`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tidal.adapters.options import API_KEY_ENV, EngineConfig
from tidal.algo.options import AlgoConfig
from tidal.aliases import ALIASES
from tidal.backends import ENGINES, IN_PROCESS, PLACEMENTS, RAY, EngineKind, Transport, engine_kind, resolve_sync
from tidal.cluster.options import ClusterConfig
from tidal.data.options import DataConfig
from tidal.eval_sets import EvalConfig
from tidal.log import LogConfig
from tidal.options import ConfigError, Need, coerce, did_you_mean, nearest_names, opt, type_name, unknown_name
from tidal.reward.options import CodeSandboxConfig, JudgeConfig, RewardConfig, RewardModelConfig
from tidal.rollout.options import AgentConfig, OverlapConfig, RolloutConfig, SamplingConfig, ToolsConfig
from tidal.train.options import TrainConfig


@dataclass
class DebugConfig:
    rollout_only: bool = opt(False, "roll out and keep the samples, but never train (the weights stay as loaded)")
    save_rollout: str | None = opt(None, "folder to save every step's rollout in (whole samples, for load_rollout)")
    load_rollout: str | None = opt(
        None, "train on the rollouts saved in this folder instead of generating (no engine is started)"
    )

    def check(self, need: Need) -> None:
        need(
            not (self.rollout_only and self.load_rollout),
            "debug.rollout_only: cannot replay saved rollouts (load_rollout)",
        )
        need(not (self.save_rollout and self.load_rollout), "debug.save_rollout: cannot be set with debug.load_rollout")
        need(
            not self.load_rollout or Path(self.load_rollout).is_dir(),
            f"debug.load_rollout: {self.load_rollout!r} is not a folder (write one with debug.save_rollout)",
        )

    @property
    def active(self) -> bool:
        return bool(self.rollout_only or self.save_rollout or self.load_rollout)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    rm: RewardModelConfig = field(default_factory=RewardModelConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    sandbox: CodeSandboxConfig = field(default_factory=CodeSandboxConfig)

    def to_dict(self) -> dict:
        """The config as plain data, with every secret field masked (`redact`): what config.json,
        the report and wandb get. The live values stay on the dataclasses."""
        return redact(dataclasses.asdict(self))

    @property
    def engine_kind(self) -> EngineKind:
        """The `tidal.backends` record of `engine.kind`."""
        return engine_kind(self.engine.kind)

    @property
    def uses_ray(self) -> bool:
        return self.cluster.uses_ray(self.engine_kind)

    @property
    def placement(self) -> str:
        """Where the engines run (`tidal.backends.PLACEMENTS`)."""
        return self.engine_kind.placement(self.uses_ray)

    @property
    def weight_sync(self) -> Transport:
        """The transport `cluster.weight_sync` stands for (auto resolved); `tidal.backends.SyncMismatch`
        naming the settings that would fit when it does not."""
        kind = self.engine_kind
        return resolve_sync(kind, self.placement, self.cluster.weight_sync, self.cluster.moves(kind))

    @property
    def kv_cache_tokens(self) -> int:
        """The engine's KV cache, in tokens: `engine.kv_cache_tokens`, else what one rollout step
        of this config needs (`EngineConfig.cache_tokens`)."""
        r = self.rollout
        return self.engine.cache_tokens(
            r.rollout_batch_size, r.n_samples_per_prompt, r.response_budget, self.data.max_prompt_length
        )

    @property
    def runs_model_code(self) -> bool:
        """Whether the run executes model-written code (the code_tests reward, the python tool)."""
        tools = self.rollout.generate == "tools" and "python" in self.tools.names
        return self.reward.fn == "code_tests" or tools


GROUPS: list[str] = [f.name for f in dataclasses.fields(Config)]
_GROUP_TYPES = typing.get_type_hints(Config)
# every option as `group.key`, in --help order
KEYS: list[str] = [f"{g}.{f.name}" for g in GROUPS for f in dataclasses.fields(_GROUP_TYPES[g])]

# Options that moved to a group of their own: a YAML file or command line naming the old key is
# refused with the new one named; a run folder's config.json written before is read as the new
# layout (`upgrade`).
RENAMED: dict[str, str] = {
    **{f"rollout.{k}": f"sampling.{k}" for k in ("temperature", "top_p", "top_k", "stop", "stop_token_ids", "seed")},
    "rollout.engine": "engine.kind",
    "rollout.engine_urls": "engine.urls",
    **{
        f"rollout.{k}": f"engine.{k}"
        for k in (
            "dtype",
            "router_url",
            "launch_router",
            "sglang_python",
            "sglang_args",
            "quantization",
            "pack_weights",
            "kv_cache_tokens",
            "max_num_seqs",
            "request_timeout",
            "api_key",
            "api_key_file",
        )
    },
    "rollout.reward": "reward.fn",
    "rollout.group_reward": "reward.group_fn",
    "rollout.reward_key": "reward.key",
    **{f"rollout.reward_{k}": f"reward.{k}" for k in ("timeout", "workers", "retries", "backoff")},
    **{
        f"rollout.judge_{k}": f"judge.{k}"
        for k in (
            "url",
            "model",
            "prompt_template",
            "max_tokens",
            "timeout",
            "retries",
            "concurrency",
            "score_regex",
            "api_key_env",
        )
    },
    "rollout.tools": "tools.names",
    "rollout.max_tool_output_tokens": "tools.max_output_tokens",
    "rollout.tool_timeout": "tools.timeout",
    "rollout.agent": "agent.fn",
    "rollout.agent_max_drift_tokens": "agent.max_drift_tokens",
    "rollout.agent_samples": "agent.samples",
}

# `group.key` of every field declared with `opt(..., secret=True)`: the one list of what is secret,
# so a new secret field is masked everywhere by declaring it so
SECRET_FIELDS: frozenset[str] = frozenset(
    f"{group}.{f.name}" for group in GROUPS for f in dataclasses.fields(_GROUP_TYPES[group]) if f.metadata.get("secret")
)
REDACTED = "<redacted>"


def upgrade(config: dict) -> dict:
    """A config dict (`{group: {key: value}}`) as this tidal lays it out: a key an older tidal
    wrote (a run folder's config.json) moved to its group's place (`RENAMED`); the rest as it is."""
    out = {group: dict(body) if isinstance(body, dict) else body for group, body in config.items()}
    for old, new in RENAMED.items():
        group, _, key = old.partition(".")
        body = out.get(group)
        if isinstance(body, dict) and key in body:
            value = body.pop(key)
            new_group, _, new_key = new.partition(".")
            target = out.setdefault(new_group, {})
            if isinstance(target, dict):
                target.setdefault(new_key, value)
    return out


def redact(config: dict) -> dict:
    """A copy of a config dict (`Config.to_dict()`'s shape, or a run's config.json, which an older
    tidal may have written with a key in it, under its old name too) where each set secret field
    reads REDACTED; an unset one (None or empty) stays as it is, so one can tell whether a key
    was given."""
    out = dict(config)
    old_names = {old for old, new in RENAMED.items() if new in SECRET_FIELDS}
    for name in SECRET_FIELDS | old_names:
        group, _, key = name.partition(".")
        body = out.get(group)
        if isinstance(body, dict) and body.get(key) not in (None, ""):
            out[group] = {**body, key: REDACTED}
    return out


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-6` (no dot) as a float, as YAML 1.2 does; PyYAML reads it as a str."""


_FLOAT_NO_DOT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_NO_DOT, list("-+0123456789"))


def unknown_key(dotted: str, prefix: str = "", known: list[str] | None = None) -> str:
    """`unknown option 'x'` with the options of `known` (default: every option) it most likely
    means, by spelling or by meaning (`tidal.aliases`): `train.lrr` and `train.learning_rate` both
    get `train.lr`. `prefix` is how the caller spells an option (`--` on the command line)."""
    known = KEYS if known is None else known
    group, _, key = dotted.partition(".")
    if key and group not in GROUPS:
        close = difflib.get_close_matches(group, GROUPS, n=1)
        if close and f"{close[0]}.{key}" in known:  # a misspelt group of a real key: the group is the typo
            return f"unknown config group {group!r}; did you mean {close[0]!r}?"
    names = nearest_names(dotted, known, ALIASES)
    if names:
        return f"unknown option {prefix + dotted!r}; {did_you_mean(names, prefix)}"
    in_group = [prefix + k for k in known if k.startswith(f"{group}.")]
    if in_group:
        return unknown_name("option", prefix + dotted, in_group)
    if key and group not in GROUPS:
        return unknown_name("config group", group, list(GROUPS))
    return f"unknown option {prefix + dotted!r}"


def apply_overrides(cfg: Config, values: dict[str, Any], source: str, lines: dict[str, int] | None = None) -> None:
    """Set `group.key` entries (a flat dict) on `cfg`, type-checked; errors name `source` (a file,
    with the key's line from `lines` where known, or "command line")."""
    errors = []
    lines = lines or {}
    for dotted, value in values.items():
        where = f"{source}:{lines[dotted]}" if dotted in lines else source
        if dotted in RENAMED:
            errors.append(f"{where}: {dotted} is now {RENAMED[dotted]}; write it so")
            continue
        group, _, key = dotted.partition(".")
        hints = typing.get_type_hints(_GROUP_TYPES[group]) if group in GROUPS else {}
        if key not in hints:
            errors.append(f"{where}: {unknown_key(dotted)}")
            continue
        try:
            setattr(getattr(cfg, group), key, coerce(dotted, value, hints[key]))
        except ConfigError as e:
            # for a secret the message names the type it got, never the value
            hidden = f"{dotted}: expected {type_name(hints[key])}, got a value of type {type(value).__name__}"
            errors.append(f"{where}: {hidden if dotted in SECRET_FIELDS else e}")
    if errors:
        raise ConfigError("\n".join(errors))


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config into a flat `{group.key: value}` dict."""
    return read_yaml(path)[0]


def read_yaml(path: str | Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Read a YAML config into a flat `{group.key: value}` dict and the line of each key. A
    top-level key that is not a group and holds a single value (`learning_rate: 1e-5`) is kept as
    it is, for `apply_overrides` to name the option it means."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        raw = yaml.load(text, Loader=_Loader) or {}
        node = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of config groups at the top level")
    flat, lines = {}, _key_lines(node)
    for group, body in raw.items():
        if not isinstance(body, dict):
            if group in GROUPS or "." in str(group):
                raise ConfigError(f"{path}: group {group!r} must be a mapping of options, got {body!r}")
            flat[str(group)] = body
            continue
        for key, value in body.items():
            flat[f"{group}.{key}"] = value
    return flat, lines


def _key_lines(node: yaml.Node | None) -> dict[str, int]:
    """`group.key` (and a lone top-level key) -> its line in the file, from the YAML node tree."""
    lines: dict[str, int] = {}
    if not isinstance(node, yaml.MappingNode):
        return lines
    for group_node, body in node.value:
        group = str(group_node.value)
        lines[group] = group_node.start_mark.line + 1
        if isinstance(body, yaml.MappingNode):
            for key_node, _ in body.value:
                lines[f"{group}.{key_node.value}"] = key_node.start_mark.line + 1
    return lines


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes a string `_Loader` would read as a float (`1e5`), so what it writes
    reads back as it was."""


_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_NO_DOT, list("-+0123456789"))


def config_yaml(cfg: Config) -> str:
    """The config as a YAML file `--config` reads back to the same config: every group and key,
    with a set secret left out (a comment names it: give it again by file or environment; its
    file option, when that is how it came, is in the YAML and gives it again)."""
    data = cfg.to_dict()
    hidden = []
    for name in sorted(SECRET_FIELDS):
        group, _, key = name.partition(".")
        if data[group].get(key) == REDACTED:
            del data[group][key]
            hidden.append(name)
    groups = [
        yaml.dump({group: body}, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)
        for group, body in data.items()
    ]
    notes = "".join(f"# {name}: set, not shown (a secret): give it by file or environment\n" for name in hidden)
    return "\n".join(groups) + notes


def parse_value(text: str) -> Any:
    """Command-line values are read as YAML scalars, so `1e-6`, `true`, `[1, 2]` and `null` work."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


def add_config_arguments(parser: argparse.ArgumentParser, options: tuple[str, ...] | list[str] = tuple(GROUPS)) -> None:
    """One `--group.key` option per config field of `options` (whole groups, or single
    `group.key` fields), with its default and help in `--help`."""
    defaults = Config()
    for group in GROUPS:
        fields = [
            f
            for f in dataclasses.fields(getattr(defaults, group))
            if group in options or f"{group}.{f.name}" in options
        ]
        if not fields:
            continue
        grp = parser.add_argument_group(f"{group} options")
        hints = typing.get_type_hints(_GROUP_TYPES[group])
        for f in fields:
            default = getattr(getattr(defaults, group), f.name)
            grp.add_argument(
                f"--{group}.{f.name}",
                dest=f"{group}.{f.name}",
                # a key is taken verbatim: read as YAML, `0123` or `1e5` would become a number and
                # `null` or `true` something else
                type=str if f.metadata.get("secret") else parse_value,
                default=argparse.SUPPRESS,
                metavar=type_name(hints[f.name]).upper(),
                help=f"{f.metadata.get('help', '')} (default: {default!r})",
            )


def build_config(
    config_files: str | Path | list[str | Path] | None,
    cli_values: dict[str, Any],
    for_training: bool = True,
    source: str = "command line",
) -> Config:
    """Defaults, then each YAML file in order (a later file's values over an earlier one's), then
    command-line overrides (`source` names them in errors: `tidal.api.make_config` passes its
    own); then validate, then read the secrets given by file or environment (`read_secrets`)."""
    cfg = Config()
    files = config_files if isinstance(config_files, list) else [config_files] if config_files else []
    for path in files:
        values, lines = read_yaml(path)
        apply_overrides(cfg, values, str(path), lines)
    apply_overrides(cfg, cli_values, source)
    validate(cfg, for_training)
    read_secrets(cfg)
    return cfg


def read_secrets(cfg: Config) -> None:
    """Set `engine.api_key`, when it is not given, from the first line of `engine.api_key_file`,
    else from $TIDAL_API_KEY. Errors name the file, never its content."""
    e = cfg.engine
    if e.api_key:
        return
    if e.api_key_file:
        path = Path(e.api_key_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise ConfigError(f"engine.api_key_file: cannot read {path} ({err.strerror})") from None
        except UnicodeDecodeError:  # its message would quote a byte of the key
            raise ConfigError(f"engine.api_key_file: {path} is not UTF-8 text") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ConfigError(f"engine.api_key_file: {path} is empty; its first line must be the API key")
        e.api_key = key
        return
    e.api_key = os.environ.get(API_KEY_ENV) or None


# ------------------------------------------------------------------------------------------------
# what spans groups

# config.json keys that give an MoE model's expert count (transformers' names across families)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _declares_experts(model: str) -> bool | None:
    """Whether the model folder's config.json (or its text_config) names more than one expert;
    None when there is no readable config.json (the trainer checks the loaded model)."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    parts = [cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}]
    return any(isinstance(p.get(k), int) and p.get(k) > 1 for p in parts for k in EXPERT_COUNT_KEYS)


def _check_algo(cfg: Config, for_training: bool, need: Need) -> None:
    a, r = cfg.algo, cfg.rollout
    # a user generate function, or the agent door keeping all its samples, may return several samples
    # per call: its groups (of any size, see tidal.algo.Groups) can compare samples with n = 1
    fans_out = r.generate not in ("single_turn", "tools", "agent") or (
        r.generate == "agent" and cfg.agent.samples == "all"
    )
    need(
        r.n_samples_per_prompt >= 2 or fans_out or not for_training or not a.grouped or a.mode == "sft",
        f"rollout.n_samples_per_prompt: {a.advantage} compares samples within a group, so it needs >= 2 "
        f"(got {r.n_samples_per_prompt})",
    )
    need(
        0 <= a.overlong_buffer <= r.max_new_tokens,
        f"algo.overlong_buffer: must be between 0 and rollout.max_new_tokens ({r.max_new_tokens}), "
        f"got {a.overlong_buffer}",
    )
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    t = cfg.train
    need(
        not (for_training and a.mode == "rl" and t.global_batch_size >= 1 and samples % t.global_batch_size),
        f"train.global_batch_size: rollout_batch_size × n_samples_per_prompt = {r.rollout_batch_size} × "
        f"{r.n_samples_per_prompt} = {samples} samples per step must be a multiple of "
        f"global_batch_size ({t.global_batch_size}); set train.global_batch_size to a divisor of {samples}",
    )
    if a.routing_replay and cfg.engine.kind in ENGINES:
        kinds = " or ".join(k for k, rec in ENGINES.items() if rec.routing)
        need(
            cfg.engine_kind.routing,
            f"algo.routing_replay: engine.kind {cfg.engine.kind} does not return the experts it chose; "
            f"engine.kind {kinds} does (SGLang with --enable-return-routed-experts)",
        )
        need(a.mode == "rl", "algo.routing_replay: replays the rollout engine's expert choices, which sft has not")
        need(
            t.model != "smollm2" and _declares_experts(t.model) is not False,
            f"algo.routing_replay: needs an MoE model (its config.json names num_experts, num_local_experts or "
            f"n_routed_experts); train.model {t.model!r} is dense",
        )


def _check_engine_and_cluster(cfg: Config, need: Need) -> None:
    """The engine kind against the cluster: how many, where, colocated or not, which transport."""
    c, kind = cfg.cluster, cfg.engine_kind
    placement = cfg.placement
    several = " or ".join(k for k, rec in ENGINES.items() if rec.several)
    need(
        kind.several or c.engines == 1,
        f"cluster.engines: engine.kind {kind.name} takes 1 (several: engine.kind {several}), got {c.engines} "
        "(for several running servers list them in engine.urls)",
    )
    need(
        c.ray is not False or c.engines == 1 or not kind.ray_actors,
        f"cluster.ray: false keeps one engine in this process, and cluster.engines {c.engines} of engine.kind "
        f"{kind.name} run as actors on Ray; set cluster.ray auto (or true), or cluster.engines 1",
    )
    need(
        not kind.whole_gpus or float(c.gpus_per_engine).is_integer(),
        f"cluster.gpus_per_engine: a launched engine.kind {kind.name} server takes whole GPUs, got {c.gpus_per_engine}",
    )
    sleepers = " or ".join(k for k, rec in ENGINES.items() if rec.sleeps and rec.ray_actors)
    need(
        not c.colocate or (placement == RAY and kind.sleeps),
        f"cluster.colocate: only engine actors on Ray free their memory for the trainers; engine.kind {kind.name} "
        f"here runs {PLACEMENTS[placement]}: "
        + (
            "set cluster.ray true to put it on Ray, or cluster.colocate false (one engine in this process already "
            "shares the trainer's weights)"
            if placement == IN_PROCESS and kind.sleeps and kind.ray_actors
            else f"set cluster.colocate false, or engine.kind {sleepers} on Ray"
        ),
    )
    try:
        cfg.weight_sync  # noqa: B018 - resolving it is the check
    except ValueError as e:
        need(False, str(e))
    t = cfg.train
    need(
        not t.batch_invariant or cfg.engine.batch_invariant,
        "train.batch_invariant: the trainer's log-probs equal the engine's only when both compute under "
        "batch-invariant numerics; set engine.batch_invariant too",
    )
    need(
        not t.batch_invariant or c.trainers == 1,
        "train.batch_invariant: one trainer rank (cluster.trainers 1); FSDP2 ranks score by a path these numerics "
        "are not built for",
    )
    # an engine in this process takes its weights in-process: the trainer's own LoRA layers can be shared
    need(
        t.lora_merge or (t.lora_rank > 0 and kind.lora_layers and placement == IN_PROCESS and not cfg.uses_ray),
        "train.lora_merge: false shares the trainer's LoRA model with an in-process engine: it needs train.lora_rank "
        "> 0, engine.kind "
        + " or ".join(k for k, rec in ENGINES.items() if rec.lora_layers)
        + ", one engine and no Ray (engines elsewhere get merged weights)",
    )


def _check_overlap(cfg: Config, need: Need) -> None:
    o, a = cfg.overlap, cfg.algo
    if o.mode == "off":
        return
    need(a.mode == "rl", "overlap.mode: overlaps rollout with training; algo.mode sft has no rollout")
    need(
        not cfg.cluster.colocate,
        "overlap.mode: colocated engines sleep while the trainers train, so nothing overlaps; "
        "set cluster.colocate false",
    )
    need(a.advantage != "ppo", "overlap.mode: the ppo critic is not overlapped yet; use a critic-free estimator")
    # the behaviour policy of a stale token is not the policy being trained: its log-probs must
    # enter the loss through a correction, or the run would silently train on-policy math
    stale = o.mode == "one_step" or o.max_staleness > 0 or o.sync_interval > 1
    need(
        not stale or a.is_correction != "none",
        "algo.is_correction: overlap.mode "
        f"{o.mode} trains on tokens sampled by older weights (staleness up to "
        f"{1 if o.mode == 'one_step' else max(o.max_staleness, o.sync_interval - 1)}); set algo.is_correction "
        "to truncate (TIS) or mask (ICEPOP) so the rollout log-probs correct the ratio",
    )
    need(
        not (o.mode == "full" and o.partial_rollout) or cfg.rollout.generate == "single_turn",
        "overlap.partial_rollout: continuing an aborted request needs rollout.generate single_turn; "
        "set overlap.partial_rollout false for multi-turn generate functions",
    )


def _check_modes(cfg: Config, need: Need) -> None:
    """What rl-only parts (rollout modes, evaluation, streamed prompts) need of algo.mode and the loop."""
    rl = cfg.algo.mode == "rl"
    if cfg.debug.active:
        need(rl, "debug: rollout modes need algo.mode rl")
        need(cfg.overlap.mode == "off", "debug: rollout modes run the synchronous loop; set overlap.mode off")
        need(
            not cfg.debug.load_rollout or not cfg.eval.interval,
            "debug.load_rollout: starts no engine, so eval.interval must be 0 (evaluation samples)",
        )
    need(
        not cfg.eval.interval or rl,
        "eval.interval: evaluation samples with the rollout engine, which sft does not have",
    )
    need(not cfg.data.streaming or rl, "data.streaming: streams prompts for rl; sft data is loaded whole")
    if cfg.rollout.generate == "agent":
        need(
            bool(cfg.agent.fn) or bool(cfg.agent.command),
            "agent.fn: rollout.generate agent needs the agent: its dotted path (agent.fn) or a program's command "
            "line (agent.command)",
        )
        need(
            not (cfg.agent.fn and cfg.agent.command),
            "agent.command: the agent is agent.fn or agent.command, not both; unset one",
        )


def _check_context_parallel(cfg: Config, need: Need) -> None:
    """What splitting a micro-batch's tokens over ranks (`tidal.train.context`) runs with."""
    if cfg.cluster.cp_size == 1:
        return
    need(cfg.train.packing, "cluster.cp_size: splits each packed row of samples; set train.packing true")


def validate(cfg: Config, for_training: bool = True) -> None:
    """Raise ConfigError listing every inconsistency, each with the field and the fix.
    `for_training=False` (evaluation) skips the checks that only the group advantage needs."""
    errs: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            errs.append(msg)

    for group in (cfg.data, cfg.rollout, cfg.sampling, cfg.engine, cfg.reward, cfg.tools, cfg.agent, cfg.algo):
        group.check(need)
    if cfg.reward.judged:
        cfg.judge.check(need)
    if cfg.reward.uses_rm:
        cfg.rm.check(need)
    for group in (cfg.train, cfg.cluster, cfg.overlap, cfg.log, cfg.debug, cfg.sandbox):
        group.check(need)
    cfg.eval.check(need, cfg.data, cfg.rollout, cfg.sampling)
    _check_algo(cfg, for_training, need)
    if cfg.engine.kind in ENGINES:  # else engine.check said so; what follows reads the kind's record
        _check_engine_and_cluster(cfg, need)
    _check_overlap(cfg, need)
    _check_modes(cfg, need)
    _check_context_parallel(cfg, need)
    if errs:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errs))
