"""`engine.kind: sglang` on this CPU: the launcher starts real processes of a stand-in
`sglang.launch_server` (tests/adapters/sglang_standin: SGLang's flags mapped onto `tidal serve`,
since SGLang itself needs CUDA), and the real sglang-router (Rust, from PyPI) runs in front of
tidal servers. Tests that need the router skip when it is not installed."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import make_model, make_tokenizer

import tidal
from tidal.adapters.async_engine import AsyncEngine
from tidal.adapters.client import EngineClient
from tidal.adapters.options import EngineConfig
from tidal.adapters.sglang_launch import (
    HOST,
    ServerProcess,
    attach_sglang,
    engine_devices,
    launch_sglang,
    router_command,
    server_command,
)
from tidal.cluster.options import ClusterConfig
from tidal.config import Config, validate
from tidal.contracts import SamplingParams
from tidal.engine.llm_engine import LLMEngine
from tidal.engine.weights import model_checksum
from tidal.net import free_port
from tidal.options import ConfigError
from tidal.server.app import BackgroundServer, build_app
from tidal.sync.base import SyncError
from tidal.sync.distributed import DistributedSync

HAS_ROUTER = importlib.util.find_spec("sglang_router") is not None
needs_router = pytest.mark.skipif(not HAS_ROUTER, reason="sglang-router is not installed (pip install sglang-router)")
STANDIN = Path(__file__).parent / "sglang_standin"


def standin_env() -> dict[str, str]:
    """The stand-in `sglang` package and this checkout's tidal first on the path."""
    here = str(Path(tidal.__file__).resolve().parents[1])
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(STANDIN), here, os.environ.get("PYTHONPATH")) if p)}


def group_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ---------------------------------------------------------------------- commands and config
def test_server_command_has_the_flags_a_trainer_needs():
    cmd = server_command("py", "/m", 1234, dtype="bfloat16", seed=7, tp_size=2, api_key="k", extra=["--x", "1"])
    assert cmd == [
        "py", "-m", "sglang.launch_server", "--model-path", "/m", "--host", HOST, "--port", "1234",
        "--dtype", "bfloat16", "--random-seed", "7", "--tp-size", "2", "--weight-version", "0",
        "--skip-server-warmup", "--api-key", "k", "--x", "1",
    ]  # fmt: skip


def test_router_command_matches_its_cli():
    cmd = router_command(
        "py", ["http://a:1", "http://b:2"], 99, request_timeout=300.5, startup_timeout=600, metrics_port=98
    )
    assert cmd == [
        "py", "-m", "sglang_router.launch_router", "--worker-urls", "http://a:1", "http://b:2", "--host", HOST,
        "--port", "99", "--policy", "cache_aware", "--log-level", "warn", "--prometheus-host", HOST,
        "--prometheus-port", "98", "--request-timeout-secs", "301", "--worker-startup-timeout-secs", "600",
    ]  # fmt: skip


def test_engine_devices_follow_the_trainers():
    c = ClusterConfig(trainers=2, gpus_per_trainer=1, engines=2, gpus_per_engine=2)
    assert [engine_devices(c, i, None) for i in range(2)] == ["2,3", "4,5"]
    assert engine_devices(c, 1, "7,6,5,4,3,2") == "3,2"  # positions in the inherited list
    c.colocate = True
    assert engine_devices(c, 1, None) == "2,3"
    assert engine_devices(ClusterConfig(gpus_per_engine=0), 0, None) is None
    with pytest.raises(ValueError, match="engine 1 needs device 4 but CUDA_VISIBLE_DEVICES lists 4"):
        engine_devices(ClusterConfig(gpus_per_trainer=1, gpus_per_engine=2, engines=2), 1, "0,1,2,3")


def config(**rollout) -> Config:
    cfg = Config()
    for k, v in rollout.items():
        group, _, name = k.partition("__")
        setattr(getattr(cfg, group), name, v)
    return cfg


def errors(cfg: Config) -> str:
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    return str(err.value)


def test_config_names_the_field():
    assert "engine.router_url: a router in front of engine.urls" in errors(
        config(engine__kind="sglang", engine__router_url="http://r:1")
    )
    assert "engine.launch_router: starts sglang-router in front of the servers tidal launches" in errors(
        config(engine__kind="sglang", engine__urls=["http://a:1"], engine__launch_router=True)
    )
    assert "cluster.weight_sync: engine.kind sglang takes distributed, disk (or auto), got http" in errors(
        config(engine__kind="sglang", cluster__weight_sync="http")
    )
    assert "cluster.gpus_per_engine: a launched engine.kind sglang server takes whole GPUs, got 0.5" in errors(
        config(engine__kind="sglang", cluster__gpus_per_engine=0.5)
    )
    assert "engine.urls: http(s):// URLs of servers, got ['a:1']" in errors(
        config(engine__kind="sglang", engine__urls=["a:1"])
    )
    assert "cluster.weight_sync: engine.kind tidal takes in-process, broadcast, http, delta, disk (or auto)" in errors(
        config(cluster__weight_sync="distributed")
    )
    validate(config(engine__kind="sglang", cluster__engines=2, cluster__weight_sync="distributed"))


# ---------------------------------------------------------------------- launching
def test_a_server_that_exits_at_once_is_named_with_its_output(tiny_model_dir, tmp_path):
    rollout = EngineConfig(kind="sglang", sglang_args=["--no-such-flag"])
    with pytest.raises(RuntimeError) as err:
        launch_sglang(rollout, ClusterConfig(), tiny_model_dir, tmp_path, env=standin_env())
    message = str(err.value)
    assert message.startswith(f"sglang server 0 at http://{HOST}:")
    assert "exited with code 2 before answering /health" in message
    assert f"its output ({tmp_path / 'sglang_0.log'}) ends:" in message
    assert "unrecognized arguments: --no-such-flag" in message


def test_a_server_that_never_answers_times_out_and_is_killed(tiny_model_dir, tmp_path, monkeypatch):
    rollout = EngineConfig(kind="sglang", sglang_args=["--standin-hang"])
    cluster = ClusterConfig(engines=2, engine_startup_timeout=3)  # nothing ever answers: no race with the clock
    started: list[ServerProcess] = []
    real_start = ServerProcess.start

    def start(self, env):
        started.append(self)
        return real_start(self, env)

    monkeypatch.setattr(ServerProcess, "start", start)
    with pytest.raises(TimeoutError) as err:
        launch_sglang(rollout, cluster, tiny_model_dir, tmp_path, env=standin_env())
    assert str(err.value).startswith(f"sglang server 0 at http://{HOST}:")
    assert "did not answer /health within 3 s (cluster.engine_startup_timeout)" in str(err.value)
    assert len(started) == 2
    assert all(p.popen.poll() is not None and group_gone(p.popen.pid) for p in started)


@pytest.fixture(scope="module")
def launched(tiny_model_dir, tmp_path_factory):
    """Two stand-in servers (and the real router when installed), started by the launcher."""
    rollout = EngineConfig(kind="sglang", dtype="float32", launch_router=HAS_ROUTER)
    cluster = ClusterConfig(engines=2, engine_startup_timeout=300)
    servers = launch_sglang(rollout, cluster, tiny_model_dir, tmp_path_factory.mktemp("logs"), env=standin_env())
    yield servers
    servers.close()


def test_launched_servers_answer_with_version_zero(launched):
    assert len(set(launched.worker_urls)) == 2
    for url in launched.worker_urls:
        assert httpx.get(url + "/get_weight_version").json() == {"weight_version": 0}  # --weight-version 0
    assert launched.generation_urls == ([launched.router_url] if HAS_ROUTER else launched.worker_urls)
    attached = attach_sglang(
        EngineConfig(kind="sglang", urls=launched.worker_urls, router_url=launched.router_url),
        ClusterConfig(),
    )
    assert attached.worker_urls == launched.worker_urls and attached.router_url == launched.router_url
    attached.close()  # attached servers are not ours: they keep running
    assert all(httpx.get(u + "/health").status_code == 200 for u in launched.worker_urls)


def test_attaching_to_a_silent_url_names_it():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError) as err:
        attach_sglang(EngineConfig(kind="sglang", urls=[url]), ClusterConfig(engine_startup_timeout=1))
    assert (
        str(err.value) == f"sglang server 0 at {url} did not answer /health within 1 s (cluster.engine_startup_timeout)"
    )


@needs_router
def test_a_router_port_taken_before_it_binds_it_is_replaced(tiny_model_dir, tmp_path, monkeypatch):
    """The router's port is chosen free and bound a moment later; here another socket holds the
    first one chosen, the router exits on it, and the launcher starts it on another."""
    from tidal.adapters import sglang_launch

    held = socket.socket()
    held.bind((HOST, 0))
    held.listen()
    taken = held.getsockname()[1]
    calls = []

    def free_port_but_one():  # two servers' ports, then the router's: the held one
        calls.append(1)
        return taken if len(calls) == 3 else free_port()

    monkeypatch.setattr(sglang_launch, "free_port", free_port_but_one)
    rollout = EngineConfig(kind="sglang", dtype="float32", launch_router=True)
    cluster = ClusterConfig(engines=2, engine_startup_timeout=300)
    try:
        servers = launch_sglang(rollout, cluster, tiny_model_dir, tmp_path, env=standin_env())
    finally:
        held.close()
    try:
        assert servers.router_url != f"http://{HOST}:{taken}" and len(servers.processes) == 3
        assert "Address already in use" in (tmp_path / "sglang_router.log").read_text()
        assert httpx.get(servers.router_url + "/health").status_code == 200
    finally:
        servers.close()


@needs_router
def test_generate_through_the_launched_router(launched):
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 4},
        "return_logprob": True,
    }
    routed = httpx.post(launched.router_url + "/generate", json=body, timeout=60).json()
    direct = httpx.post(launched.worker_urls[0] + "/generate", json=body, timeout=60).json()
    assert routed["output_ids"] == direct["output_ids"] and 1 <= len(routed["output_ids"]) <= 6
    assert routed["meta_info"]["output_token_logprobs"] == direct["meta_info"]["output_token_logprobs"]
    assert routed["meta_info"]["finish_reason"] == direct["meta_info"]["finish_reason"]


class KillAfterFirstBucket(DistributedSync):
    """Kills one server's process group once the first bucket of a push is in."""

    victim: ServerProcess | None = None

    async def _bucket(self, part, version):
        await super()._bucket(part, version)
        if self.victim is not None:
            os.killpg(self.victim.popen.pid, signal.SIGKILL)
            self.victim.popen.wait(30)
            self.victim = None


def test_push_to_launched_servers_and_a_server_dying_mid_push(launched):
    """Runs last in this module: it kills a server, then closes the launch."""
    trainer_model = make_model(seed=21)

    class Trainer:
        def named_weights(self, dtype=None):
            return ((n, p.detach()) for n, p in trainer_model.named_parameters())

    clients = [EngineClient(u, 60) for u in launched.worker_urls]
    sync = KillAfterFirstBucket(Trainer(), clients, timeout=120, bucket_bytes=40_000)
    sync.push(1)
    want = model_checksum(trainer_model)
    for url in launched.worker_urls:
        assert httpx.get(url + "/get_weight_version?checksum=true").json() == {
            "weight_version": 1,
            "weight_checksum": want,
        }
    victim = launched.processes[1]
    sync.victim = victim
    start = time.monotonic()
    with pytest.raises(SyncError) as err:
        sync.push(2)
    assert time.monotonic() - start < 120  # named well within the sync timeout, not after it
    assert err.value.engine == victim.url
    assert str(err.value).startswith(f"weight sync to engine {victim.url} over distributed: ")
    survivor = launched.worker_urls[0]
    assert httpx.get(survivor + "/get_weight_version?checksum=true").json() == {
        "weight_version": 1,  # the failed push was staged there, never loaded
        "weight_checksum": want,
    }
    sync.close()
    processes = list(launched.processes)
    launched.close()
    assert all(p.popen.poll() is not None and group_gone(p.popen.pid) for p in processes)


# ---------------------------------------------------------------------- the real router, tidal workers
@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """The real sglang-router in front of two in-process tidal servers that record what they get."""
    if not HAS_ROUTER:
        pytest.skip("sglang-router is not installed (pip install sglang-router)")
    workers = []
    for _ in range(2):
        core = LLMEngine(make_model(), make_tokenizer(), dtype="float32", kv_cache_tokens=2048)
        core.seen, core.flushes = [], 0
        add, flush = core.add_request, core.flush_cache

        def record(rid, prompt, params, core=core, add=add):
            core.seen.append(tuple(prompt))
            return add(rid, prompt, params)

        def count(core=core, flush=flush):
            core.flushes += 1
            return flush()

        core.add_request, core.flush_cache = record, count
        engine = AsyncEngine(core)
        workers.append((core, engine, BackgroundServer(build_app(engine, "tiny")).start()))
    urls = [w[2].url for w in workers]
    routers = {}
    for policy in ("cache_aware", "round_robin"):
        port = free_port()
        cmd = router_command(sys.executable, urls, port, request_timeout=60, startup_timeout=60, policy=policy)
        log_path = tmp_path_factory.mktemp("r") / f"router_{policy}.log"
        routers[policy] = ServerProcess(f"sglang-router ({policy})", f"http://{HOST}:{port}", cmd, log_path)
        routers[policy].start(dict(os.environ))
    try:
        for router in routers.values():
            router.wait_healthy(time.monotonic() + 60, 60)
        yield {policy: r.url for policy, r in routers.items()}, workers
    finally:
        for router in routers.values():
            router.stop()
        for _, engine, server in workers:
            server.stop()
            engine.close()


def test_router_returns_the_workers_tokens_and_log_probs(routed):
    urls, workers = routed
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=123)

    async def both():
        via = await EngineClient(urls["cache_aware"], 60).generate([9, 10, 11], params)
        direct = await EngineClient(workers[0][2].url, 60).generate([9, 10, 11], params)
        return via, direct

    via, direct = asyncio.run(both())
    assert len(via.token_ids) == len(via.log_probs) >= 1
    assert via.token_ids == direct.token_ids
    assert via.log_probs == direct.log_probs
    assert all(lp < 0 for lp in via.log_probs)


def where_groups_went(url: str, workers, prompts) -> list[list[int]]:
    """Send each prompt's 4 samples at once (groups one after another); for each prompt, how many
    of its requests each server got."""
    for core, _, _ in workers:
        core.seen.clear()

    async def groups():
        client = EngineClient(url, 60)
        for g, prompt in enumerate(prompts):
            params = [SamplingParams(temperature=1.0, max_new_tokens=4, seed=100 * g + i) for i in range(4)]
            await asyncio.gather(*(client.generate(prompt, p) for p in params))
        await client.aclose()

    asyncio.run(groups())
    return [[core.seen.count(tuple(p)) for core, _, _ in workers] for p in prompts]


def test_cache_aware_routing_keeps_each_group_on_one_server(routed):
    """The samples of a prompt go where the prompt's prefix is cached; the same traffic through a
    round-robin router splits every group, so the measurement can see a split."""
    urls, workers = routed
    prompts = [[40 + 7 * g + k for k in range(12)] for g in range(4)]
    assert all(sorted(counts) == [0, 4] for counts in where_groups_went(urls["cache_aware"], workers, prompts))
    assert all(counts == [2, 2] for counts in where_groups_went(urls["round_robin"], workers, prompts))


def test_control_calls_reach_both_workers(routed):
    urls, workers = routed
    flushes = [core.flushes for core, _, _ in workers]
    resp = httpx.post(urls["cache_aware"] + "/flush_cache", timeout=30)
    assert resp.status_code == 200
    assert [core.flushes for core, _, _ in workers] == [f + 1 for f in flushes]  # the router broadcasts it
    for path in ("/pause_generation", "/abort_request", "/update_weights_from_distributed"):
        assert httpx.post(urls["cache_aware"] + path, json={}, timeout=30).status_code == 404  # each server's

    async def pause_resume():
        clients = [EngineClient(server.url, 30) for _, _, server in workers]
        await asyncio.gather(*(c.pause() for c in clients))
        paused = [engine.paused for _, engine, _ in workers]
        await asyncio.gather(*(c.resume() for c in clients))
        return paused

    assert asyncio.run(pause_resume()) == [True, True]
    assert [engine.paused for _, engine, _ in workers] == [False, False]
