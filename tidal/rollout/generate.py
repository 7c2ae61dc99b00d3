"""Generate functions: how one prompt becomes one or more samples.

A generate function is `async def generate(ctx, sample, sampling) -> Sample | list[Sample]`:

    ctx       GenerateContext: `await ctx.generate(input_ids, sampling)` (token ids in; sampled ids,
              their log-probs and the weight version out), the tokenizer, the rollout config and
              the prompt record
    sample    a Sample holding the prompt tokens (`response_length` 0), label, group and index
    sampling  SamplingParams with this sample's own seed

It grows the sample with `sample.append_policy(...)` (sampled tokens) and `sample.append_env(...)`
(tool output, user turns), so the trainer scores exactly the ids the engine sampled. It may set
`sample.reward`; samples without one are scored by `reward.fn` afterwards. A list fans the
prompt out: every sample of it joins the prompt's group. The default, `single_turn`, is one
engine call. `rollout.generate` names the function (`single_turn`, `tools`, `agent`, or a dotted
path / `file.py:fn`; see `tidal.rollout.manager.load_generate_fn`); a prompt row may name its own
in its metadata field `generate`.

Each `ctx.generate` is one request to the engine (`tidal.contracts.Engine`), sent at once: it
joins the engine's running batch at its next step, whatever the other samples are doing. A
sample waiting on a tool or an agent holds nobody up.

Determinism: every request carries its own seed (the sample's, or `turn_seed` of it for a later
call), and an engine samples a request with its own generator, so the same seed gives the same
tokens for the same logits. The logits of a request can differ in the last bits with the batch it
shares a step with (a matrix product blocks differently for another batch size), which can flip
a token drawn at the edge of two choices. Requests submitted together (a single-turn rollout, each
turn of a multi-turn one whose tools take the same time) go to tidal's in-process engine in one
step, so a rollout repeats exactly; where tool latency or HTTP timing varies which requests share
a step, tokens repeat up to such rare flips. vLLM and SGLang give the same guarantee at best.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tidal.contracts import Engine, GenerationOutput, SamplingParams
from tidal.data.dataset import PromptRecord
from tidal.data.images import ImageReader
from tidal.moe import routing_record
from tidal.rollout.options import AgentConfig, RolloutConfig, ToolsConfig
from tidal.types import Sample, Status
from tidal.utils import load_object

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


class GenerateFn(Protocol):
    """A generate function of your own, named by `rollout.generate` (or a prompt row's metadata
    field `generate`):

        async def generate(ctx: GenerateContext, sample: Sample, sampling: SamplingParams)
            -> Sample | list[Sample]

    It must be `async def` and take exactly these three arguments (checked before the model loads).

        ctx       `await ctx.generate(ids, sampling)` samples from the policy and returns a
                  `GenerationOutput` (token_ids, log_probs, finish_reason "stop" | "length" |
                  "abort", text, weight_version); `ctx.tokenizer`, `ctx.rollout` (the rollout
                  group), `ctx.record` (the prompt row: `prompt` as in the file, `label`,
                  `metadata`), `ctx.tools`, `ctx.agent`, `ctx.extra` (shared by one rollout's samples)
        sample    a `Sample` holding the prompt tokens only (`response_length` 0), its `prompt`
                  text, `label`, `metadata`, `group_index` and `index`
        sampling  the `SamplingParams` of this sample (its own seed; `max_new_tokens` per call)

    Grow the sample with `sample.append_policy(out.token_ids, out.log_probs, out.weight_version,
    out.text)` for what the policy sampled (trained on) and `sample.append_env(ids, text)` for what
    the environment adds (not trained on); set `sample.status` (`tidal.rollout.generate.finish`
    maps a finish reason to it) and optionally `sample.reward` (else `reward.fn` scores it). A
    list of samples joins the prompt's group. An exception fails this sample only.
    """

    def __call__(
        self, ctx: GenerateContext, sample: Sample, sampling: SamplingParams, /
    ) -> Awaitable[Sample | list[Sample]]: ...


@dataclass
class GenerateContext:
    """What a generate function gets besides its sample: the engine, the tokenizer, the rollout's
    option groups (`rollout`: max_new_tokens, max_turns, `response_budget`; `tools`; `agent`)."""

    engine: Engine
    tokenizer: Any
    rollout: RolloutConfig
    record: PromptRecord | None = None
    step: int = 0
    group: Hashable | None = None  # the prompt's group: an engine with several servers keeps it on one
    extra: dict = field(default_factory=dict)  # set by the manager for built-ins (tools, the agent door)
    index: int = 0  # the sample's position in this rollout call
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    images: ImageReader | None = None  # a vision-language model's processor (the agent door's images)

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, images: list | None = None
    ) -> GenerationOutput:
        """Sample one response to `input_ids`: token ids, one log-prob per id, finish reason, version.
        A vision-language prompt's images go with it: `images`, by default the record's."""
        if images is None:
            images = self.record.images if self.record is not None else None
        if images:
            return await self.engine.generate(input_ids, sampling, group=self.group, images=images)
        return await self.engine.generate(input_ids, sampling, group=self.group)


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


def keep_routing(sample: Sample, out: GenerationOutput) -> None:
    """Give `sample` the MoE routing the engine returned for its latest call (routing replay):
    it covers every token of the sample but the last when the call's prompt was the sample's
    tokens so far; a call that saw other tokens leaves the sample without one."""
    if out.routed_experts is not None:
        routed = out.routed_experts
        if routed.dim() == 2:  # over HTTP: [positions, layers x top-k], split by the trainer's model
            routed = routed[:, None, :]
        fits = routed.shape[0] == len(sample.tokens) - 1
        sample.set_routed_experts(routing_record(routed) if fits else None)


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
    keep_routing(sample, out)
    if done and ctx.tokenizer is not None:  # decode the whole: a character may straddle the segments
        sample.response = ctx.tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
    return finish(sample, out.finish_reason)
