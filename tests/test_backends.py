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
from tidal.backends import ENGINES, IN_PROCESS, RAY, SERVERS, TRANSPORTS, EngineKind, resolve_sync
from tidal.cluster.options import ClusterConfig
from tidal.config import Config, build_config
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
    with pytest.raises(
        ValueError, match=r"cluster.weight_sync: broadcast reaches engine actors on Ray .*: use in-process"
    ):
        resolve_sync(tidal_kind, IN_PROCESS, "broadcast")
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
