"""The roles the loop drives, built from the config: in this process (one trainer, one engine: the
laptop default, no Ray), or on Ray (trainer ranks with FSDP2, engine actors, colocated or not).
Their contracts are in `tidal.contracts`.

    roles = build_roles(cfg, model_dir, tokenizer, checkpoint)
    roles.trainer.train_step(...); RolloutManager(roles.engines.engine, ..., roles.engines.loop); roles.sync.push(v)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.aio import LoopThread
from tidal.backends import PLACEMENTS, RAY
from tidal.config import Config
from tidal.contracts import Engine, Engines, Trainer, WeightSync
from tidal.hardware import resolve_device
from tidal.utils import load_object

if TYPE_CHECKING:
    from tidal.adapters.client import HttpEngine

log = logging.getLogger("tidal")


class InProcessEngines:
    """The rollout role's engine in this process (`AsyncEngine` over tidal's, vLLM's or
    transformers' core): nothing to recover, no servers, the trainer's weights handed over."""

    urls: list[str] = []
    api_key = None
    restarts = 0

    def __init__(self, engine: Engine, loop: LoopThread | None = None) -> None:
        self.engine = engine
        self.loop = loop if loop is not None else LoopThread()
        self.timeout = 60.0  # control calls (pause, abort) on a live engine answer in seconds

    def health(self) -> bool:
        return True  # it runs on a thread of this process: a failure there fails the call itself

    def pause(self) -> None:
        self.loop.run(self.engine.pause(), self.timeout, "engine pause")

    def resume(self) -> None:
        self.loop.run(self.engine.resume(), self.timeout, "engine resume")

    def recover(self) -> bool:
        return False

    def live_urls(self) -> list[str]:
        return []

    def down(self) -> dict[str, str]:
        return {}

    def confirmed(self, version: int) -> dict[str, float]:
        return {}  # the engine reports the version it loaded itself

    def stats(self) -> dict:
        return self.loop.run(self.engine.get_stats(), self.timeout, "engine stats")

    def sleep(self) -> None:
        pass  # it shares the trainer's weights already

    def wake(self) -> None:
        pass

    def close(self) -> None:
        try:
            self.loop.run(self.engine.aclose(), self.timeout, "engine close")
        finally:
            self.loop.close()


class ServerEngines:
    """The rollout role over HTTP servers that are not Ray actors (`HttpEngine`): servers the user
    runs (`engine.urls`) or that tidal launched (`engine.kind` with a launcher: SGLang). Failed
    servers are taken out of service by the router and put back by `recover`."""

    def __init__(
        self,
        engine: HttpEngine,
        loop: LoopThread | None = None,
        on_close: Callable[[], None] | None = None,
        restart: Callable[[str], bool] | None = None,
        launched=None,
    ):
        self.engine = engine
        self.launched = launched  # the processes tidal started for it (SGLang servers), if any
        self.loop = loop if loop is not None else LoopThread()
        self.urls: list[str] = list(engine.urls)
        self.api_key = engine.api_key
        self._on_close = on_close
        self._restart = restart  # servers tidal launched (SGLang) are started again in place
        self.restarts = 0
        self.timeout = 60.0  # control calls (pause, abort, health) on a live engine answer in seconds

    def _run(self, coro, what: str):
        return self.loop.run(coro, self.timeout, f"engine {what}")

    def health(self) -> bool:
        return self._run(self.engine.health(), "health")

    def pause(self) -> None:
        self._run(self.engine.pause(), "pause")

    def resume(self) -> None:
        self._run(self.engine.resume(), "resume")

    def recover(self) -> bool:
        """Before a weight push: ask every server for /health and take those that fail it out of
        service (a server can die after its last request of the rollout, which the router never
        saw); put the servers out of service back: one that answers /health again as it is, one
        that tidal launched (SGLang) started again in its place; servers that are not ours stay
        out until they answer. The weight push that follows gives them the current weights before
        they serve. True when one came back."""
        router = self.engine.control
        front = self.engine.router is not router  # (sglang-router): the servers' failures are not seen here
        failing = self._run(self.engine.check_health(), "health check")
        for i, error in failing.items():
            router.mark_down(i, RuntimeError(error))
        back = []
        for i in list(router.down):
            url = router.clients[i].base_url
            if i in failing and not (self._restart is not None and self._restart(url)):
                continue
            if i in failing:
                self.restarts += 1
            log.info("engine %s back in service after this weight push", url)
            router.mark_up(i)
            back.append(i)
        if back and front:
            for i in list(self.engine.router.down):
                self.engine.router.mark_up(i)
        return bool(back)

    def live_urls(self) -> list[str]:
        """The URLs of the servers in service."""
        router = self.engine.control
        return [router.clients[i].base_url for i in router.live]

    def down(self) -> dict[str, str]:
        router = self.engine.control
        return {router.clients[i].base_url: why for i, why in router.down.items()}

    def confirmed(self, version: int) -> dict[str, float]:
        """Every server holds `version`: the rollout's engine reports it from now on. Returns the
        failure counts so far (servers restarted, requests sent again to another server)."""
        self.engine.note_version(version)
        return {"engines/restarts": float(self.restarts), "engines/resent_requests": float(self.engine.router.resent)}

    def stats(self) -> dict:
        return self._run(self.engine.get_stats(), "stats")

    def sleep(self) -> None:
        pass  # servers that are not Ray actors keep their memory (cluster.colocate refuses them)

    def wake(self) -> None:
        pass

    def close(self) -> None:
        try:
            self._run(self.engine.aclose(), "close")
        finally:
            self.loop.close()
            if self._on_close is not None:
                self._on_close()


@dataclass
class Roles:
    """What the loop drives (`tidal.contracts`); `closers` run in reverse order at the end."""

    trainer: Trainer | None
    critic: Trainer | None
    engines: Engines | None
    sync: WeightSync | None
    colocate: bool = False
    closers: list = field(default_factory=list)

    def close(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception as e:  # closing must not hide the error that ended the run
                log.warning("shutting down: %s", e)


def build_roles(cfg: Config, model_dir: Path, tokenizer, checkpoint: Path | None, sft: bool = False) -> Roles:
    """Trainer (and critic), engines and weight sync for `cfg`; the trainer starts from
    `checkpoint` when given (its optimizer state is loaded by the caller). Replaying saved
    rollouts (`debug.load_rollout`) starts no engine."""
    from tidal.train.critic import Critic

    c, r, t, a = cfg.cluster, cfg.rollout, cfg.train, cfg.algo
    temperature = cfg.sampling.temperature
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    max_len = cfg.data.max_length if sft else r.max_new_tokens
    start_from = checkpoint or model_dir
    roles = Roles(trainer=None, critic=None, engines=None, sync=None, colocate=c.colocate)
    placed = None  # (placement group, engine bundles) on Ray
    try:
        device = resolve_device(c.device).device  # this process's (Ray workers resolve their own)
        ppo = a.advantage == "ppo" and not sft
        if not cfg.uses_ray:
            roles.critic = Critic(model_dir, t, a, pad_id, device) if ppo else None
            from tidal.train.actor import Actor

            roles.trainer = Actor(
                start_from, t, a, temperature, pad_id, reference=model_dir, max_response_len=max_len, device=device
            )
        else:
            from tidal.cluster.ray_setup import placement, start_ray
            from tidal.cluster.trainers import TrainerGroup

            if start_ray(c):
                import ray

                roles.closers.append(ray.shutdown)
            group, trainer_bundles, engine_bundles = placement(c, c.engines if engines_on_ray(cfg, sft) else 0)
            roles.closers.append(lambda: _remove_group(group))
            log.info("cluster: %s", ray_layout(cfg, sft))
            placed = (group, engine_bundles)
            roles.trainer = TrainerGroup(
                c, t, a, start_from, model_dir, temperature, pad_id, max_len, group, trainer_bundles, critic=ppo
            )
            roles.critic = roles.trainer.critic  # on the ranks, beside the actor
            roles.closers.append(roles.trainer.close)
        if sft:
            return roles
        if cfg.debug.load_rollout:
            from tidal.debug_rollout import NoEngines, NoSync

            roles.engines, roles.sync = NoEngines(), NoSync()
            roles.closers.append(roles.engines.close)
            return roles
        roles.engines = build_engines(cfg, model_dir, tokenizer, placed)
        roles.closers.append(roles.engines.close)
        roles.sync = build_sync(cfg, roles.trainer, roles.engines)
        roles.closers.append(roles.sync.close)
        return roles
    except BaseException:
        roles.close()
        raise


def engines_on_ray(cfg: Config, sft: bool = False) -> bool:
    """Whether this run's engines are Ray actors (with a bundle each): not for SFT or a replayed
    rollout (no engine), nor for servers or a kind that runs in this process."""
    return cfg.placement == RAY and not sft and not cfg.debug.load_rollout


def ray_layout(cfg: Config, sft: bool = False) -> str:
    """What a run on Ray places, in one line, as `tidal.cluster.ray_setup.placement` reserves it:
    `1 trainer rank and 1 engine actor on Ray (bundles: 1 × 1 CPU + 1 × 1 CPU)`; engines that are
    not Ray actors (servers, an in-process kind) are named after it."""
    c = cfg.cluster

    def count(n: int, what: str) -> str:
        return f"{n} {what}{'s' if n != 1 else ''}"

    def size(n: int, cpus: float, gpus: float) -> str:
        return f"{n} × {cpus:g} CPU" + (f" {gpus:g} GPU" if gpus else "")

    on_ray = engines_on_ray(cfg, sft)
    what = count(c.trainers, "trainer rank") + (" and " + count(c.engines, "engine actor") if on_ray else "")
    if c.colocate and on_ray:
        cpus, gpus = max(c.cpus_per_trainer, c.cpus_per_engine), max(c.gpus_per_trainer, c.gpus_per_engine)
        bundles = size(c.trainers, cpus, gpus) + ", engines sharing the ranks' bundles"
    else:
        bundles = size(c.trainers, c.cpus_per_trainer, c.gpus_per_trainer)
        if on_ray:  # engines that are servers or live in this process take no bundle
            bundles += " + " + size(c.engines, c.cpus_per_engine, c.gpus_per_engine)
    line = f"{what} on Ray (bundles: {bundles})"
    if not on_ray and not sft and not cfg.debug.load_rollout:
        line += f"; engines: {PLACEMENTS[cfg.placement]}"
    return line


def build_engines(cfg: Config, model_dir: Path, tokenizer, placed=None) -> Engines:
    """The rollout role `engine.kind` names (its `tidal.backends` record says how): servers the
    kind's launcher starts (or attaches to), servers at `engine.urls`, engine actors on Ray
    (`placed`: the placement group and the engines' bundles), or one engine in this process."""
    from tidal.adapters.client import HttpEngine
    from tidal.adapters.factory import core_options, make_engine

    e, c, kind = cfg.engine, cfg.cluster, cfg.engine_kind
    if kind.launcher:
        servers = load_object(kind.launcher)(e, c, model_dir, Path(cfg.train.output_dir) / "logs", cfg.sampling.seed)
        try:
            # generation through the router when there is one; control and weights to each server
            engine = HttpEngine(
                servers.generation_urls, e.request_timeout, api_key=e.api_key, control_urls=servers.worker_urls
            )
        except BaseException:
            servers.close()
            raise
        restart = servers.restart if c.engine_failure == "restart" else None
        return ServerEngines(engine, on_close=servers.close, restart=restart, launched=servers)
    if cfg.placement == RAY:
        from tidal.cluster.engines import EngineGroup

        group, bundles = placed
        options = core_options(e, cfg.kv_cache_tokens)
        return EngineGroup(c, e, str(model_dir), options, group, bundles)
    device = resolve_device(c.device).device
    engine = make_engine(e, model_dir, tokenizer, cfg.kv_cache_tokens, device)
    return ServerEngines(engine) if kind.servers else InProcessEngines(engine)


def build_sync(cfg: Config, trainer: Trainer, engines: Engines) -> WeightSync:
    """The weight transport `cluster.weight_sync` names (`auto`: `tidal.backends.resolve_sync`),
    built by its record's class from a `SyncSetup`."""
    from tidal.sync.base import PushBound, SyncSetup

    transport = cfg.weight_sync
    log.info("weight sync: %s (timeout %g s)", transport.name, cfg.cluster.sync_timeout)
    c = cfg.cluster
    setup = SyncSetup(
        transport,
        trainer,
        engines,
        c.sync_timeout,
        # each weight request: base seconds + its bytes at the slowest throughput allowed, at most the timeout
        PushBound(c.sync_base_timeout, c.sync_min_mb_per_s, c.sync_timeout),
        c.sync_dir or str(Path(cfg.train.output_dir) / "weights"),
        whole=c.colocate,  # colocated engines sleep while the trainers train and wake with no weights
        # the overlapped loop generates while the trainer updates: the engine needs its own copy
        share=cfg.overlap.mode == "off",
        lora_layers=cfg.train.lora_rank > 0 and not cfg.train.lora_merge,
    )
    return load_object(transport.impl).build(setup)


def _remove_group(group) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)
