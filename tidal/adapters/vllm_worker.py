"""Methods tidal adds to vLLM's worker (vLLM's `worker_extension_cls`), reached through
`collective_rpc("tidal_...")`.

They run inside vLLM's worker, next to its model runner, which is the only place new weights can
go on CPU: vLLM repacks each linear weight into a kernel-specific form held by the layer and
leaves the parameter empty, so copying into parameters changes nothing. `reload_weights` runs
vLLM's own loading and repacking again.

This module imports nothing from vLLM at import time: vLLM imports it by name in its worker.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _asleep(*_args, **_kwargs):
    raise RuntimeError("the vLLM engine is asleep: its weights were freed; load weights after wake()")


class TidalWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (`self.model_runner` is vLLM's)."""

    def tidal_load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-named tensors through vLLM's in-place reload (loads and repacks).

        vLLM repacks only the layers the checkpoint names; an output projection tied to the input
        embedding is not named, so on CPU it would keep computing logits with its packed copy of
        the old embedding. Every packed layer the reload left alone is repacked here from its
        (updated) weight."""
        model = self.model_runner.get_model()
        packed = {
            name: (m, m.cpu_linear) for name, m in model.named_modules() if callable(getattr(m, "cpu_linear", None))
        }
        self.model_runner.reload_weights(weights_iterator=iter(named))
        for name, (m, before) in packed.items():
            if m.cpu_linear is not before:
                continue  # repacked by the reload
            weight = getattr(m, "weight", None)
            if weight is None or weight.numel() == 0:
                raise RuntimeError(f"{name}: vLLM did not reload this layer and its unpacked weight is gone")
            m.quant_method.process_weights_after_loading(m)
        self._tidal_weights_freed = False

    def tidal_free_memory(self) -> dict:
        """Free the KV cache and the weights in place, keeping every tensor object (so vLLM's
        references stay valid) with zero bytes behind it; `tidal_restore_memory` allocates the
        bytes again (zeros: the weights need the next load). For platforms where vLLM's own sleep
        mode does nothing (CPU). Returns the bytes freed."""
        freed = {"kv_cache_bytes": 0, "weight_bytes": 0}
        self._tidal_storages = getattr(self, "_tidal_storages", [])
        seen: set[int] = set()

        def release(t: torch.Tensor, key: str) -> None:
            s = t.untyped_storage()
            n = s.nbytes()
            if n == 0 or s.data_ptr() in seen:
                return
            seen.add(s.data_ptr())
            s.resize_(0)
            self._tidal_storages.append((s, n))
            freed[key] += n

        for t in self.model_runner.kv_caches:
            for part in t if isinstance(t, list | tuple) else [t]:
                release(part, "kv_cache_bytes")
        model = self.model_runner.get_model()
        # Parameters only: buffers (rotary tables, ...) are computed at start-up and no weight
        # load would refill them.
        for p in model.parameters():
            release(p, "weight_bytes")
        # A repacked linear weight lives in the layer's `cpu_linear` closure (CPU builds); the
        # next weight load repacks and replaces it.
        for m in model.modules():
            if callable(getattr(m, "cpu_linear", None)):
                m.cpu_linear = _asleep
        self._tidal_weights_freed = True
        return freed

    def tidal_restore_memory(self) -> int:
        """Allocate what `tidal_free_memory` freed again, zeroed; returns the bytes allocated."""
        total = 0
        for s, n in getattr(self, "_tidal_storages", []):
            s.resize_(n)
            # Reused memory may hold NaN bit patterns, and attention reads padding slots (vLLM's
            # null block) that only a zero keeps harmless under the mask.
            torch.empty(0, dtype=torch.uint8).set_(s, 0, (n,)).zero_()
            total += n
        self._tidal_storages = []
        return total
