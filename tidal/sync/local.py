"""In-process handoff: the engine lives in the trainer's process (the laptop default)."""

from __future__ import annotations

from tidal.engine.weights import model_checksum, weights_checksum
from tidal.sync.base import SyncError, check_engine
from tidal.train.role import Trainer


class InProcessSync:
    """The engine takes the trainer's tensors where the dtypes agree (no copy, and no second copy
    in memory: the synchronous loop never generates while the trainer updates them) and copies
    (casts) the rest; a push that copied anything is checked by checksum (a shared tensor is the
    trainer's own, nothing to check)."""

    transport = "in-process"

    def __init__(self, trainer: Trainer, engine, share: bool = True) -> None:
        self.trainer = trainer
        self.engine = engine
        self.share = share  # False: the engine keeps a copy (it generates while the trainer updates)
        self.dtype = next(engine.model.parameters()).dtype

    def push(self, version: int) -> dict[str, float]:
        named = list(self.trainer.named_weights(self.dtype))
        copied = [(n, t) for n, t in named if t.dtype != self.dtype or not self.share]
        try:
            self.engine.update_weights_from_tensors(named, version=version, share=self.share)
        except (ValueError, RuntimeError) as e:
            raise SyncError("in-process", self.transport, f"{type(e).__name__}: {e}") from e
        if copied:
            want = weights_checksum(named, self.dtype)
            check_engine(
                "in-process",
                self.transport,
                version,
                want,
                self.engine.weight_version,
                model_checksum(self.engine.model),
            )
        return {
            "sync/bytes": float(sum(t.numel() for _, t in copied) * self.dtype.itemsize),
            "sync/tensors": float(len(named)),
        }

    def close(self) -> None:
        pass
