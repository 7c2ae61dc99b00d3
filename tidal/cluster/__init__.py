"""The roles the loop drives, built from the config: in this process (one trainer, one engine: the
laptop default, no Ray), or on Ray (trainer ranks with FSDP2, engine actors, colocated or not).

    roles = build_roles(cfg, model_dir, tokenizer, checkpoint)
    roles.trainer.train_step(...); roles.engines.engine.generate(...); roles.sync.push(version)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.config import Config

log = logging.getLogger("tidal")


class LocalEngines:
    """The rollout role's engines: one engine in this process, or external servers
    (`rollout.engine: remote`). `EngineGroup` (Ray) has the same methods."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.urls = [c.base_url for c in engine.router.clients] if hasattr(engine, "router") else []
        self.api_key = engine.router.clients[0].api_key if self.urls else None

    def health(self) -> bool:
        return self.engine.health() if hasattr(self.engine, "health") else True

    def pause(self) -> None:
        if hasattr(self.engine, "pause"):
            self.engine.pause()

    def resume(self) -> None:
        if hasattr(self.engine, "resume"):
            self.engine.resume()

    def recover(self) -> bool:
        """Remote servers are not ours to restart: one the router took out of service is put back
        when it answers /health again (the weight push that follows gives it the current weights).
        True when one came back."""
        router = getattr(self.engine, "router", None)
        if router is None or not router.down:
            return False
        failing = self.engine.check_health()
        back = [i for i in list(router.down) if i not in failing]
        for i in back:
            log.info("engine %s answers again: back in service after this weight push", router.clients[i].base_url)
            router.mark_up(i)
        return bool(back)

    def live_urls(self) -> list[str]:
        """The URLs of the servers in service."""
        router = getattr(self.engine, "router", None)
        return [router.clients[i].base_url for i in router.live] if router is not None else self.urls

    def sleep(self) -> None:
        pass  # an in-process engine already shares the trainer's weights; external ones are not ours

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Roles:
    trainer: Any  # tidal.train.role.Trainer
    critic: Any | None
    engines: Any  # .engine (tidal.engine.base.Engine), .sleep(), .wake(), .close()
    sync: Any  # tidal.sync.base.WeightSync
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
    return "broadcast" if cfg.cluster.uses_ray else "in-process"


def build_roles(cfg: Config, model_dir: Path, tokenizer, checkpoint: Path | None, sft: bool = False) -> Roles:
    """Trainer (and critic), engines and weight sync for `cfg`; the trainer starts from
    `checkpoint` when given (its optimizer state is loaded by the caller). Replaying saved
    rollouts (`debug.load_rollout`) starts no engine."""
    from tidal.engine.factory import engine_options, make_engine
    from tidal.train.critic import Critic

    c, r, t, a = cfg.cluster, cfg.rollout, cfg.train, cfg.algo
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    max_len = cfg.data.max_length if sft else r.max_new_tokens
    start_from = checkpoint or model_dir
    roles = Roles(trainer=None, critic=None, engines=None, sync=None, colocate=c.colocate)
    try:
        critic = Critic(model_dir, t, a, pad_id) if a.advantage == "ppo" and not sft else None
        roles.critic = critic
        if not c.uses_ray:
            from tidal.train.actor import Actor

            roles.trainer = Actor(
                start_from, t, a, r.temperature, pad_id, reference=model_dir, max_response_len=max_len
            )
            if not sft and not cfg.debug.load_rollout:
                roles.engines = LocalEngines(make_engine(r, model_dir, tokenizer, cfg.data.max_prompt_length))
        else:
            from tidal.cluster.engines import EngineGroup
            from tidal.cluster.ray_setup import placement, start_ray
            from tidal.cluster.trainers import TrainerGroup

            if start_ray(c):
                import ray

                roles.closers.append(ray.shutdown)
            group, trainer_bundles, engine_bundles = placement(c)
            roles.closers.append(lambda: _remove_group(group))
            roles.trainer = TrainerGroup(
                c, t, a, start_from, model_dir, r.temperature, pad_id, max_len, group, trainer_bundles
            )
            roles.closers.append(roles.trainer.close)
            if not sft and not cfg.debug.load_rollout:
                if r.engine == "remote":
                    roles.engines = LocalEngines(make_engine(r, model_dir, tokenizer, cfg.data.max_prompt_length))
                else:
                    opts = engine_options(r, cfg.data.max_prompt_length)
                    roles.engines = EngineGroup(c, r, str(model_dir), opts, group, engine_bundles)
                    roles.closers.append(roles.engines.close)
        if not sft and cfg.debug.load_rollout:
            from tidal.debug_rollout import NoEngines, NoSync

            roles.engines, roles.sync = NoEngines(), NoSync()
        elif not sft:
            roles.sync = build_sync(cfg, roles.trainer, roles.engines)
            roles.closers.append(roles.sync.close)
        return roles
    except BaseException:
        roles.close()
        raise


def build_sync(cfg: Config, trainer, engines):
    """The weight transport `cluster.weight_sync` names (see `_sync_kind` for `auto`)."""
    kind, timeout = _sync_kind(cfg), cfg.cluster.sync_timeout
    log.info("weight sync: %s (timeout %g s)", kind, timeout)
    if kind == "in-process":
        from tidal.sync.local import InProcessSync

        # the overlapped loop generates while the trainer updates: the engine needs its own copy
        return InProcessSync(trainer, engines.engine, share=cfg.overlap.mode == "off")
    if kind == "broadcast":
        from tidal.sync.broadcast import BroadcastSync

        if not hasattr(engines, "actors"):
            raise ValueError("cluster.weight_sync broadcast: needs engines on Ray (rollout.engine tidal)")
        return BroadcastSync(trainer, engines, timeout)
    from tidal.engine.client import EngineClient
    from tidal.sync.remote import DiskSync, HttpSync

    clients = [EngineClient(u, timeout, api_key=getattr(engines, "api_key", None)) for u in engines.urls]
    if kind == "disk":
        root = cfg.cluster.sync_dir or str(Path(cfg.train.output_dir) / "weights")
        return DiskSync(trainer, clients, root, timeout, engines=engines)
    return HttpSync(trainer, clients, timeout, delta=kind == "delta", engines=engines)


def _remove_group(group) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)
