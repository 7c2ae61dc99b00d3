"""Starting or joining Ray, and the placement group the trainer ranks and engines go into.

Disaggregated: one bundle per trainer rank and one per engine. Colocated: one bundle per trainer
rank; engine i shares bundle i with trainer rank i (its own reservation is 0), so the two take
turns with the bundle's memory (the engine sleeps while the trainers train).
"""

from __future__ import annotations

import logging
import os
import tempfile

from tidal.cluster.options import ClusterConfig

log = logging.getLogger("tidal")


def start_ray(cfg: ClusterConfig) -> bool:
    """Join `cluster.address` (or RAY_ADDRESS), else start Ray on this machine with enough
    logical CPUs for every bundle (a 2-core laptop runs 2 trainers + 2 engines, time-sliced).
    Returns whether this call started or joined Ray (then the run shuts it down at the end)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, private Ray needs no token
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("cluster: joining Ray at %s", address)
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
        return True
    need = cfg.trainers * cfg.cpus_per_trainer + (0 if cfg.colocate else cfg.engines * cfg.cpus_per_engine)
    cpus = max(os.cpu_count() or 1, int(need + 0.999))
    log.info("cluster: starting Ray on this machine (%d logical CPUs)", cpus)
    ray.init(
        num_cpus=cpus,
        include_dashboard=False,
        log_to_driver=True,
        _temp_dir=os.path.join(tempfile.gettempdir(), f"tidal-ray-{os.getuid()}"),
    )
    return True


def actor_gpus(cfg: ClusterConfig) -> tuple[float, float]:
    """GPUs a trainer rank and an engine actor ask Ray for. Colocated, they share their bundle's
    GPUs half and half: Ray shows an actor only the GPUs it asked for (none when it asked for 0), so
    both must ask for a share to see the same device."""
    if not cfg.colocate:
        return cfg.gpus_per_trainer, cfg.gpus_per_engine
    share = max(cfg.gpus_per_trainer, cfg.gpus_per_engine) / 2
    return share, share


def placement(cfg: ClusterConfig, engine_actors: int | None = None):
    """A placement group for the run, ready; returns (group, trainer bundle indices, engine bundle
    indices). `engine_actors` (default `cfg.engines`) is how many engines run as Ray actors: 0 when
    they are servers or live in the driver, which then reserves no bundle for them. Raises
    TimeoutError naming the resources when Ray cannot place it in 120 s."""
    import ray
    from ray.util.placement_group import placement_group

    n_engines = cfg.engines if engine_actors is None else engine_actors
    trainer = {"CPU": cfg.cpus_per_trainer, **({"GPU": cfg.gpus_per_trainer} if cfg.gpus_per_trainer else {})}
    engine = {"CPU": cfg.cpus_per_engine, **({"GPU": cfg.gpus_per_engine} if cfg.gpus_per_engine else {})}
    if cfg.colocate and n_engines:
        merged = {k: max(trainer.get(k, 0), engine.get(k, 0)) for k in set(trainer) | set(engine)}
        bundles = [merged] * cfg.trainers
        engines = [i % cfg.trainers for i in range(n_engines)]
    else:
        bundles = [trainer] * cfg.trainers + [engine] * n_engines
        engines = list(range(cfg.trainers, cfg.trainers + n_engines))
    group = placement_group(bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=120)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"cluster: Ray could not place {len(bundles)} bundles {bundles} within 120 s; "
            f"available: {ray.available_resources()}"
        ) from None
    return group, list(range(cfg.trainers)), engines
