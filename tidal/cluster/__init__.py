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

from tidal.aio import LoopThread
from tidal.config import RAY_ENGINES, Config
from tidal.contracts import Engine, Engines, Trainer, WeightSync
from tidal.hardware import resolve_device

log = logging.getLogger("tidal")


class LocalEngines:
    """The rollout role's engine in this process: an in-process engine (`AsyncEngine` over tidal's,
    vLLM's or transformers' core) or external HTTP servers (`HttpEngine`: `rollout.engine`
    remote or sglang). `EngineGroup` (Ray) has the same methods."""

    def __init__(
        self,
        engine: Engine,
        loop: LoopThread | None = None,
        on_close: Callable[[], None] | None = None,
        restart: Callable[[str], bool] | None = None,
        launched=None,
    ):
        self.engine = engine
        self.launched = launched  # the processes tidal started for it (SGLang servers), if any
        self.loop = loop if loop is not None else LoopThread()
        self.urls: list[str] = list(getattr(engine, "urls", []))
        self.api_key = getattr(engine, "api_key", None)
        self._on_close = on_close
        self._restart = restart  # servers tidal launched (SGLang) are started again in place
        self.restarts = 0
        self.timeout = 60.0  # control calls (pause, abort, health) on a live engine answer in seconds

    def _run(self, coro, what: str):
        return self.loop.run(coro, self.timeout, f"engine {what}")

    def health(self) -> bool:
        check = getattr(self.engine, "health", None)
        return self._run(check(), "health") if check is not None else True

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
        router = getattr(self.engine, "control", None)
        if router is None:
            return False
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
        router = getattr(self.engine, "control", None)
        return [router.clients[i].base_url for i in router.live] if router is not None else self.urls

    def sleep(self) -> None:
        pass  # an in-process engine already shares the trainer's weights; external ones are not ours

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


def _sync_kind(cfg: Config) -> str:
    kind = cfg.cluster.weight_sync
    if kind != "auto":
        return kind
    if cfg.rollout.engine == "remote":
        return "http"
    if cfg.rollout.engine == "sglang":
        return "distributed"
    return "broadcast" if cfg.uses_ray else "in-process"


def build_roles(cfg: Config, model_dir: Path, tokenizer, checkpoint: Path | None, sft: bool = False) -> Roles:
    """Trainer (and critic), engines and weight sync for `cfg`; the trainer starts from
    `checkpoint` when given (its optimizer state is loaded by the caller). Replaying saved
    rollouts (`debug.load_rollout`) starts no engine."""
    from tidal.train.critic import Critic

    c, r, t, a = cfg.cluster, cfg.rollout, cfg.train, cfg.algo
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    max_len = cfg.data.max_length if sft else r.max_new_tokens
    start_from = checkpoint or model_dir
    roles = Roles(trainer=None, critic=None, engines=None, sync=None, colocate=c.colocate)
    placed = None  # (placement group, engine bundles) on Ray
    try:
        device = resolve_device(c.device).device  # this process's (Ray workers resolve their own)
        critic = Critic(model_dir, t, a, pad_id, device) if a.advantage == "ppo" and not sft else None
        roles.critic = critic
        if not cfg.uses_ray:
            from tidal.train.actor import Actor

            roles.trainer = Actor(
                start_from, t, a, r.temperature, pad_id, reference=model_dir, max_response_len=max_len, device=device
            )
        else:
            from tidal.cluster.ray_setup import placement, start_ray
            from tidal.cluster.trainers import TrainerGroup

            if start_ray(c):
                import ray

                roles.closers.append(ray.shutdown)
            group, trainer_bundles, engine_bundles = placement(c)
            roles.closers.append(lambda: _remove_group(group))
            placed = (group, engine_bundles)
            roles.trainer = TrainerGroup(
                c, t, a, start_from, model_dir, r.temperature, pad_id, max_len, group, trainer_bundles
            )
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


def build_engines(cfg: Config, model_dir: Path, tokenizer, placed=None) -> Engines:
    """The rollout role `rollout.engine` names: SGLang servers (launched or attached), remote
    servers, engine actors on Ray (`placed`: the placement group and the engines' bundles), or
    one engine in this process."""
    from tidal.adapters.client import HttpEngine
    from tidal.adapters.factory import engine_options, make_engine

    r, c = cfg.rollout, cfg.cluster
    if r.engine == "sglang":
        from tidal.adapters.sglang_launch import start_sglang

        servers = start_sglang(r, c, model_dir, Path(cfg.train.output_dir) / "logs")
        try:
            # generation through the router when there is one; control and weights to each server
            engine = HttpEngine(
                servers.generation_urls, r.request_timeout, api_key=r.api_key, control_urls=servers.worker_urls
            )
        except BaseException:
            servers.close()
            raise
        restart = servers.restart if c.engine_failure == "restart" else None
        return LocalEngines(engine, on_close=servers.close, restart=restart, launched=servers)
    if placed is not None and r.engine in RAY_ENGINES and r.engine != "remote":
        from tidal.cluster.engines import EngineGroup

        group, bundles = placed
        return EngineGroup(c, r, str(model_dir), engine_options(r, cfg.data.max_prompt_length), group, bundles)
    device = resolve_device(c.device).device
    return LocalEngines(make_engine(r, model_dir, tokenizer, cfg.data.max_prompt_length, device=device))


def build_sync(cfg: Config, trainer: Trainer, engines: Engines) -> WeightSync:
    """The weight transport `cluster.weight_sync` names (see `_sync_kind` for `auto`)."""
    kind, timeout = _sync_kind(cfg), cfg.cluster.sync_timeout
    log.info("weight sync: %s (timeout %g s)", kind, timeout)
    if kind == "in-process":
        from tidal.sync.local import InProcessSync

        # the overlapped loop generates while the trainer updates: the engine needs its own copy
        share = cfg.overlap.mode == "off"
        if cfg.train.lora_rank > 0 and not cfg.train.lora_merge:  # the engine runs the trainer's LoRA layers
            from tidal.train.lora import mirror

            def adopt(core) -> None:
                mirror(core.model, trainer.model)

            return InProcessSync(trainer, engines.engine, timeout, share=share, merged=False, adopt=adopt)
        return InProcessSync(trainer, engines.engine, timeout, share=share)
    if kind == "broadcast":
        from tidal.sync.broadcast import BroadcastSync

        if not hasattr(engines, "actors"):
            raise ValueError("cluster.weight_sync broadcast: needs engines on Ray (rollout.engine tidal or vllm)")
        # colocated engines sleep while the trainers train and wake with no weights: every push is whole
        return BroadcastSync(trainer, engines, timeout, partial=not cfg.cluster.colocate)
    from tidal.adapters.client import EngineClient
    from tidal.sync.base import PushBound
    from tidal.sync.remote import DiskSync, HttpSync

    c = cfg.cluster
    clients = [EngineClient(u, timeout, api_key=getattr(engines, "api_key", None)) for u in engines.urls]
    # each weight request: base seconds + its bytes at the slowest throughput allowed, at most the timeout
    bound = PushBound(c.sync_base_timeout, c.sync_min_mb_per_s, timeout)
    kw = {"engines": engines, "loop": engines.loop, "bound": bound}
    if kind == "disk":
        root = c.sync_dir or str(Path(cfg.train.output_dir) / "weights")
        return DiskSync(trainer, clients, root, timeout, **kw)
    if kind == "distributed":
        from tidal.sync.distributed import DistributedSync

        return DistributedSync(trainer, clients, timeout, **kw)
    return HttpSync(trainer, clients, timeout, delta=kind == "delta", **kw)


def _remove_group(group) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)
