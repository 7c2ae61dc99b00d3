"""Rollout engines on Ray: each actor runs tidal's engine behind its HTTP server (the same server
as `tidal serve`), and the loop reaches them through the router like any remote server.

Besides HTTP, an engine actor can join a process group with trainer rank 0 and receive weights by
broadcast (`tidal.sync.broadcast`), and sleep (free its KV cache and weights) while colocated
trainers train.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets

import torch

from tidal.config import ClusterConfig, RolloutConfig

log = logging.getLogger("tidal")


class EngineServer:
    """One engine (a Ray actor): `LLMEngine` on its thread, the HTTP app on a port of this node."""

    def __init__(self, model: str, engine_kwargs: dict, threads: int, api_key: str) -> None:
        from transformers import AutoTokenizer

        from tidal.cluster.ray_setup import node_ip
        from tidal.config import ServerConfig
        from tidal.engine.async_engine import AsyncEngine
        from tidal.engine.llm_engine import LLMEngine
        from tidal.server import BackgroundServer, build_app

        torch.set_num_threads(max(1, threads))
        tokenizer = AutoTokenizer.from_pretrained(model)
        self.core = LLMEngine(model, tokenizer, **engine_kwargs)
        self.engine = AsyncEngine(self.core)
        host = node_ip()
        # reachable from the network: only the run that started it knows the key
        app = build_app(self.engine, model, ServerConfig(api_key=api_key))
        self.server = BackgroundServer(app, host=host, port=0).start()
        self.url = f"http://{host}:{self.server.port}"
        self.weight_group = None

    def address(self) -> str:
        return self.url

    def pid(self) -> int:
        return os.getpid()

    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    def join_weight_group(self, init_method: str, rank: int, world: int, timeout_s: float) -> bool:
        from tidal.sync.broadcast import join_group

        self.weight_group = join_group(init_method, rank, world, timeout_s)
        return True

    def receive_weights(self, meta: list[tuple[str, tuple[int, ...]]], version: int, bucket_bytes: int) -> tuple:
        """Receive one broadcast of the weights into new tensors, then load them all at once between
        two engine steps; returns (version, checksum) as the engine reports them."""
        from tidal.sync.broadcast import receive_weights

        named = receive_weights(self.weight_group, meta, self.engine.dtype, bucket_bytes)

        async def load() -> tuple[int, str]:
            await self.engine.update_weights_from_tensors(named, version)
            return self.engine.weight_version, await self.engine.weights_checksum()

        return asyncio.run(load())

    def sleep(self) -> None:
        asyncio.run(self.engine.sleep())

    def wake(self) -> None:
        asyncio.run(self.engine.wake())

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


class EngineGroup:
    """`cluster.engines` engine actors in the run's placement group, and the `RemoteEngine`
    (router) the rollout calls."""

    def __init__(
        self,
        cluster: ClusterConfig,
        rollout: RolloutConfig,
        model: str,
        engine_kwargs: dict,
        group,
        bundles: list[int],
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tidal.engine.client import RemoteEngine

        remote = ray.remote(EngineServer)
        self.api_key = secrets.token_hex(16)  # a key of this run's own for its engines' HTTP servers
        # colocated: the bundle is the trainer rank's; the engine takes turns with it
        cpus = 0 if cluster.colocate else cluster.cpus_per_engine
        gpus = 0 if cluster.colocate else cluster.gpus_per_engine
        self.actors = [
            remote.options(
                num_cpus=cpus,
                num_gpus=gpus,
                max_concurrency=4,  # HTTP thread + weight receive + sleep/wake calls
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=b),
            ).remote(model, engine_kwargs, int(max(1, cluster.cpus_per_engine)), self.api_key)
            for b in bundles
        ]
        try:
            self.urls = ray.get([a.address.remote() for a in self.actors], timeout=600)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError("engines: starting the engine actors took longer than 600 s") from None
        self.engine = RemoteEngine(self.urls, timeout=rollout.request_timeout, api_key=self.api_key)
        self.timeout = cluster.sync_timeout

    def health(self) -> bool:
        return self.engine.health()

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def sleep(self) -> None:
        import ray

        ray.get([a.sleep.remote() for a in self.actors], timeout=self.timeout)

    def wake(self) -> None:
        import ray

        ray.get([a.wake.remote() for a in self.actors], timeout=self.timeout)

    def close(self) -> None:
        """Kill the actors (a rank or engine stuck in a broken collective would not answer a
        polite call); their processes free every resource they held."""
        import ray

        for a in self.actors:
            ray.kill(a)
