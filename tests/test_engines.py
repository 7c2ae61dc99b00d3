"""One set of tests for every engine behind the contract (tiny model, fp32): tidal's engine in this
process, a remote `tidal serve` (`engine.kind: remote`), SGLang's protocol (`engine.kind:
sglang`, launched servers; here `tidal serve` stands in for `sglang.launch_server`) and vLLM (where
it is installed). Each builds the run's roles as the
loop does and checks what a trainer relies on: log-probs that match the trainer's, every weight
push served and checked, partial rollouts continued on new weights, sleep/wake, and an engine
killed mid-rollout recovered."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import loop_config

from tidal.convert import load_tokenizer
from tidal.data.dataset import PromptRecord
from tidal.roles import build_roles
from tidal.rollout.manager import RolloutManager
from tidal.rollout.overlap import push_cutting_requests
from tidal.sync.base import SyncError

STANDIN = Path(__file__).parent / "adapters" / "sglang_standin"
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")
KINDS = ["tidal", "remote", "sglang", pytest.param("vllm", marks=[needs_vllm, pytest.mark.vllm])]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama with 32-dimensional heads (vLLM's CPU attention has no 16) + the byte tokenizer."""
    from conftest import make_model

    path = tmp_path_factory.mktemp("tiny_model_h32")
    make_model(num_attention_heads=2, num_key_value_heads=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def build(tiny_model_dir, tmp_path, monkeypatch):
    """`build(kind, **config)` -> (cfg, tokenizer, roles); every roles built is closed at the end."""
    made = []
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(STANDIN), os.environ.get("PYTHONPATH")) if p))

    def make(kind: str, **over):
        if kind == "remote":  # a server of the user's: tidal serve on the same model, in this process
            from tidal.adapters.async_engine import AsyncEngine
            from tidal.engine.llm_engine import LLMEngine
            from tidal.server.app import BackgroundServer, build_app

            tokenizer = load_tokenizer(tiny_model_dir)
            core = LLMEngine(tiny_model_dir, tokenizer, dtype="float32", kv_cache_tokens=8192)
            served = AsyncEngine(core)
            server = BackgroundServer(build_app(served, "tiny")).start()
            servers.append((server, served))
            over = {"engine.urls": [server.url], **over}
        cfg = loop_config(tiny_model_dir, tmp_path / kind, **{"engine.kind": kind, **over})
        tok = load_tokenizer(tiny_model_dir)
        roles = build_roles(cfg, Path(tiny_model_dir), tok, None)
        made.append(roles)
        return cfg, tok, roles

    servers = []
    yield make
    for roles in made:
        roles.close()
    for server, served in servers:
        server.stop()
        served.close()


def records(tok, n=2):
    texts = [f"tell me about {w}" for w in ("cats", "the sea", "rain", "stars")[:n]]
    return [PromptRecord(index=i, prompt=t, text=t, input_ids=tok.encode(t), label="x") for i, t in enumerate(texts)]


def assert_log_probs_match(trainer, samples, atol=1e-4):
    """The trainer's log-probs of every sampled token equal the engine's (fp32)."""
    logp = trainer.compute_log_probs(samples)
    for i, s in enumerate(samples):
        got = logp[i, : s.response_length]
        want = torch.tensor(s.rollout_log_probs)
        assert s.response_length > 0
        torch.testing.assert_close(got, want, atol=atol, rtol=0)


def nudge(trainer, seed: int) -> None:
    """New weights for the trainer (what an optimizer step would give)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("kind", KINDS)
def test_step_zero_log_probs_match_the_trainer(build, kind):
    cfg, tok, roles = build(kind)
    assert roles.sync.push(0)["sync/tensors"] > 0
    manager = RolloutManager.from_config(roles.engines.engine, cfg, tok, roles.engines.loop)
    samples = manager.generate(records(tok), step=0)
    assert len(samples) == 8 and {s.weight_version for s in samples} == {0}
    assert_log_probs_match(roles.trainer, samples)


@pytest.mark.parametrize("kind", KINDS)
def test_every_push_is_checked_and_served(build, kind):
    cfg, tok, roles = build(kind)
    manager = RolloutManager.from_config(roles.engines.engine, cfg, tok, roles.engines.loop)
    for version in (1, 2):
        nudge(roles.trainer, version)
        roles.sync.push(version)
        samples = manager.generate(records(tok), step=version)
        assert {s.weight_version for s in samples} == {version}
        assert_log_probs_match(roles.trainer, samples)  # the engine serves exactly the pushed weights
    # a push the engine cannot load is refused, and the engine stays on version 2
    real = roles.trainer.named_weights

    def broken(dtype=None, **kw):
        for name, t in real(dtype, **kw):
            yield name, (t[:-1] if name.endswith("embed_tokens.weight") else t)

    roles.trainer.named_weights = broken
    with pytest.raises(SyncError):
        roles.sync.push(3)
    roles.trainer.named_weights = real
    again = manager.generate(records(tok), step=2)
    assert [s.response_tokens for s in again] == [s.response_tokens for s in samples]
    assert {s.weight_version for s in again} == {2}


def decoded_tokens(roles) -> int:
    """Tokens the engine has decoded so far (its own stats: in this process, or over HTTP)."""
    engine = roles.engines.engine
    core = getattr(engine, "core", None)
    if core is not None:
        stats = core.stats()  # tidal's engine counts decode tokens, vLLM's core every generated token
        return int(stats.get("decode_tokens", stats.get("generated_tokens", 0)))

    async def infos():
        return await asyncio.gather(*(c.get_server_info() for c in engine.control.clients))

    infos = roles.engines.loop.run(infos(), 30)
    return sum(int(i.get("decode_tokens", 0)) for i in infos)


@pytest.mark.parametrize("kind", KINDS)
def test_a_partial_rollout_continues_on_the_new_weights(build, kind):
    """New weights arrive mid-rollout: the engine pauses, its requests are cut and sent again,
    version 1 loads, and every cut sample continues from its own tokens: its first tokens scored
    by the old weights, the rest by the new ones, each as the engine sampled it."""
    over = {"overlap.mode": "full", "overlap.max_staleness": 1, "algo.is_correction": "truncate"}
    # (the overlapped loop's roles: an in-process engine keeps its own copy of the weights, which the
    # trainer changes while it generates)
    cfg, tok, roles = build(kind, **{"rollout.max_new_tokens": 200, "engine.kv_cache_tokens": 8192, **over})
    roles.sync.push(0)
    manager = RolloutManager.from_config(roles.engines.engine, cfg, tok, roles.engines.loop)
    manager.continue_partial = True
    old = {n: t.clone() for n, t in roles.trainer.model.state_dict().items()}
    start = decoded_tokens(roles)
    rollout = roles.engines.loop.submit(manager.agenerate(records(tok), step=0))
    deadline = time.monotonic() + 120
    while decoded_tokens(roles) - start < 8 * 3:  # a few tokens for each of the 8 requests
        assert time.monotonic() < deadline and not rollout.done(), "the rollout never got going"
        time.sleep(0.05)
    nudge(roles.trainer, 7)
    push_cutting_requests(roles.engines.engine, roles.engines.loop, lambda: roles.sync.push(1), 60)
    samples = rollout.result(300)
    cut = [s for s in samples if s.metadata.get("segments") == 2]
    assert cut and manager.aborted == manager.resumed == len(cut)
    new = {n: t.clone() for n, t in roles.trainer.model.state_dict().items()}
    roles.trainer.model.load_state_dict(old)
    before = roles.trainer.compute_log_probs(cut)
    roles.trainer.model.load_state_dict(new)
    after = roles.trainer.compute_log_probs(cut)
    for i, s in enumerate(cut):
        k = s.token_versions.count(0)
        assert 0 < k < s.response_length and s.token_versions == [0] * k + [1] * (s.response_length - k)
        want = torch.tensor(s.rollout_log_probs)
        torch.testing.assert_close(before[i, :k], want[:k], atol=1e-4, rtol=0)
        torch.testing.assert_close(after[i, k : s.response_length], want[k:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_sleep_and_wake(build, kind):
    cfg, tok, roles = build(kind)
    roles.sync.push(0)
    manager = RolloutManager.from_config(roles.engines.engine, cfg, tok, roles.engines.loop)
    before = manager.generate(records(tok), step=0)
    engine, loop = roles.engines.engine, roles.engines.loop
    loop.run(engine.sleep(), 60)
    loop.run(engine.wake(), 60)
    roles.sync.push(1)  # the same weights, as the next version: a woken engine serves after a push
    after = manager.generate(records(tok), step=0)
    assert [s.response_tokens for s in after] == [s.response_tokens for s in before]
    assert {s.weight_version for s in after} == {1}


def test_a_launched_sglang_server_killed_mid_rollout_is_restarted(build):
    """Two launched servers; one dies holding requests: they go to the other (every sample once),
    and the next push starts it again in its place with the current weights."""
    cfg, tok, roles = build("sglang", **{"cluster.engines": 2, "rollout.max_new_tokens": 64})
    roles.sync.push(0)
    engine, loop = roles.engines.engine, roles.engines.loop
    manager = RolloutManager.from_config(engine, cfg, tok, loop)
    reference = manager.generate(records(tok, 4), step=0)
    victim = engine.control.clients[1]
    loop.run(victim.pause(), 30)  # its requests wait there...
    rollout = loop.submit(manager.agenerate(records(tok, 4), step=0))
    deadline = time.monotonic() + 120
    while engine.router.in_flight[1] == 0:
        assert time.monotonic() < deadline and not rollout.done()
        time.sleep(0.01)
    pid = next(p.popen.pid for p in roles.engines.launched.processes if p.url == victim.base_url)
    os.killpg(pid, signal.SIGKILL)  # ...and it dies with them
    samples = rollout.result(300)
    assert [s.response_tokens for s in samples] == [s.response_tokens for s in reference]
    assert engine.router.resent >= 1 and list(engine.router.down) == [1]
    metrics = roles.sync.push(1)
    assert metrics["engines/restarts"] == 1.0 and engine.router.down == {}
    assert loop.run(engine.get_weight_versions(), 30) == [1, 1]
    again = manager.generate(records(tok, 4), step=0)
    assert {s.weight_version for s in again} == {1}


@pytest.mark.parametrize("kind", KINDS)
def test_the_overlapped_loop_trains_on_every_engine(tiny_model_dir, tmp_path, monkeypatch, kind):
    """`overlap.mode: full` with partial rollouts, three steps: every trained token at most one
    version old, each sample's tokens sampled by the versions it records."""
    import tidal.loop

    seen = []
    real = tidal.loop.compute_advantages

    def spy(a_cfg, samples, *args, **kw):
        seen.append([list(s.token_versions) for s in samples])
        return real(a_cfg, samples, *args, **kw)

    monkeypatch.setattr(tidal.loop, "compute_advantages", spy)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(STANDIN), os.environ.get("PYTHONPATH")) if p))
    over = {
        "engine.kind": kind,
        "train.num_steps": 3,
        "overlap.mode": "full",
        "overlap.max_staleness": 1,
        "algo.is_correction": "truncate",
    }
    server = None
    if kind == "remote":
        from tidal.adapters.async_engine import AsyncEngine
        from tidal.engine.llm_engine import LLMEngine
        from tidal.server.app import BackgroundServer, build_app

        served = AsyncEngine(LLMEngine(tiny_model_dir, load_tokenizer(tiny_model_dir), dtype="float32"))
        server = BackgroundServer(build_app(served, "tiny")).start()
        over["engine.urls"] = [server.url]
    try:
        history = tidal.loop.train(loop_config(tiny_model_dir, tmp_path, **over))
    finally:
        if server is not None:
            server.stop()
            served.close()
    assert [h["step"] for h in history] == [1, 2, 3]
    for step, versions in enumerate(seen):
        ages = [step - v for vs in versions for v in vs if v >= 0]
        assert ages and min(ages) >= 0 and max(ages) <= 1
        assert history[step]["staleness/max"] == max(ages)
