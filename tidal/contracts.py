"""The contracts at tidal's seams, in one place: what the loop and the rollout need of an engine,
a trainer, a weight transport and a buffer. Each has more than one implementation (in this
process, on Ray, behind HTTP; tidal's engine, vLLM, SGLang), and the code on either side of a seam
uses nothing but what is written here.

    Engine       async and per request: submit one prompt, await its output; abort, pause, resume,
                 sleep, wake. Requests join the engine's running batch as they arrive.
    EngineCore   the synchronous, step-based core an in-process engine is built on (tidal's engine,
                 vLLM's, transformers'); `tidal.engine.async_engine.AsyncEngine` turns one into an
                 `Engine` by running it on a thread of its own.
    Engines      the rollout role: its engine, the event loop every rollout call runs on, and the
                 lifecycle the loop drives (health, recovery, sleep/wake while trainers train).
    WeightSync   trainer -> engines, one version at a time: checked, all or nothing, bounded.
    Trainer      log-probs, a train step, weights out, checkpoints.
    Buffer       finished groups waiting for the trainer (the overlapped loop).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from tidal.aio import LoopThread
    from tidal.engine.sampling import SamplingParams
    from tidal.types import Sample


@dataclass
class GenerationOutput:
    """One response: the sampled ids, the log-prob of each under the distribution it was drawn
    from (after temperature, top-p, top-k, min-p), why it ended, its text, and the weight version
    that produced it."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" | "length" | "abort"
    text: str = ""
    weight_version: int = 0


@dataclass(kw_only=True)
class RequestOutput(GenerationOutput):
    """What a core engine returns for one finished (or aborted) request: a `GenerationOutput` and
    what a server reports besides."""

    request_id: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when asked for

    def generation(self) -> GenerationOutput:
        return GenerationOutput(
            list(self.token_ids), list(self.log_probs), self.finish_reason, self.text, self.weight_version
        )


@runtime_checkable
class Engine(Protocol):
    """An inference engine as the rollout sees it: async and per request.

    Every coroutine may be awaited from the rollout's event loop while others run: `generate`
    calls from many samples overlap, and the engine batches them continuously (a request joins
    the running batch at the next step, and leaves it when done). Weights reach an engine only
    through the weight-sync role; `weight_version` is the version it serves now."""

    @property
    def weight_version(self) -> int: ...

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        group: Hashable | None = None,
    ) -> GenerationOutput:
        """Sample one response to `input_ids` with `sampling` (its own seed: the same seed gives the
        same tokens for the same weights and batch). `group`: requests sharing a prompt, which an
        engine with several servers keeps on one of them (its prefix cache holds the prompt).
        An aborted request returns what it has so far with finish reason "abort"."""
        ...

    async def abort(self, request_id: str | None = None) -> None:
        """Abort one request (None: every request in flight)."""
        ...

    async def pause(self) -> None:
        """Stop stepping: requests in flight wait (new ones queue) until `resume`."""
        ...

    async def resume(self) -> None: ...

    async def sleep(self) -> None:
        """Free the KV cache and weights (colocated trainers need the memory); nothing may run."""
        ...

    async def wake(self) -> None:
        """Take the memory back; the engine serves again after the next weight push."""
        ...

    async def flush_cache(self) -> bool:
        """Drop cached prefixes (computed with older weights); False when the engine refused."""
        ...

    async def aclose(self) -> None: ...


class EngineCore(Protocol):
    """A synchronous engine driven step by step on one thread (see `AsyncEngine`)."""

    weight_version: int
    tokenizer: Any
    max_model_len: int

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Any:
        """Queue a request; ValueError (naming it) when it cannot be served."""
        ...

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests it finished."""
        ...

    def has_unfinished(self) -> bool: ...

    def abort(self, request_id: str | None = None) -> list[RequestOutput]:
        """Stop one request (None: all); each comes back with its tokens so far."""
        ...

    def update_weights_from_tensors(
        self, named: Iterable[tuple[str, Tensor]], version: int | None = None, **kw: Any
    ) -> None:
        """All or nothing; `stage=True` keeps the tensors for a later call that loads them all."""
        ...

    def update_weights_from_disk(self, path: str | Path, version: int | None = None) -> None: ...

    def flush_cache(self) -> bool: ...

    def stats(self) -> dict: ...

    def weights_checksum(self) -> str: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


class Engines(Protocol):
    """The rollout role: one engine (in this process, N servers behind a router, Ray engine
    actors, vLLM, SGLang), the long-lived event loop every call to it runs on, and what the loop
    drives between steps. All methods here are synchronous, for the loop."""

    engine: Engine
    loop: LoopThread

    def health(self) -> bool: ...

    def recover(self) -> bool:
        """Put failed engines back in service (restart, drop or re-admit); True when the set changed:
        the weight sync must then give them the current weights before they serve."""
        ...

    def live_urls(self) -> list[str]: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


class WeightSync(Protocol):
    """Trainer -> every engine, as one version: the engine reports the version it holds and (where
    it can) a CRC-32 of what it loaded; a failed load leaves it on its old weights; every wait is
    bounded by `cluster.sync_timeout`."""

    transport: str

    def push(self, version: int) -> dict[str, float]:
        """Give every engine the trainer's current weights as `version`; returns metrics
        (`sync/bytes`, `sync/tensors`). Raises `tidal.sync.base.SyncError` naming the engine."""
        ...

    def close(self) -> None: ...


class Trainer(Protocol):
    """One process (`tidal.train.actor.Actor`) or FSDP2 ranks (`tidal.cluster.trainers.TrainerGroup`)."""

    has_reference: bool
    has_teacher: bool

    def compute_log_probs(self, samples: Sequence[Sample], which: str = "policy") -> Tensor:
        """[N, R] log-probs of the response tokens under the policy, `reference` or `teacher`."""
        ...

    def train_step(
        self,
        samples: Sequence[Sample],
        advantages: Tensor | None,
        old_log_probs: Tensor | None = None,
        ref_log_probs: Tensor | None = None,
    ) -> dict[str, float]:
        """Optimizer steps over the batch; returns metrics."""
        ...

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterable[tuple[str, Tensor]]:
        """The policy's weights by name (for weight sync)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def save_model(self, path: str | Path) -> None:
        """The policy as a Hugging Face model folder at `path` (safetensors, config)."""
        ...


class Buffer(Protocol):
    """Finished groups of the overlapped loop, waiting for the trainer (`overlap.buffer`)."""

    def add(self, groups: list[list[Sample]]) -> None: ...

    def get(self, n: int, step: int) -> list[list[Sample]] | None:
        """`n` groups to train at `step`, or None while there are not enough young enough ones."""
        ...

    def __len__(self) -> int: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
