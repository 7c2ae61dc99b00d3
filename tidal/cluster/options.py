"""The `cluster` option group: trainer ranks, engines, devices, colocation, the Ray cluster and the
weight-sync transport (`tidal.roles`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidal.backends import DEVICES, IN_PROCESS, RAY, TRANSPORTS, EngineKind
from tidal.options import Need, one_of, opt


@dataclass
class ClusterConfig:
    ray: bool | str = opt(
        "auto",
        "auto | true | false: whether the run uses Ray (tidal starts it on this machine, or joins cluster.address). "
        "auto: when cluster.trainers > 1, cluster.engines > 1 (of a kind that runs Ray actors) or cluster.address is "
        "set; true: also for 1 trainer + 1 engine, to rehearse a cluster layout on one machine; false: never (one "
        "trainer and one engine in this process)",
    )
    trainers: int = opt(1, "trainer ranks: more than 1 trains with FSDP2 over torch.distributed (gloo/NCCL) on Ray")
    tp_size: int = opt(
        1,
        "tensor parallel: trainer ranks that split each decoder layer's attention and MLP between them "
        "(an MoE layer's experts: whole experts per rank); cluster.trainers / tp_size groups of them shard with FSDP2",
    )
    cp_size: int = opt(
        1,
        "context parallel: trainer ranks that split each packed micro-batch's tokens between them (attention exact "
        "across the split); with cluster.tp_size, cluster.trainers / (cp_size x tp_size) groups of cp_size x "
        "tp_size ranks take their shares of a batch",
    )
    engines: int = opt(1, "rollout engines: more than 1 run as Ray actors behind the router")
    colocate: bool = opt(
        False, "engines share the trainers' resources and free their KV cache and weights while the trainers train"
    )
    cpus_per_trainer: float = opt(1.0, "CPUs reserved (and torch threads) per trainer rank on Ray")
    device: str = opt(
        "auto",
        "auto | cpu | cuda: where the trainers and tidal's engine compute (auto: cuda where torch sees a GPU, else "
        "cpu; on Ray each rank and engine resolves it on its own node); process groups follow it (NCCL / gloo)",
    )
    gpus_per_trainer: float = opt(0.0, "GPUs per trainer rank on Ray (0 = CPU, gloo)")
    cpus_per_engine: float = opt(1.0, "CPUs reserved (and torch threads) per engine on Ray")
    gpus_per_engine: float = opt(
        0.0, "GPUs per engine on Ray; sglang: CUDA devices per launched server (its tensor-parallel size)"
    )
    address: str | None = opt(
        None, "Ray cluster to join (else RAY_ADDRESS; else Ray starts on this machine when it is needed)"
    )
    weight_sync: str = opt(
        "auto",
        "auto | " + " | ".join(f"{t.name} ({t.summary})" for t in TRANSPORTS.values()) + "; auto: the first that "
        "engine.kind takes and that reaches its engines (in-process for one engine here, broadcast for Ray engine "
        "actors, http for remote servers, distributed for SGLang)",
    )
    sync_timeout: float = opt(300.0, "seconds a weight sync may take before the run stops naming the engine")
    sync_base_timeout: float = opt(
        30.0,
        "http, delta and disk weight syncs: seconds one weight request may take besides moving its bytes "
        "(each is bounded by this + its bytes / sync_min_mb_per_s, at most sync_timeout)",
    )
    sync_min_mb_per_s: float = opt(
        10.0,
        "http, delta and disk weight syncs: the slowest transfer (MB/s, 10^6 bytes) a weight request is given "
        "time for; a stopped or stalled engine is found after one request's bound",
    )
    sync_dir: str | None = opt(None, "disk weight sync: a folder every engine can read (default: output_dir/weights)")
    engine_startup_timeout: float = opt(
        600.0, "seconds a Ray engine or a launched SGLang server may take to load and answer /health"
    )
    engine_failure: str = opt(
        "restart",
        "a Ray engine that dies or stops answering: restart (in its place, with the current weights) | drop",
    )

    def uses_ray(self, kind: EngineKind) -> bool:
        """Whether the run starts (or joins) Ray with engines of `kind`: as `ray` says when it is
        true or false; with `auto`, for trainer ranks, for engine actors (a kind that runs them,
        several of it), or because `address` names a cluster. Servers (remote, SGLang) are
        processes of their own, not Ray actors."""
        if isinstance(self.ray, bool):
            return self.ray
        return self.trainers > 1 or (self.engines > 1 and kind.ray_actors) or bool(self.address)

    def moves(self, kind: EngineKind) -> dict[str, dict[str, Any]]:
        """The option settings that would put this run's engines of `kind` at each placement they
        can reach by changing the cluster alone (`tidal.backends.resolve_sync` names them as the
        fix for a transport that does not reach where the engines are). Servers stay servers."""
        if kind.servers:
            return {}
        here: dict[str, Any] = {}  # one engine in this process, beside one trainer
        if self.ray is True:
            here["cluster.ray"] = False
        if self.trainers > 1:
            here["cluster.trainers"] = 1
        if self.engines > 1:
            here["cluster.engines"] = 1
        if self.address:
            here["cluster.address"] = None
        out = {IN_PROCESS: here}
        if kind.ray_actors:
            out[RAY] = {"cluster.ray": True}
        return out

    def check(self, need: Need) -> None:
        need(
            isinstance(self.ray, bool) or self.ray == "auto",
            f"cluster.ray: one of auto, true, false, got {self.ray!r}",
        )
        off = self.ray is False
        need(
            not (off and self.trainers > 1),
            f"cluster.ray: false trains in this process, and cluster.trainers {self.trainers} run as ranks on Ray; "
            "set cluster.ray auto (or true), or cluster.trainers 1",
        )
        need(
            not (off and self.address),
            f"cluster.ray: false runs without Ray, and cluster.address {self.address!r} names a Ray cluster to join; "
            "set cluster.ray auto (or true), or leave cluster.address unset",
        )
        one_of(need, "cluster.device", self.device, DEVICES)
        need(self.trainers >= 1, f"cluster.trainers: must be >= 1, got {self.trainers}")
        need(
            self.tp_size >= 1 and self.trainers % self.tp_size == 0,
            f"cluster.tp_size: must divide cluster.trainers ({self.trainers}), got {self.tp_size}",
        )
        need(
            self.cp_size >= 1 and self.trainers % (self.cp_size * max(self.tp_size, 1)) == 0,
            f"cluster.cp_size: cp_size x tp_size ({self.cp_size} x {self.tp_size}) must divide cluster.trainers "
            f"({self.trainers})",
        )
        need(self.engines >= 1, f"cluster.engines: must be >= 1, got {self.engines}")
        for name in ("cpus_per_trainer", "gpus_per_trainer", "cpus_per_engine", "gpus_per_engine"):
            need(getattr(self, name) >= 0, f"cluster.{name}: must be >= 0, got {getattr(self, name)}")
        need(self.sync_timeout > 0, f"cluster.sync_timeout: must be > 0 seconds, got {self.sync_timeout}")
        need(
            self.sync_base_timeout > 0, f"cluster.sync_base_timeout: must be > 0 seconds, got {self.sync_base_timeout}"
        )
        need(self.sync_min_mb_per_s > 0, f"cluster.sync_min_mb_per_s: must be > 0 MB/s, got {self.sync_min_mb_per_s}")
        need(
            self.engine_startup_timeout > 0,
            f"cluster.engine_startup_timeout: must be > 0 seconds, got {self.engine_startup_timeout}",
        )
        one_of(need, "cluster.engine_failure", self.engine_failure, ("restart", "drop"))
        one_of(need, "cluster.weight_sync", self.weight_sync, ("auto", *TRANSPORTS))
