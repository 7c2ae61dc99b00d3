"""SGLang servers for `engine.kind: sglang`: launched here, or attached to servers the user runs.

Launched: `cluster.engines` processes of `python -m sglang.launch_server` on this machine, each in
a process group of its own (so closing kills SGLang's scheduler and detokenizer processes too),
with its output in `<log_dir>/sglang_<i>.log`, each on `cluster.gpus_per_engine` CUDA devices (its
tensor-parallel size), after the trainer's devices unless colocated. tidal waits for every one
to answer /health within `cluster.engine_startup_timeout`; one that exits or stays silent stops
the start with its URL, log file and the tail of its output. With `engine.launch_router`,
`python -m sglang_router.launch_router` runs in front of them.

Attached: the servers at `engine.urls` (and the router at `engine.router_url`, if any)
must answer /health within the same timeout.

What goes where (sglang-router 0.3.2, checked against it): the router routes `/generate`,
`/v1/completions` and `/v1/chat/completions` (cache-aware by default: requests whose prompts
share a prefix go to the same server), answers `/health` and `/get_server_info` itself, passes
`/get_model_info` to one server and broadcasts `/flush_cache` to all. It has no `/abort_request`,
`/pause_generation`, `/continue_generation`, `/get_weight_version` or any weight route: those go
to each server (`SGLangServers.worker_urls`).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from tidal.adapters.options import EngineConfig
from tidal.net import free_port

log = logging.getLogger("tidal")

HOST = "127.0.0.1"  # launched servers are this machine's: loopback only
POLL_S = 0.5
TAIL_LINES = 20
STOP_GRACE_S = 10.0


class Layout(Protocol):
    """What the launcher reads of the run's layout (`tidal.cluster.options.ClusterConfig` has it)."""

    engines: int  # servers to launch
    gpus_per_engine: float  # CUDA devices per server (its tensor-parallel size)
    trainers: int
    gpus_per_trainer: float  # the trainers' devices come first, unless colocated
    colocate: bool
    engine_startup_timeout: float  # seconds a server may take to answer /health


@dataclass
class ServerProcess:
    """One launched process (a server or the router) and where its output goes."""

    name: str
    url: str
    command: list[str]
    log_path: Path | None = None
    popen: subprocess.Popen | None = None
    devices: str | None = None  # its CUDA_VISIBLE_DEVICES

    def start(self, env: dict[str, str]) -> ServerProcess:
        assert self.log_path is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            # a session of its own: SGLang's child processes share its process group and go with it
            self.popen = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        log.info("%s: pid %d at %s, output in %s", self.name, self.popen.pid, self.url, self.log_path)
        return self

    def tail(self, lines: int = TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return "(no output)"
        return "\n".join(text.splitlines()[-lines:]) or "(no output)"

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM to the whole process group, then SIGKILL to whatever is left of it."""
        p = self.popen
        if p is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:  # the group is gone
                break
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                pass

    def output(self) -> str:
        """Where the process's output is, and how it ends (for error messages)."""
        if self.popen is None:
            return ""
        return f"; its output ({self.log_path}) ends:\n{self.tail()}"

    def wait_healthy(self, deadline: float, limit: float, headers: dict[str, str] | None = None) -> None:
        """Until the process answers /health with 200: RuntimeError if it exits first,
        TimeoutError at `deadline`; both name its URL and log and show the tail of its output."""
        while True:
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} at {self.url} exited with code {self.popen.returncode} before answering "
                    f"/health{self.output()}"
                )
            left = deadline - time.monotonic()
            try:
                if httpx.get(self.url + "/health", headers=headers, timeout=max(0.5, min(5.0, left))).is_success:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.name} at {self.url} did not answer /health within {limit:g} s "
                    f"(cluster.engine_startup_timeout){self.output()}"
                )
            time.sleep(POLL_S)


@dataclass
class SGLangServers:
    """The SGLang servers the rollout uses. Generate at `generation_urls` (the router when there is
    one); send control and weight calls to each of `worker_urls`. `close()` stops what was
    launched (attached servers are left running)."""

    worker_urls: list[str]
    router_url: str | None = None
    processes: list[ServerProcess] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # launched servers' environment, for restarts
    startup_timeout: float = 600.0
    headers: dict[str, str] | None = None
    restarts: int = 0

    @property
    def generation_urls(self) -> list[str]:
        return [self.router_url] if self.router_url else list(self.worker_urls)

    def restart(self, url: str) -> bool:
        """Start the launched server at `url` again on its port (after stopping what is left of
        it) and wait for /health; False for a server tidal did not launch (attached)."""
        proc = next((p for p in self.processes if p.url == url.rstrip("/") and p.name != "sglang-router"), None)
        if proc is None:
            return False
        log.warning("%s at %s failed: restarting it", proc.name, proc.url)
        proc.stop()
        env = dict(self.env)
        devices = proc.devices
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        proc.start(env)
        proc.wait_healthy(time.monotonic() + self.startup_timeout, self.startup_timeout, self.headers)
        self.restarts += 1
        return True

    def close(self) -> None:
        for p in reversed(self.processes):  # the router first: it would report its servers gone
            p.stop()
        self.processes = []
        atexit.unregister(self.close)

    def __enter__(self) -> SGLangServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_command(
    python: str,
    model: str | Path,
    port: int,
    *,
    dtype: str = "auto",
    seed: int = 0,
    tp_size: int = 1,
    api_key: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`sglang.launch_server` for one rollout server. Its weight version starts at 0 (tidal's
    first version), and warm-up is skipped (a trainer's first request is the real warm-up)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", HOST, "--port", str(port)]
    cmd += ["--dtype", dtype, "--random-seed", str(seed), "--tp-size", str(tp_size)]
    cmd += ["--weight-version", "0", "--skip-server-warmup"]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + list(extra)


def router_command(
    python: str,
    worker_urls: Sequence[str],
    port: int,
    *,
    request_timeout: float,
    startup_timeout: float,
    policy: str = "cache_aware",
    metrics_port: int | None = None,
) -> list[str]:
    """`sglang_router.launch_router` in front of `worker_urls` (cache-aware: requests whose prompts
    share a prefix go to the same server, so a group's prompt is computed once). Its Prometheus
    exporter gets a port of its own (the default, 29000, allows one router per machine)."""
    cmd = [python, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls]
    cmd += ["--host", HOST, "--port", str(port), "--policy", policy, "--log-level", "warn"]
    cmd += ["--prometheus-host", HOST, "--prometheus-port", str(metrics_port or free_port())]
    cmd += ["--request-timeout-secs", str(math.ceil(request_timeout))]
    cmd += ["--worker-startup-timeout-secs", str(math.ceil(startup_timeout))]
    return cmd


def engine_devices(cluster: Layout, index: int, visible: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for launched server `index`: its `gpus_per_engine` devices, after the
    trainers' unless colocated (positions in the inherited CUDA_VISIBLE_DEVICES, if set)."""
    per = int(cluster.gpus_per_engine)
    if per == 0:
        return None
    first = 0 if cluster.colocate else math.ceil(cluster.trainers * cluster.gpus_per_trainer)
    ids = [str(i) for i in range(first + index * per, first + (index + 1) * per)]
    if visible:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
        if int(ids[-1]) >= len(devices):
            raise ValueError(
                f"cluster.gpus_per_engine: engine {index} needs device {ids[-1]} but CUDA_VISIBLE_DEVICES lists "
                f"{len(devices)} ({visible})"
            )
        ids = [devices[int(i)] for i in ids]
    return ",".join(ids)


def launch_sglang(
    engine: EngineConfig,
    cluster: Layout,
    model: str | Path,
    log_dir: str | Path,
    seed: int = 0,
    env: dict[str, str] | None = None,
) -> SGLangServers:
    """Start `cluster.engines` SGLang servers (and the router with `engine.launch_router`) and
    wait until each answers /health; on any failure everything started is stopped again. Server
    i's `--random-seed` is `seed + i`."""
    python = engine.sglang_python or sys.executable
    base = {**os.environ, **(env or {})}
    api_key = engine.api_key or None
    tp = max(1, int(cluster.gpus_per_engine))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    servers = SGLangServers(worker_urls=[], env=base, startup_timeout=cluster.engine_startup_timeout, headers=headers)
    atexit.register(servers.close)  # no orphans if the run ends without closing them
    try:
        for i in range(cluster.engines):
            port = free_port()
            cmd = server_command(
                python,
                model,
                port,
                dtype=engine.dtype,  # same names in SGLang (whose auto is the model's own dtype)
                seed=seed + i,
                tp_size=tp,
                api_key=api_key,
                extra=engine.sglang_args,
            )
            child_env = dict(base)
            devices = engine_devices(cluster, i, base.get("CUDA_VISIBLE_DEVICES"))
            if devices is not None:
                child_env["CUDA_VISIBLE_DEVICES"] = devices
            name, url = f"sglang server {i}", f"http://{HOST}:{port}"
            proc = ServerProcess(name, url, cmd, Path(log_dir) / f"sglang_{i}.log", devices=devices)
            servers.processes.append(proc.start(child_env))
            servers.worker_urls.append(proc.url)
        limit = cluster.engine_startup_timeout
        deadline = time.monotonic() + limit
        for proc in servers.processes:
            proc.wait_healthy(deadline, limit, headers)
        if engine.launch_router:
            servers.router_url = _start_router(servers, python, engine, limit, Path(log_dir) / "sglang_router.log")
    except BaseException:
        servers.close()
        raise
    return servers


PORT_TRIES = 3  # a router whose free port another process took before it bound it: another port


def _start_router(servers: SGLangServers, python: str, engine: EngineConfig, limit: float, log_path: Path) -> str:
    """Start sglang-router in front of `servers` (it joins `servers.processes`) and return its URL
    once it answers /health. Its ports are chosen free (`free_port`) and bound by the router a
    moment later: on a busy machine another process can take one in between, and the router
    exits saying so; it is then started again on other ports (its output in a log of its own), up
    to `PORT_TRIES` times."""
    attempt = 1
    while True:
        port = free_port()
        cmd = router_command(
            python, servers.worker_urls, port, request_timeout=engine.request_timeout, startup_timeout=limit
        )
        path = log_path if attempt == 1 else log_path.with_suffix(f".{attempt}{log_path.suffix}")
        router = ServerProcess("sglang-router", f"http://{HOST}:{port}", cmd, path)
        servers.processes.append(router.start(servers.env))
        try:
            router.wait_healthy(time.monotonic() + limit, limit)
            return router.url
        except RuntimeError:
            if attempt == PORT_TRIES or "Address already in use" not in router.tail():
                raise
        servers.processes.remove(router)
        log.info("sglang-router: a port was taken before it bound it (try %d of %d)", attempt, PORT_TRIES)
        attempt += 1


def attach_sglang(engine: EngineConfig, cluster: Layout) -> SGLangServers:
    """The servers at `engine.urls` (and `engine.router_url`), once each answers /health
    (within `cluster.engine_startup_timeout`)."""
    urls = [u.rstrip("/") for u in engine.urls]
    router = engine.router_url.rstrip("/") if engine.router_url else None
    limit = cluster.engine_startup_timeout
    deadline = time.monotonic() + limit
    headers = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else None
    for i, url in enumerate([*urls, *([router] if router else [])]):
        name = "sglang-router" if url == router else f"sglang server {i}"
        ServerProcess(name, url, []).wait_healthy(deadline, limit, headers)
    return SGLangServers(worker_urls=urls, router_url=router)


def start_sglang(
    engine: EngineConfig,
    cluster: Layout,
    model: str | Path,
    log_dir: str | Path,
    seed: int = 0,
    env: dict[str, str] | None = None,
) -> SGLangServers:
    """Attach to `engine.urls` when given, else launch servers (`launch_sglang`): the launcher of
    `engine.kind: sglang` in `tidal.backends`."""
    if engine.urls:
        return attach_sglang(engine, cluster)
    return launch_sglang(engine, cluster, model, log_dir, seed, env)
