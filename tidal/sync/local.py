"""In-process handoff: the engine lives in the trainer's process (the laptop default)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tidal.adapters.async_engine import AsyncEngine
from tidal.contracts import Trainer
from tidal.engine.llm_engine import LLMEngine
from tidal.engine.weights import weights_checksum
from tidal.sync.base import SyncError, SyncSetup, check_engine


class InProcessSync:
    """The engine (`AsyncEngine` over an in-process core) takes the trainer's tensors where the
    dtypes agree (no copy, and no second copy in memory: the synchronous loop never generates
    while the trainer updates them) and copies (casts) the rest. The load runs on the engine's
    thread between two steps; a push that copied anything is checked by checksum (a shared tensor
    is the trainer's own, nothing to check).

    An engine that takes partial updates gets every tensor on the first push (sharing the
    trainer's frozen base weights: one copy in memory), then only the tensors training can change
    (with LoRA: the merged targeted matrices). `sync/bytes` counts the bytes the engine did not
    already hold: copied, or newly shared.

    `merged` False (`train.lora_merge`): `adopt(core)` first gives the engine's model the
    trainer's LoRA layers, and the engine then takes the LoRA model's own tensors (base and
    adapters, shared: the adapters it computes with are the ones the trainer updates in place)."""

    transport = "in-process"

    def __init__(
        self,
        trainer: Trainer,
        engine: AsyncEngine,
        timeout: float = 300.0,
        share: bool = True,
        merged: bool = True,
        adopt: Callable[[Any], None] | None = None,
    ) -> None:
        self.trainer = trainer
        self.merged, self.adopt = merged, adopt
        self.engine = engine
        self.timeout = timeout
        self.share = share  # False: the engine keeps a copy (it generates while the trainer updates)
        self.dtype = engine.dtype
        self.partial = engine.partial_updates
        self._held: dict[str, int] = {}  # name -> storage the engine shares with the trainer
        self._pushed = False  # whether the engine holds a whole push of this trainer's

    @classmethod
    def build(cls, setup: SyncSetup) -> InProcessSync:
        """The transport for the engine of `setup.engines` (in this process)."""
        timeout = setup.timeout
        if not setup.lora_layers:
            return cls(setup.trainer, setup.engines.engine, timeout, share=setup.share)
        from tidal.train.lora import mirror

        trainer = setup.trainer

        def adopt(core) -> None:  # the engine's model runs the trainer's LoRA layers
            mirror(core.model, trainer.model)

        return cls(trainer, setup.engines.engine, timeout, share=setup.share, merged=False, adopt=adopt)

    def push(self, version: int) -> dict[str, float]:
        partial = self.partial and self._pushed
        if self.adopt is not None and not self._pushed:
            adopt, core = self.adopt, self.engine.core
            self.engine.call(lambda: adopt(core), self.timeout, "giving the engine the trainer's LoRA layers")
        named = list(self.trainer.named_weights(self.dtype, changed_only=partial, merged=self.merged))
        shared = {n: t.data_ptr() for n, t in named if self.share and t.dtype == self.dtype}
        copied = [(n, t) for n, t in named if n not in shared]
        fresh = [(n, t) for n, t in named if n not in shared or self._held.get(n) != shared[n]]
        self._pushed = False  # until this push is confirmed: a failed one is followed by a whole one
        try:
            got_version, got_sum = self.engine.load_weights(
                named, version, self.timeout, checksum=bool(copied), share=self.share, partial=partial
            )
        except (ValueError, RuntimeError, TimeoutError) as e:
            raise SyncError("in-process", self.transport, f"{type(e).__name__}: {e}") from e
        want = None
        if copied:  # the whole model's fingerprint (a partial update leaves the rest as it was)
            everything = self.trainer.named_weights(self.dtype, merged=self.merged) if partial else named
            want = weights_checksum(everything, self.dtype)
        check_engine("in-process", self.transport, version, want, got_version, got_sum)
        self._held = {**self._held, **shared} if partial else shared
        self._pushed = True
        return {
            "sync/bytes": float(sum(t.numel() for _, t in fresh) * self.dtype.itemsize),
            "sync/tensors": float(len(named)),
        }

    def before_train(self) -> None:
        """The synchronous loop trains now, and its push re-makes the engine's packed (or quantized)
        copies of the weights from the new ones (`Quantizer.refresh` at every load): until then they
        only hold memory, which the trainer's step needs (the engine's oneDNN copy of SmolLM2 is
        513 MB in float32). The engine drops them (`Quantizer.release`); one asked to generate
        before the push packs each layer again at its first call."""
        core = self.engine.core
        if isinstance(core, LLMEngine) and core.quant is not None:
            self.engine.call(core.quant.release, self.timeout, "dropping the engine's packed weights")

    def close(self) -> None:
        pass
