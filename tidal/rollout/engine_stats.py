"""The engines' own counters as a step's `engine/*` metrics (docs/metrics.md, "The engine's work").

An engine counts what it did since it started (`Engine.get_stats`: tidal's `LLMEngine.stats`,
over HTTP each server's `/get_server_info`, summed). The loop reads them after each step and logs
the difference from the read before, so a step's row says how many tokens the engines computed
for prompts and for decoding, how much of the prompts the prefix cache (or a sample of the same
prompt in the batch) spared, and whether sequences were preempted because the KV cache was full:
a rollout slower than it should be, said in numbers. An engine that does not count a thing (vLLM's
core, SGLang's servers) leaves its metric out.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from tidal.contracts import Engines

log = logging.getLogger("tidal")

# metric -> the counters it sums: tidal's engine's names, and vLLM's core's `cached_prompt_tokens`
COUNTERS: dict[str, tuple[str, ...]] = {
    "engine/steps": ("steps",),
    "engine/prefill_tokens": ("prefill_tokens",),
    "engine/cached_tokens": ("prefix_hit_tokens", "prefill_tokens_copied", "cached_prompt_tokens"),
    "engine/decode_tokens": ("decode_tokens",),
    "engine/preemptions": ("preemptions",),
    "engine/overlapped_steps": ("overlapped_steps",),
    "engine/cuda_graph_capture_s": ("cuda_graph_capture_s",),
}


def _since(before: float, now: float) -> float:
    """A counter's growth; one that went back belongs to an engine started again since (it
    counts from 0), so all it counted is new."""
    return now - before if now >= before else now


def engine_metrics(before: Mapping[str, float], now: Mapping[str, float]) -> dict[str, float]:
    """`engine/*` metrics between two `Engine.get_stats` reads: each metric is the growth of the
    counters `COUNTERS` names, summed over those the engine has (none: the metric is left out)."""
    out = {}
    for name, keys in COUNTERS.items():
        present = [k for k in keys if k in now]
        if present:
            out[name] = float(sum(_since(before.get(k, 0), now[k]) for k in present))
    return out


class EngineCounters:
    """The `engine/*` metrics of each step: `read()` after a step, `skip()` after engine work that
    is not a step's (an evaluation). Warns once per run when sequences were preempted.

    The counters are a diagnosis, not the run's: an engine that does not answer in time (its
    thread inside one long step, a server that hangs) costs the step its `engine/*` keys and a
    warning, and the next read counts from the last one that answered (with none before it, it
    only starts the count)."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines
        self.last = self._stats()
        self.warned = False

    def _stats(self) -> dict | None:
        try:
            return dict(self.engines.stats())
        except (TimeoutError, RuntimeError) as e:  # RuntimeError: EngineError, an engine thread that ended
            log.warning("engine stats: no answer this step, its engine/* metrics are left out (%s)", e)
            return None

    def read(self) -> dict[str, float]:
        now = self._stats()
        if now is None:
            return {}
        if self.last is None:  # the first read that answered: the count starts here
            self.last = now
            return {}
        out = engine_metrics(self.last, now)
        self.last = now
        preempted = out.get("engine/preemptions", 0)
        if preempted and not self.warned:
            self.warned = True
            log.warning(
                "engine: %d sequences were preempted this step (the KV cache was full) and computed "
                "again; a larger engine.kv_cache_tokens or a smaller engine.max_num_seqs avoids it "
                "(engine/preemptions counts them each step; said once)",
                preempted,
            )
        return out

    def skip(self) -> None:
        now = self._stats()
        if now is not None:
            self.last = now
