"""Rollout engines on Ray: each actor runs tidal's engine behind its HTTP server (the same server
as `tidal serve`), and the loop reaches them through the router like any remote server.

Besides HTTP, an engine actor can join a process group with trainer rank 0 and receive weights by
broadcast (`tidal.sync.broadcast`). Sleep and wake (colocated trainers need the memory) go over
HTTP like every other control call. An actor runs tidal's engine or vLLM's (`engine.kind`).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path

import torch

from tidal.adapters.options import EngineConfig
from tidal.aio import LoopThread
from tidal.cluster.options import ClusterConfig
from tidal.hardware import CPU, bind_device, resolve_device, resolve_dtype
from tidal.log import setup_worker_logging

log = logging.getLogger("tidal")


class EngineServer:
    """One engine (a Ray actor): the core of `kind` (an `engine.kind` with Ray actors: tidal's
    `LLMEngine`, vLLM's) on its thread behind `AsyncEngine`, the HTTP app on a port of this node."""

    def __init__(
        self, model: str, engine_kwargs: dict, threads: int, api_key: str, kind: str = "tidal", device: str = "auto"
    ) -> None:
        from transformers import AutoTokenizer

        from tidal.adapters.async_engine import AsyncEngine
        from tidal.adapters.factory import build_core
        from tidal.backends import engine_kind
        from tidal.data.images import ImageReader
        from tidal.net import node_ip
        from tidal.server.app import BackgroundServer, build_app
        from tidal.server.options import ServerConfig

        setup_worker_logging()  # tidal's lines to the driver's console, no library chatter or bars
        started = time.perf_counter()
        torch.set_num_threads(max(1, threads))
        tokenizer = AutoTokenizer.from_pretrained(model)
        record = engine_kind(kind)
        placed, where = CPU, f"{kind} places itself"
        if "device" in record.core_options:  # else the core places itself (vLLM)
            choice = resolve_device(device)
            placed = str(bind_device(choice.device))  # the GPU Ray gave this actor
            where = f"{placed} ({choice.reason})"
            if engine_kwargs.get("dtype") == "auto":  # resolved for this node here, and said in the one line below
                dtype = resolve_dtype("auto", "engine.dtype", torch.device(placed).type)
                engine_kwargs = {**engine_kwargs, "dtype": dtype.dtype}
                where += f", {dtype.dtype} ({dtype.reason})"
        self.core = build_core(record, model, tokenizer, engine_kwargs, placed)
        self.device = getattr(self.core, "device", CPU)
        self.engine = AsyncEngine(self.core)
        host = node_ip()
        # reachable from the network: only the run that started it knows the key; a vision-language
        # model's processor reads the images the rollout sends
        images = ImageReader.for_model(model, Path.cwd())
        app = build_app(self.engine, model, ServerConfig(api_key=api_key), images)
        self.server = BackgroundServer(app, host=host, port=0).start()
        self.url = f"http://{host}:{self.server.port}"
        self.weight_group = None
        log.info(
            "engine actor (pid %d): %s engine ready in %.1f s on %s, serving %s",
            os.getpid(),
            kind,
            time.perf_counter() - started,
            where,
            self.url,
        )

    def address(self) -> str:
        return self.url

    def pid(self) -> int:
        return os.getpid()

    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    def partial_updates(self) -> bool:
        """Whether a weight update may name only the tensors that changed (tidal's engine: yes)."""
        return self.engine.partial_updates

    def join_weight_group(self, init_method: str, rank: int, world: int, timeout_s: float) -> bool:
        from tidal.sync.broadcast import join_group

        self.weight_group = join_group(init_method, rank, world, timeout_s, self.device)
        return True

    def receive_weights(
        self, meta: list[tuple[str, tuple[int, ...]]], version: int, bucket_bytes: int, partial: bool = False
    ) -> tuple:
        """Receive one broadcast of the weights into new tensors, then load them all at once between
        two engine steps; returns (version, checksum) as the engine reports them. `partial`: the
        broadcast holds only the tensors that changed; the checksum is then of those."""
        from tidal.engine.weights import weights_checksum
        from tidal.sync.broadcast import receive_weights

        named = receive_weights(self.weight_group, meta, self.engine.dtype, bucket_bytes, self.device)
        if not partial:
            return self.engine.load_weights(named, version)
        got, _ = self.engine.load_weights(named, version, checksum=False, partial=True)
        return got, weights_checksum(named)

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


class EngineGroup:
    """`cluster.engines` engine actors in the run's placement group, and the `HttpEngine` (router)
    the rollout calls, on the role's event loop.

    Fault tolerance: an engine is given `cluster.engine_startup_timeout` seconds to load and answer
    /health before it counts as failed. During a rollout the router takes a failed engine out of
    service and sends its requests again to the others; `recover()` (called by the weight sync
    before each push) then restarts it in its bundle or drops it (`cluster.engine_failure`), and
    the push that follows gives it the current weights before it serves again."""

    def __init__(
        self,
        cluster: ClusterConfig,
        engine: EngineConfig,
        model: str,
        engine_kwargs: dict,
        group,
        bundles: list[int],
    ) -> None:
        import ray

        from tidal.adapters.client import HttpEngine

        self.remote = ray.remote(EngineServer)
        self.api_key = secrets.token_hex(16)  # a key of this run's own for its engines' HTTP servers
        self.cluster, self.options = cluster, engine
        self.model, self.engine_kwargs, self.group = model, engine_kwargs, group
        self.bundles = list(bundles)
        self.loop = LoopThread()  # every call to the engines' HTTP servers runs on it
        self.timeout = cluster.sync_timeout
        self.actors = [self._start(b) for b in self.bundles]
        try:
            self.urls = self._wait_started(self.actors, list(range(len(self.actors))))
        except BaseException:
            self.close()  # nothing else holds them yet
            raise
        self.engine = HttpEngine(self.urls, timeout=engine.request_timeout, api_key=self.api_key)
        self.timeout = cluster.sync_timeout
        self.restarts = 0  # engines restarted (or dropped) so far

    def _start(self, bundle: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tidal.cluster.ray_setup import actor_gpus

        c = self.cluster
        # colocated: the bundle is the trainer rank's; the engine takes turns with it
        return self.remote.options(
            num_cpus=0 if c.colocate else c.cpus_per_engine,
            num_gpus=actor_gpus(c)[1],
            max_concurrency=4,  # HTTP thread + weight receive + control calls
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle),
        ).remote(
            self.model, self.engine_kwargs, int(max(1, c.cpus_per_engine)), self.api_key, self.options.kind, c.device
        )

    def _wait_started(self, actors: list, which: list[int]) -> list[str]:
        """The URLs of just-started actors once each answers /health: the start-up grace period,
        `cluster.engine_startup_timeout` seconds for loading the model and starting the server."""
        import httpx
        import ray

        limit = self.cluster.engine_startup_timeout
        deadline = time.monotonic() + limit
        names = ", ".join(f"engine {i}" for i in which)
        try:
            urls = ray.get([a.address.remote() for a in actors], timeout=limit)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"engines: {names} did not start within {limit:g} s (cluster.engine_startup_timeout)"
            ) from None
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"engines: {names} died while starting: {e}") from None
        headers = {"Authorization": f"Bearer {self.api_key}"}
        for i, url in zip(which, urls, strict=True):
            while True:
                try:
                    httpx.get(url + "/health", headers=headers, timeout=5).raise_for_status()
                    break
                except httpx.HTTPError as e:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"engines: engine {i} at {url} did not answer /health within {limit:g} s "
                            f"(cluster.engine_startup_timeout): {e}"
                        ) from None
                    time.sleep(0.5)
        return urls

    def recover(self) -> bool:
        """Restart or drop (`cluster.engine_failure`) the engines that failed: those the router took
        out of service (they failed a request: no connection, no answer within
        `engine.request_timeout`, a 5xx) and those that fail /health now (within the client's
        control timeout), such as one that died after its last request of the rollout.
        Returns True when engines changed: the weight sync must then re-form its group and push the
        current weights before they serve (a restarted engine holds the initial ones). Raises
        RuntimeError when no engine would be left. An engine that dies during the weight push
        itself is not recovered: the push fails naming it (`tidal.sync.broadcast`)."""
        import ray

        from tidal.adapters.client import EngineClient, Router

        router = self.engine.router
        # the router sees only the failures of requests: an engine that died (or stopped answering)
        # after the rollout's last request would otherwise first be found by the push, ending the run
        limit = max(c.control_timeout for c in router.clients) + 30
        failing = self.loop.run(router.check_health(), limit, "engines: the health check before a weight push")
        for i, error in failing.items():
            router.mark_down(i, RuntimeError(error))
        failed = dict(router.down)
        if not failed:
            return False
        drop = self.cluster.engine_failure == "drop"
        for i, error in sorted(failed.items()):
            action = "dropping it" if drop else "restarting it"
            log.warning("engine %d (%s) failed: %s; %s", i, self.urls[i], error, action)
            ray.kill(self.actors[i], no_restart=True)
        self.restarts += len(failed)
        if drop:
            keep = [i for i in range(len(self.actors)) if i not in failed]
            if not keep:
                raise RuntimeError(f"engines: every engine failed ({'; '.join(failed.values())}); none is left")
            self.actors = [self.actors[i] for i in keep]
            self.urls = [self.urls[i] for i in keep]
            self.bundles = [self.bundles[i] for i in keep]
            self.engine.router = self.engine.control = Router([router.clients[i] for i in keep])
            self.engine.router.resent = router.resent
            return True
        which = sorted(failed)
        actors = [self._start(self.bundles[i]) for i in which]
        try:
            urls = self._wait_started(actors, which)
        except BaseException:
            for a in actors:
                ray.kill(a)
            raise
        for i, actor, url in zip(which, actors, urls, strict=True):
            self.actors[i], self.urls[i] = actor, url
            router.replace(i, EngineClient(url, self.options.request_timeout, api_key=self.api_key))
            log.info("engine %d restarted at %s", i, url)
        return True

    def live_urls(self) -> list[str]:
        """The URLs of the engines in service."""
        return [self.urls[i] for i in self.engine.router.live]

    def down(self) -> dict[str, str]:
        """The engines out of service, by URL, with why (`recover` restarts or drops them)."""
        return {self.urls[i]: why for i, why in self.engine.router.down.items()}

    def confirmed(self, version: int) -> dict[str, float]:
        """Every engine holds `version`: the rollout's engine reports it from now on; the failure
        counts so far (engines restarted or dropped, requests sent again to another engine)."""
        self.engine.note_version(version)
        return {"engines/restarts": float(self.restarts), "engines/resent_requests": float(self.engine.router.resent)}

    def _run(self, coro, what: str):
        return self.loop.run(coro, self.timeout, f"engines: {what}")

    def stats(self) -> dict:
        return self._run(self.engine.get_stats(), "stats")

    def health(self) -> bool:
        return self._run(self.engine.health(), "health")

    def pause(self) -> None:
        self._run(self.engine.pause(), "pause")

    def resume(self) -> None:
        self._run(self.engine.resume(), "resume")

    def sleep(self) -> None:
        """Every engine in service frees its KV cache and weights (an engine that failed during the
        rollout is left alone until `recover` replaces it; one that fails this call is taken out
        of service for `recover` to replace)."""
        self._run(self._each_live("release_memory"), "sleep")

    def wake(self) -> None:
        """Every engine in service takes its memory back (one that fails is taken out of service:
        the weight push that follows restarts or drops it)."""
        self._run(self._each_live("resume_memory"), "wake")

    async def _each_live(self, method: str) -> None:
        """Call `method` on every engine in service; an engine that fails it as an engine fails (no
        connection, no answer, a 5xx: it died while the trainers trained) is marked down, so the
        next push's `recover` deals with it instead of the call ending the run."""
        import asyncio

        from tidal.adapters.client import EngineError, is_engine_failure

        router = self.engine.router
        live = router.live
        results = await asyncio.gather(*(getattr(router.clients[i], method)() for i in live), return_exceptions=True)
        for i, result in zip(live, results, strict=True):
            if isinstance(result, EngineError) and is_engine_failure(result):
                router.mark_down(i, result)
            elif isinstance(result, BaseException):
                raise result

    def close(self) -> None:
        """Kill the actors (a rank or engine stuck in a broken collective would not answer a
        polite call); their processes free every resource they held."""
        import ray

        if hasattr(self, "engine"):  # not when the engines failed to start
            try:
                self._run(self.engine.aclose(), "close")
            except Exception as e:  # the actors go anyway
                log.warning("engines: closing the HTTP clients: %s", e)
        self.loop.close()
        for a in self.actors:
            ray.kill(a)
