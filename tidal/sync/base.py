"""What every weight transport shares: the error that ends a run, and the check after a transfer.

A push hands the trainer's weights to every engine as one version. Each transport is versioned
(the engine reports the version it holds), checked (the engine reports a CRC-32 of what it loaded,
compared with the trainer's CRC-32 of what it sent, cast to the engine's dtype) and all-or-nothing
(a failed load leaves the engine on its old weights and version), and every wait is bounded.
"""

from __future__ import annotations

from tidal.contracts import WeightSync

__all__ = ["SyncError", "WeightSync", "check_engine"]


class SyncError(RuntimeError):
    """A weight transfer failed or timed out; the message names the engine and the transport."""

    def __init__(self, engine: str, transport: str, what: str) -> None:
        super().__init__(f"weight sync to engine {engine} over {transport}: {what}")
        self.engine = engine
        self.transport = transport


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
