"""What every weight transport shares: the error that ends a run, and the check after a transfer.

A push hands the trainer's weights to every engine as one version. Each transport is versioned
(the engine reports the version it holds), checked (the engine reports a CRC-32 of what it loaded,
compared with the trainer's CRC-32 of what it sent, cast to the engine's dtype) and all-or-nothing
(a failed load leaves the engine on its old weights and version), and every wait is bounded.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.backends import Transport
from tidal.contracts import Engines, Trainer, WeightSync

__all__ = ["PushBound", "SyncError", "SyncSetup", "WeightSync", "check_engine", "megabytes"]


class SyncError(RuntimeError):
    """A weight transfer failed or timed out; the message names the engine (its URL, and its index
    among the run's engines when known) and the transport."""

    def __init__(self, engine: str, transport: str, what: str, index: int | None = None) -> None:
        name = engine if index is None else f"{engine} (engine {index})"
        super().__init__(f"weight sync to engine {name} over {transport}: {what}")
        self.engine = engine
        self.transport = transport


def megabytes(nbytes: int) -> str:
    """`nbytes` for a message, in MB (10^6 bytes): `0.616 MB`, `43 MB`, `14,000 MB`."""
    mb = nbytes / 1e6
    return f"{mb:,.0f} MB" if mb >= 100 else f"{mb:.3g} MB"


@dataclass(frozen=True)
class PushBound:
    """How long one weight request to an engine may take: `base` seconds (the engine's own work,
    a busy machine) plus the request's bytes at `min_mb_per_s`, and never longer than `cap`
    (`cluster.sync_timeout`). A small push to a stopped engine then fails in seconds instead of
    waiting out the whole sync timeout, while a big one is still given the time its bytes need."""

    base: float = 30.0  # cluster.sync_base_timeout
    min_mb_per_s: float = 10.0  # cluster.sync_min_mb_per_s
    cap: float = 300.0  # cluster.sync_timeout

    def seconds(self, nbytes: int) -> float:
        """The bound of a request that moves (or makes the engine read or hash) `nbytes` bytes."""
        return min(self.cap, self.base + nbytes / (self.min_mb_per_s * 1e6))

    def explain(self, nbytes: int) -> str:
        """Where `seconds(nbytes)` comes from, naming the config keys that set it."""
        if self.base + nbytes / (self.min_mb_per_s * 1e6) >= self.cap:
            return f"cluster.sync_timeout {self.cap:g} s"
        return (
            f"cluster.sync_base_timeout {self.base:g} s + {megabytes(nbytes)} at "
            f"cluster.sync_min_mb_per_s {self.min_mb_per_s:g}"
        )


def check_engine(
    engine: str, transport: str, version: int, want_checksum: str | None, got_version: int, got_checksum: str | None
) -> None:
    """Raise `SyncError` unless the engine reports `version` (and, when both are known, the checksum)."""
    if got_version != version:
        raise SyncError(engine, transport, f"the engine reports weight version {got_version}, expected {version}")
    if want_checksum is not None and got_checksum is not None and got_checksum != want_checksum:
        raise SyncError(
            engine,
            transport,
            f"the engine's weights have checksum {got_checksum}, the trainer sent {want_checksum} (version {version})",
        )


@dataclass
class SyncSetup:
    """What a transport's `build` classmethod gets (`tidal.roles.build_sync`): its
    `tidal.backends` record, the two sides, and the options that shape a push (from the cluster
    and train groups)."""

    transport: Transport
    trainer: Trainer
    engines: Engines
    timeout: float  # cluster.sync_timeout
    bound: PushBound  # each weight request's bound
    sync_dir: str  # the disk transport's folder (cluster.sync_dir, else the run's `weights`)
    whole: bool = False  # every push sends every tensor (colocated engines wake with no weights)
    share: bool = True  # an in-process engine may alias the trainer's tensors (not while rollout overlaps training)
    lora_layers: bool = False  # an in-process engine runs the trainer's LoRA layers (`train.lora_merge` false)
