"""The contracts at tidal's seams, in one place: what the loop and the rollout need of an engine,
a trainer, a weight transport and a buffer. Each has more than one implementation (in this
process, on Ray, behind HTTP; tidal's engine, vLLM, SGLang), and the code on either side of a seam
uses nothing but what is written here.

    SamplingParams, GenerationOutput    what one request asks for and what it gets back
    Engine       async and per request: submit one prompt, await its output; abort, pause, resume,
                 sleep, wake. Requests join the engine's running batch as they arrive.
    EngineCore   the synchronous, step-based core an in-process engine is built on (tidal's engine,
                 vLLM's, transformers'); `tidal.adapters.async_engine.AsyncEngine` turns one into an
                 `Engine` by running it on a thread of its own.
    Engines      the rollout role: its engine, the event loop every rollout call runs on, and the
                 lifecycle the loop drives (health, recovery, sleep/wake while trainers train).
    WeightSync   trainer -> engines, one version at a time: checked, all or nothing, bounded.
    Trainer      log-probs, a train step, weights out, checkpoints.
    Buffer       finished groups waiting for the trainer (the overlapped loop).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from tidal.aio import LoopThread
    from tidal.types import Sample


@dataclass
class SamplingParams:
    """Per-request sampling settings.

    `temperature == 0` means greedy decoding. `top_k == 0` and `top_p == 1` switch those filters
    off. `seed` makes one request reproducible whatever else shares its batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    # serving options (an RL rollout leaves them at their defaults: they change the distribution)
    top_logprobs: int = 0  # alternatives reported per token, from the tempered distribution
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the output
    repetition_penalty: float = 1.0  # a seen token's logit divided by it (multiplied when negative)
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to those tokens' logits
    ignore_eos: bool = False  # the end-of-sequence token does not stop the request
    # an MoE model's routing over the request's tokens comes back (`GenerationOutput.routed_experts`)
    return_routed_experts: bool = False

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or biases change the logits before sampling."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first bad field and its valid range; return self."""
        # `not (x >= 0)` rather than `x < 0` so NaN is rejected too.
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not (self.temperature >= 0) or math.isinf(self.temperature):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, int | float) or not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if (
            isinstance(self.top_logprobs, bool)
            or not isinstance(self.top_logprobs, int)
            or not 0 <= self.top_logprobs <= 20
        ):
            raise ValueError(f"top_logprobs must be an int in [0, 20], got {self.top_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0 < r <= 10:
            raise ValueError(f"repetition_penalty must be a number in (0, 10], got {r!r}")
        for k, v in self.logit_bias.items():
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {k!r}")
            if isinstance(v, bool) or not isinstance(v, int | float) or not -100 <= v <= 100:
                raise ValueError(f"logit_bias[{k}] must be a number in [-100, 100], got {v!r}")
        return self

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a config mapping and validate it; unknown keys raise ValueError naming them,
        so a typo such as `top-p` or `temprature` fails loudly instead of being ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; valid keys are {', '.join(sorted(known))}"
            )
        kwargs = dict(d)
        # Copy the lists so later edits to the caller's config do not reach into this object.
        for name in ("stop_token_ids", "stop"):
            if name in kwargs and kwargs[name] is not None:
                kwargs[name] = list(kwargs[name])
        if kwargs.get("logit_bias") is not None:
            kwargs["logit_bias"] = dict(kwargs["logit_bias"])
        return cls(**kwargs).validate()


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
    # with `SamplingParams.return_routed_experts`, an MoE engine's expert choices at every position
    # of prompt + response whose forward predicts a token: int [len(prompt) + len(response) - 1,
    # MoE layers, top-k] (an HTTP engine gives [rows, layers x top-k]); None otherwise
    routed_experts: Tensor | None = None


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
            list(self.token_ids),
            list(self.log_probs),
            self.finish_reason,
            self.text,
            self.weight_version,
            self.routed_experts,
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
        images: Sequence[Any] | None = None,
    ) -> GenerationOutput:
        """Sample one response to `input_ids` with `sampling` (its own seed: the same seed gives the
        same tokens for the same weights and batch). `group`: requests sharing a prompt, which an
        engine with several servers keeps on one of them (its prefix cache holds the prompt).
        `images`: a vision-language prompt's images (`tidal.vision.Image`), in placeholder order.
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

    async def get_stats(self) -> dict[str, Any]:
        """The engine's state and its counters since it started (tidal's engine: forward steps,
        prefill and decode tokens, prefix-cache hits, preemptions, `LLMEngine.stats`); over
        several servers, each numeric value summed over the servers that answered.
        `tidal.rollout.engine_stats` turns two reads into a step's `engine/*` metrics."""
        ...

    async def aclose(self) -> None: ...


class EngineUnavailable(RuntimeError):
    """The engine cannot do this now, in its present `state`: "asleep" (its memory released),
    "no_weights" (woken, and no weights loaded since) or "closed". Not the request's fault (the
    same call succeeds once the engine is woken or given weights; a closed one stays closed), so
    a server answers it as unavailable (503), not as a bad request or a crash."""

    def __init__(self, message: str, state: str) -> None:
        super().__init__(message)
        self.state = state


def require_weights(what: str, asleep: bool, weight_version: int) -> None:
    """`EngineUnavailable` naming `what` unless a core holds weights to generate with: it is
    awake and has loaded weights since it woke (a woken core reports version -1 until then)."""
    if asleep:
        raise EngineUnavailable(
            f"{what}: the engine holds no weights: it is asleep; wake() it and load weights", "asleep"
        )
    if weight_version < 0:
        raise EngineUnavailable(f"{what}: the engine holds no weights (woken, none loaded since)", "no_weights")


class EngineCore(Protocol):
    """A synchronous engine driven step by step on one thread (see `AsyncEngine`)."""

    weight_version: int
    tokenizer: Any
    max_model_len: int
    partial_updates: bool  # an update may name only the tensors that changed (`partial=True`)
    takes_images: bool  # add_request(..., images=...) for a vision-language model

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Any:
        """Queue a request; ValueError (naming it) when it cannot be served, `EngineUnavailable`
        while the engine is asleep or holds no weights. A core that `takes_images` takes
        `images=[tidal.vision.Image, ...]` too (a vision-language prompt's)."""
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
        """All or nothing; `stage=True` keeps the tensors for a later call that loads them all.
        `EngineUnavailable` while asleep (an engine that freed its weights cannot load into them)."""
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
    and the weight sync drive between steps. All methods here are synchronous, for the loop."""

    engine: Engine
    loop: LoopThread
    urls: list[str]  # the servers behind `engine` (none for an engine in this process)
    api_key: str | None  # the key those servers take
    restarts: int  # engines restarted or dropped so far

    def health(self) -> bool: ...

    def recover(self) -> bool:
        """Put failed engines back in service (restart, drop or re-admit); True when the set changed:
        the weight sync must then give them the current weights before they serve."""
        ...

    def live_urls(self) -> list[str]:
        """The URLs of the servers in service."""
        ...

    def down(self) -> dict[str, str]:
        """The servers out of service, by URL, with why."""
        ...

    def confirmed(self, version: int) -> dict[str, float]:
        """Every engine holds `version` (a push was checked): the rollout's engine reports it from
        now on. Returns the failure counts so far (`engines/restarts`, `engines/resent_requests`)."""
        ...

    def stats(self) -> dict[str, Any]:
        """`Engine.get_stats` of the rollout's engine ({} where there is none)."""
        ...

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

    def before_train(self) -> None:
        """The trainer trains now and the engines stay idle until the next `push` (the synchronous
        loop): an engine may drop what that push makes again (an in-process engine's packed weights)."""
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

    def named_weights(
        self, dtype: torch.dtype | None = None, changed_only: bool = False, merged: bool = True
    ) -> Iterable[tuple[str, Tensor]]:
        """The policy's weights by name (for weight sync), under the base model's names (LoRA
        adapters merged); `changed_only`: only the ones training can change; `merged` False: a
        LoRA model's own tensors, base and adapters (an engine in this process that runs the
        trainer's LoRA layers, `train.lora_merge` false)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def save_model(self, path: str | Path) -> None:
        """The policy as a Hugging Face model folder at `path` (safetensors, config)."""
        ...

    def describe(self) -> str:
        """One line for the run's start: full or LoRA, parameters trained of the total, precision,
        device (`tidal.train.actor.describe_training`)."""
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
