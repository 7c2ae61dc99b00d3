"""Generate functions: how one prompt becomes one or more samples.

A generate function is `async def generate(ctx, sample, sampling) -> Sample | list[Sample]`:

    ctx       GenerateContext: `await ctx.generate(input_ids, sampling)` (token ids in; sampled ids,
              their log-probs and the weight version out), the tokenizer, the rollout config and
              the prompt record
    sample    a Sample holding the prompt tokens (`response_length` 0), label, group and index
    sampling  SamplingParams with this sample's own seed

It grows the sample with `sample.append_policy(...)` (sampled tokens) and `sample.append_env(...)`
(tool output, user turns), so the trainer scores exactly the ids the engine sampled. It may set
`sample.reward`; samples without one are scored by `rollout.reward` afterwards. A list fans the
prompt out: every sample of it joins the prompt's group. The default, `single_turn`, is one
engine call. `rollout.generate` names the function (`single_turn`, `tools`, `agent`, or a dotted
path / `file.py:fn`); a prompt row may name its own in its metadata field `generate`.

Engine calls go through a `RoundBatcher`: it holds requests until every running generate function
is waiting on the engine, then sends them as one batch, ordered by sample index. A single-turn
rollout is therefore one batched engine call (continuous batching, a group's prompt prefilled
once), and a multi-turn one is deterministic for fixed seeds whatever the tools' timing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.config import RolloutConfig
from tidal.data.dataset import PromptRecord
from tidal.engine.base import Engine, GenerationOutput
from tidal.engine.sampling import SamplingParams
from tidal.types import Sample, Status
from tidal.utils import load_object

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}

GenerateFn = Callable[["GenerateContext", Sample, SamplingParams], Awaitable[Sample | list[Sample]]]

# the loop drains requests after this many event-loop turns with nothing new; it lets a generate
# function's own sub-tasks (asyncio.gather of several calls) queue theirs before a round goes out
_SETTLE_TURNS = 3


class RoundBatcher:
    """An async front for a synchronous batch `Engine`, run in rounds.

    Each running generate function registers its key (`enter`/`exit`). `generate` queues a request;
    once every registered key has a request queued (or has exited), the queue goes to
    `engine.generate` as one batch, in (key, arrival) order, on a worker thread so tools and HTTP
    handlers keep running. Requests made during a round wait for the next one.
    """

    def __init__(self, engine: Engine, should_abort: Callable[[], bool] | None = None) -> None:
        self.engine = engine
        # asked between engine steps: yes cuts the round short (partial rollouts, `LLMEngine` only)
        self.should_abort = should_abort
        self.active: dict[Any, int] = {}  # key -> number of enter() without exit()
        self.pending: list[tuple[Any, int, list[int], SamplingParams, asyncio.Future]] = []
        self.rounds = 0
        self.requests = 0
        self._seq = 0
        self._running = False
        self._scheduled = False
        self._flush_task: asyncio.Task | None = None

    def enter(self, key: Any) -> None:
        self.active[key] = self.active.get(key, 0) + 1

    def exit(self, key: Any) -> None:
        left = self.active.get(key, 0) - 1
        if left <= 0:
            self.active.pop(key, None)
        else:
            self.active[key] = left
        self._schedule()

    async def generate(self, input_ids: list[int], sampling: SamplingParams, key: Any = 0) -> GenerationOutput:
        """Sample one response to `input_ids` in the next round."""
        fut = asyncio.get_running_loop().create_future()
        self._seq += 1
        self.pending.append((key, self._seq, list(input_ids), sampling, fut))
        self._schedule()
        return await fut

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._check, _SETTLE_TURNS)

    def _check(self, turns: int) -> None:
        if turns > 0:
            asyncio.get_running_loop().call_soon(self._check, turns - 1)
            return
        self._scheduled = False
        self.pending = [p for p in self.pending if not p[4].done()]  # cancelled callers
        if self._running or not self.pending:
            return
        waiting = {p[0] for p in self.pending}
        if all(k in waiting for k in self.active):
            self._flush_task = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        batch = sorted(self.pending, key=lambda p: (repr(type(p[0])), p[0], p[1]))
        self.pending = []
        self._running = True
        self.rounds += 1
        self.requests += len(batch)
        try:
            kw = {"should_abort": self.should_abort} if self.should_abort is not None else {}
            outs = await asyncio.to_thread(self.engine.generate, [p[2] for p in batch], [p[3] for p in batch], **kw)
            for p, out in zip(batch, outs, strict=True):
                if not p[4].done():
                    p[4].set_result(out)
        except BaseException as e:  # every waiter hears of it; none hangs
            for p in batch:
                if not p[4].done():
                    p[4].set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            if not isinstance(e, Exception):
                raise
        finally:
            self._running = False
            self._schedule()


@dataclass
class GenerateContext:
    """What a generate function gets besides its sample: the engine, the tokenizer, the config."""

    engine: Any  # RoundBatcher or anything with `async generate(input_ids, sampling, key)`
    tokenizer: Any
    cfg: RolloutConfig
    record: PromptRecord | None = None
    step: int = 0
    key: Any = 0  # orders this sample's requests within a round (the sample's index)
    extra: dict = field(default_factory=dict)  # set by the manager for built-ins (tools, the agent door)

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        """Sample one response to `input_ids`: token ids, one log-prob per id, finish reason, version."""
        return await self.engine.generate(input_ids, sampling, self.key)


def turn_seed(seed: int | None, k: int) -> int | None:
    """The seed of a sample's k-th engine call (a tool-loop turn, an agent call, a partial
    rollout's continuation). k = 0 keeps the sample's seed, so a sample that needs one call
    samples exactly what `single_turn` would."""
    return None if seed is None else (seed + k * 0x9E3779B97F4A7C15) % (1 << 63)


def load_async_fn(name: str, where: str, signature: str) -> Callable:
    """A user coroutine function by dotted path or `file.py:fn`; errors name `where` and the
    `signature` expected."""
    try:
        fn = load_object(name, callable_required=True)
    except (ImportError, ValueError) as e:
        raise ValueError(f"{where}: cannot load {name!r}: {e}") from e
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{where}: {name!r} must be `{signature}`")
    return fn


def finish(sample: Sample, finish_reason: str) -> Sample:
    sample.status = FINISH_STATUS[finish_reason]
    sample.metadata["finish_reason"] = finish_reason
    return sample


async def single_turn(ctx: GenerateContext, sample: Sample, sampling: SamplingParams) -> Sample:
    """One engine call: the response is everything sampled, all of it trained on.

    A sample that already has response tokens is a partial rollout (an earlier call was aborted):
    it continues from exactly those ids, with what is left of `max_new_tokens` and a seed of its
    own for each segment."""
    done = sample.response_length
    if done:
        segment = sample.metadata.get("segments", 1)
        sample.metadata["segments"] = segment + 1
        sampling = dataclasses.replace(
            sampling, max_new_tokens=sampling.max_new_tokens - done, seed=turn_seed(sampling.seed, segment)
        )
    out = await ctx.generate(sample.tokens, sampling)
    sample.append_policy(out.token_ids, out.log_probs, out.weight_version, out.text)
    if done and ctx.tokenizer is not None:  # decode the whole: a character may straddle the segments
        sample.response = ctx.tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
    return finish(sample, out.finish_reason)


def _tools(ctx: GenerateContext, sample: Sample, sampling: SamplingParams) -> Awaitable[Sample]:
    from tidal.rollout.multi_turn import tool_loop

    return tool_loop(ctx, sample, sampling)


def _agent(ctx: GenerateContext, sample: Sample, sampling: SamplingParams) -> Awaitable[list[Sample]]:
    from tidal.rollout.agent import agent_generate

    return agent_generate(ctx, sample, sampling)


BUILTIN_GENERATE: dict[str, GenerateFn] = {"single_turn": single_turn, "tools": _tools, "agent": _agent}


def load_generate_fn(name: str, where: str = "rollout.generate") -> GenerateFn:
    """A built-in generate function by name, or a user one by dotted path or `file.py:fn`."""
    if name in BUILTIN_GENERATE:
        return BUILTIN_GENERATE[name]
    fn = load_async_fn(name, where, "async def generate(ctx, sample, sampling)")
    params = [p for p in inspect.signature(fn).parameters.values() if p.default is inspect.Parameter.empty]
    if len(params) != 3:
        raise ValueError(f"{where}: {name!r} takes {len(params)} required arguments; expected (ctx, sample, sampling)")
    return fn
