"""The backend table (`tidal.backends`): the one place engine kinds and weight-sync transports are
named. A made-up engine kind, one record and one adapter module (tests/adapters/echo_engine.py),
is taken by config validation, the factory and the cluster wiring with no other edit; `auto`
resolves to the transport each placement needs; nothing outside the table compares their names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import loop_config

import tidal
import tidal.loop
from tidal import backends
from tidal.adapters.factory import make_engine
from tidal.backends import ENGINES, IN_PROCESS, RAY, SERVERS, TRANSPORTS, EngineKind, SyncMismatch, resolve_sync
from tidal.cluster.options import ClusterConfig
from tidal.config import Config, apply_overrides, build_config
from tidal.convert import load_tokenizer
from tidal.data.dataset import PromptRecord
from tidal.options import ConfigError
from tidal.roles import InProcessEngines, build_roles
from tidal.rollout.manager import RolloutManager
from tidal.sync.local import InProcessSync

ECHO = EngineKind(
    "echo",
    "repeats the prompt's last token (a test's engine)",
    core="echo_engine:EchoCore",
    core_options=("dtype",),
    weight_syncs=("in-process",),
)


@pytest.fixture
def echo(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "adapters"))
    monkeypatch.setitem(backends.ENGINES, "echo", ECHO)
    return ECHO


def test_a_made_up_engine_kind_needs_one_record_and_one_adapter(echo, tiny_model_dir, tmp_path):
    from echo_engine import EchoCore

    cfg = loop_config(tiny_model_dir, tmp_path / "run", **{"engine.kind": "echo", "train.num_steps": 2})
    assert (cfg.placement, cfg.weight_sync.name) == (IN_PROCESS, "in-process")  # config validation takes it
    with pytest.raises(
        ConfigError, match=r"cluster.weight_sync: engine.kind echo takes in-process \(or auto\), got http"
    ):
        build_config(None, {"engine.kind": "echo", "cluster.weight_sync": "http"})
    with pytest.raises(ConfigError, match=r"cluster.engines: engine.kind echo takes 1"):
        build_config(None, {"engine.kind": "echo", "cluster.engines": 2})

    tok = load_tokenizer(tiny_model_dir)
    engine = make_engine(cfg.engine, tiny_model_dir, tok, cfg.kv_cache_tokens)  # the factory builds it
    try:
        assert isinstance(engine.core, EchoCore)
    finally:
        engine.close()

    roles = build_roles(cfg, tiny_model_dir, tok, None)  # the cluster wiring: engines and weight sync
    try:
        assert isinstance(roles.engines, InProcessEngines) and isinstance(roles.sync, InProcessSync)
        roles.sync.push(3)  # the trainer's weights, checked by the engine's checksum
        assert roles.engines.engine.weight_version == 3
        manager = RolloutManager.from_config(roles.engines.engine, cfg, tok, roles.engines.loop)
        record = PromptRecord(index=0, prompt="p", text="p", input_ids=[5, 6, 7], label="x")
        samples = manager.generate([record], step=0)
        assert [s.tokens for s in samples] == [[5, 6, 7] + [7] * cfg.rollout.max_new_tokens] * 4
        assert all(s.weight_version == 3 for s in samples)
    finally:
        roles.close()

    history = tidal.loop.train(cfg)  # and the loop runs on it, step for step
    assert [h["step"] for h in history] == [1, 2]


def test_auto_picks_the_transport_that_reaches_the_engines():
    tidal_kind, vllm, remote, sglang = (ENGINES[k] for k in ("tidal", "vllm", "remote", "sglang"))
    assert resolve_sync(tidal_kind, IN_PROCESS, "auto").name == "in-process"
    assert resolve_sync(tidal_kind, RAY, "auto").name == "broadcast"
    assert resolve_sync(vllm, RAY, "auto").name == "broadcast"
    assert resolve_sync(remote, SERVERS, "auto").name == "http"
    assert resolve_sync(sglang, SERVERS, "auto").name == "distributed"
    assert resolve_sync(tidal_kind, RAY, "delta").changed_only
    with pytest.raises(ValueError, match="delta sends only the tensors that changed, and engine.kind vllm takes whole"):
        resolve_sync(vllm, RAY, "delta")
    with pytest.raises(SyncMismatch) as refused:
        resolve_sync(tidal_kind, IN_PROCESS, "broadcast", {RAY: {"cluster.ray": True}})
    assert str(refused.value) == (
        "cluster.weight_sync: broadcast reaches engine actors on Ray; this run's engines are one engine in this "
        "process, beside one trainer (no Ray): set cluster.ray true, or cluster.weight_sync in-process or auto"
    )
    assert refused.value.fixes == [
        {"cluster.ray": True},
        {"cluster.weight_sync": "in-process"},
        {"cluster.weight_sync": "auto"},
    ]
    assert set(TRANSPORTS) == {"in-process", "broadcast", "http", "delta", "disk", "distributed"}


def test_placement_follows_the_record_and_the_cluster():
    cfg = Config()
    assert cfg.placement == IN_PROCESS
    cfg.cluster = ClusterConfig(engines=2)
    assert cfg.placement == RAY and cfg.weight_sync.name == "broadcast"
    cfg.engine.kind = "hf"  # no Ray actors: stays in this process, and takes one engine
    assert cfg.placement == IN_PROCESS
    cfg.engine.kind = "remote"
    assert cfg.placement == SERVERS and cfg.weight_sync.name == "http"


def test_cluster_ray_true_puts_one_trainer_and_one_engine_on_ray():
    """The 1 + 1 rehearsal of a cluster layout: the Ray path with the smallest cluster."""
    cfg = build_config(None, {"cluster.ray": True})
    assert (cfg.uses_ray, cfg.placement, cfg.weight_sync.name) == (True, RAY, "broadcast")
    cfg = build_config(None, {"cluster.ray": True, "cluster.weight_sync": "http", "cluster.colocate": True})
    assert (cfg.placement, cfg.weight_sync.name) == (RAY, "http")
    cfg = build_config(None, {"cluster.ray": True, "engine.kind": "hf"})  # the trainer on Ray, its engine here
    assert (cfg.uses_ray, cfg.placement, cfg.weight_sync.name) == (True, IN_PROCESS, "in-process")
    cfg = build_config(None, {"cluster.ray": True, "engine.kind": "remote", "engine.urls": ["http://127.0.0.1:1"]})
    assert (cfg.uses_ray, cfg.placement) == (True, SERVERS)
    # auto keeps the laptop default out of Ray; false keeps anything out of it
    assert build_config(None, {}).uses_ray is False
    assert build_config(None, {"cluster.ray": False}).placement == IN_PROCESS
    assert build_config(None, {"cluster.trainers": 2}).uses_ray is True


@pytest.mark.parametrize(
    ("values", "line"),
    [
        ({"cluster.ray": True}, "1 trainer rank and 1 engine actor on Ray (bundles: 1 × 1 CPU + 1 × 1 CPU)"),
        (
            {"cluster.trainers": 2, "cluster.engines": 2, "cluster.colocate": True, "cluster.gpus_per_engine": 1},
            "2 trainer ranks and 2 engine actors on Ray (bundles: 2 × 1 CPU 1 GPU, engines sharing the ranks' bundles)",
        ),
        (
            {"cluster.ray": True, "engine.kind": "hf"},
            "1 trainer rank on Ray (bundles: 1 × 1 CPU); engines: one engine in this process, beside one trainer "
            "(no Ray)",
        ),
        (  # servers take no bundle
            {"cluster.trainers": 2, "engine.kind": "remote", "engine.urls": ["http://h:1"]},
            "2 trainer ranks on Ray (bundles: 2 × 1 CPU); engines: HTTP servers (attached at engine.urls, or launched)",
        ),
    ],
)
def test_the_start_up_line_says_what_runs_on_ray(values, line):
    from tidal.roles import ray_layout

    assert ray_layout(build_config(None, values)) == line


# Every layout a run's engines can have, from the table: each kind in this process or on Ray (the
# kinds that run Ray actors), or as servers. A new kind or transport is covered with no edit here.
def _layouts() -> dict[str, dict]:
    out = {}
    for name, kind in ENGINES.items():
        if kind.servers:
            out[f"{name} servers"] = {"engine.kind": name, "engine.urls": ["http://127.0.0.1:1"]}
            continue
        out[f"{name} 1+1 in this process"] = {"engine.kind": name}
        if kind.ray_actors:
            out[f"{name} 1+1 on Ray"] = {"engine.kind": name, "cluster.ray": True}
            out[f"{name} 2+2 on Ray"] = {"engine.kind": name, "cluster.trainers": 2, "cluster.engines": 2}
    return out


LAYOUTS = _layouts()


@pytest.mark.parametrize("transport", [*TRANSPORTS, "auto"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_transport_that_does_not_fit_is_refused_at_validation_naming_fixes_that_work(transport, layout):
    """Each mismatch of a transport with a kind or its placement stops at config validation (before
    anything loads) with a message naming settings that fit; each of them, applied, validates, and
    one that moves the engines keeps the transport asked for."""
    values = {**LAYOUTS[layout], "cluster.weight_sync": transport}
    cfg = Config()
    apply_overrides(cfg, values, "test")
    kind, record = cfg.engine_kind, TRANSPORTS.get(transport)
    fits = record is None or (
        transport in kind.weight_syncs
        and cfg.placement in record.placements
        and (kind.partial_updates or not record.changed_only)
    )
    if fits:
        assert build_config(None, values).weight_sync.name in kind.weight_syncs
        return
    with pytest.raises(SyncMismatch) as refused:
        cfg.weight_sync  # noqa: B018
    mismatch = refused.value
    with pytest.raises(ConfigError) as invalid:
        build_config(None, values)
    assert f"\n  {mismatch}" in str(invalid.value)  # the whole message, one line of the report
    assert mismatch.fixes, "a mismatch names at least one fix"
    fixes = str(mismatch).split(": set ", 1)[1]
    for fix in mismatch.fixes:
        for key, value in fix.items():
            shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            if key == "cluster.weight_sync":  # the transports that would do are named together, last
                assert re.search(rf"cluster\.weight_sync [a-z, -]*\b{shown}\b[a-z, -]*$", fixes), shown
            else:
                assert f"{key} {shown}" in fixes
        fixed = build_config(None, {**values, **fix})
        if "cluster.weight_sync" not in fix:
            assert fixed.weight_sync.name == transport


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"cluster.weight_sync": "broadcast"},
            "cluster.weight_sync: broadcast reaches engine actors on Ray; this run's engines are one engine in this "
            "process, beside one trainer (no Ray): set cluster.ray true, or cluster.weight_sync in-process or auto",
        ),
        (
            {"cluster.weight_sync": "http"},
            "cluster.weight_sync: http reaches engine actors on Ray or HTTP servers (attached at engine.urls, or "
            "launched); this run's engines are one engine in this process, beside one trainer (no Ray): set "
            "cluster.ray true, or cluster.weight_sync in-process or auto",
        ),
        (
            {"cluster.weight_sync": "in-process", "cluster.trainers": 2, "cluster.engines": 2},
            "cluster.weight_sync: in-process reaches one engine in this process, beside one trainer (no Ray); this "
            "run's engines are engine actors on Ray: set cluster.trainers 1 and cluster.engines 1, or "
            "cluster.weight_sync broadcast, http, delta, disk or auto",
        ),
        (
            {"cluster.weight_sync": "in-process", "cluster.ray": True},
            "cluster.weight_sync: in-process reaches one engine in this process, beside one trainer (no Ray); this "
            "run's engines are engine actors on Ray: set cluster.ray false, or cluster.weight_sync broadcast, http, "
            "delta, disk or auto",
        ),
        (
            {"cluster.weight_sync": "in-process", "cluster.engines": 2, "cluster.address": "10.0.0.1:6379"},
            "cluster.weight_sync: in-process reaches one engine in this process, beside one trainer (no Ray); this "
            "run's engines are engine actors on Ray: set cluster.engines 1 and cluster.address null, or "
            "cluster.weight_sync broadcast, http, delta, disk or auto",
        ),
        (
            {"cluster.weight_sync": "distributed"},
            "cluster.weight_sync: engine.kind tidal takes in-process, broadcast, http, delta, disk (or auto), got "
            "distributed (engine.kind remote or sglang takes it): set cluster.weight_sync in-process or auto",
        ),
        (
            {"cluster.weight_sync": "broadcast", "engine.kind": "hf"},
            "cluster.weight_sync: engine.kind hf takes in-process (or auto), got broadcast (engine.kind tidal or "
            "vllm takes it): set cluster.weight_sync in-process or auto",
        ),
        (
            {"cluster.weight_sync": "delta", "engine.kind": "vllm", "cluster.ray": True},
            "cluster.weight_sync: delta sends only the tensors that changed, and engine.kind vllm takes whole models "
            "only: set cluster.weight_sync broadcast, http, disk or auto",
        ),
        (
            {"cluster.weight_sync": "broadcast", "engine.kind": "sglang"},
            "cluster.weight_sync: engine.kind sglang takes distributed, disk (or auto), got broadcast (engine.kind "
            "tidal or vllm takes it): set cluster.weight_sync distributed, disk or auto",
        ),
    ],
)
def test_the_mismatch_messages_read_as_written(values, message):
    with pytest.raises(ConfigError) as invalid:
        build_config(None, values)
    assert str(invalid.value) == f"invalid config:\n  {message}"


@pytest.mark.parametrize(
    ("values", "message", "fix"),
    [
        (
            {"cluster.ray": False, "cluster.trainers": 2},
            "cluster.ray: false trains in this process, and cluster.trainers 2 run as ranks on Ray; set cluster.ray "
            "auto (or true), or cluster.trainers 1",
            {"cluster.ray": "auto"},
        ),
        (
            {"cluster.ray": False, "cluster.engines": 2},
            "cluster.ray: false keeps one engine in this process, and cluster.engines 2 of engine.kind tidal run as "
            "actors on Ray; set cluster.ray auto (or true), or cluster.engines 1",
            {"cluster.engines": 1},
        ),
        (
            {"cluster.ray": False, "cluster.address": "10.0.0.1:6379"},
            "cluster.ray: false runs without Ray, and cluster.address '10.0.0.1:6379' names a Ray cluster to join; "
            "set cluster.ray auto (or true), or leave cluster.address unset",
            {"cluster.ray": True},
        ),
        ({"cluster.ray": "always"}, "cluster.ray: one of auto, true, false, got 'always'", {"cluster.ray": True}),
        (
            {"cluster.colocate": True},
            "cluster.colocate: only engine actors on Ray free their memory for the trainers; engine.kind tidal here "
            "runs one engine in this process, beside one trainer (no Ray): set cluster.ray true to put it on Ray, or "
            "cluster.colocate false (one engine in this process already shares the trainer's weights)",
            {"cluster.ray": True},
        ),
        (
            {"cluster.colocate": True, "engine.kind": "hf"},
            "cluster.colocate: only engine actors on Ray free their memory for the trainers; engine.kind hf here "
            "runs one engine in this process, beside one trainer (no Ray): set cluster.colocate false, or "
            "engine.kind tidal or vllm on Ray",
            {"cluster.colocate": False},
        ),
        (
            # the trainer's LoRA layers are shared only within this process: a trainer on Ray sends merged weights
            {"engine.kind": "hf", "cluster.ray": True, "train.lora_rank": 8, "train.lora_merge": False},
            "train.lora_merge: false shares the trainer's LoRA model with an in-process engine: it needs "
            "train.lora_rank > 0, engine.kind tidal or hf, one engine and no Ray (engines elsewhere get merged "
            "weights)",
            {"cluster.ray": False},
        ),
    ],
)
def test_ray_and_placement_mismatches_name_the_fix(values, message, fix):
    with pytest.raises(ConfigError) as invalid:
        build_config(None, values)
    assert str(invalid.value) == f"invalid config:\n  {message}"
    build_config(None, {**values, **fix})  # the fix it names validates


CONFIG_WORDS = re.compile(r"engine|kind|sync|transport")


def _compares_a_name(node: ast.AST, names: set[str]) -> bool:
    """`x == "name"`, `x != "name"`, `x in ("name", ...)` with a backend name as a constant and an
    engine, a kind or a transport on the other side (an ASGI `scope["type"] != "http"` is not one)."""
    if not isinstance(node, ast.Compare):
        return False
    consts, others = [], []
    for side in [node.left, *node.comparators]:
        if isinstance(side, ast.Constant):
            consts.append(side.value)
        elif isinstance(side, ast.Tuple | ast.List | ast.Set):
            consts += [e.value for e in side.elts if isinstance(e, ast.Constant)]
        else:
            others.append(ast.unparse(side))
    return any(c in names for c in consts) and any(CONFIG_WORDS.search(o) for o in others)


def test_no_code_outside_the_table_compares_engine_kinds_or_transports():
    names = (set(ENGINES) | set(TRANSPORTS)) - {"none"}
    package = Path(tidal.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "backends.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if _compares_a_name(node, names):
                found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {ast.unparse(node)}")
    # overlap's `mode` and the sandbox's backends share no name with an engine kind or a transport
    assert found == []


def test_the_help_lists_every_kind_and_transport():
    help_text = {
        f.name: f.metadata["help"]
        for f in Config.__dataclass_fields__["engine"].default_factory().__dataclass_fields__.values()
    }
    assert all(re.search(rf"\b{k}\b", help_text["kind"]) for k in ENGINES if k != "echo")


def test_the_records_say_what_their_cores_say():
    """A record's `partial_updates` is its core's own attribute (the weight sync asks the core)."""
    from tidal.adapters.hf_engine import HFEngine
    from tidal.engine.llm_engine import LLMEngine

    assert ENGINES["tidal"].partial_updates is LLMEngine.partial_updates is True
    assert ENGINES["hf"].partial_updates is HFEngine.partial_updates is True
    source = (Path(tidal.__file__).parent / "adapters" / "vllm_core.py").read_text()  # vLLM need not be installed
    assert "    partial_updates = False\n" in source and ENGINES["vllm"].partial_updates is False
    for kind in ENGINES.values():  # a transport that sends changes only is never offered to a whole-model engine
        assert kind.partial_updates or not any(TRANSPORTS[t].changed_only for t in kind.weight_syncs)
