"""RolloutManager: prompts in, scored `Sample`s out.

Each prompt is sampled `n_samples_per_prompt` times, each time by the prompt's generate function
(`tidal.rollout.generate`); every sample gets its own seed derived from (base seed, step, sample
index), so a rollout is reproducible whatever else runs (and a resumed run samples exactly what an
uninterrupted one would have). Every sample is its own task on the rollout's event loop
(`tidal.aio.LoopThread`), and each of its engine calls is its own request.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from collections.abc import Awaitable

from tidal.aio import LoopThread
from tidal.contracts import Engine, SamplingParams
from tidal.data.dataset import PromptRecord
from tidal.data.images import ImageReader
from tidal.reward.checks import GroupScoreFn, ScoreFn
from tidal.reward.failures import ErrorLog
from tidal.reward.options import JudgeConfig, RewardConfig, RewardModelConfig
from tidal.reward.score import check_reward_key, get_reward_fn, score_rollout
from tidal.rollout.generate import FINISH_STATUS, GenerateContext, GenerateFn, load_async_fn, single_turn
from tidal.rollout.options import AgentConfig, RolloutConfig, SamplingConfig, ToolsConfig
from tidal.types import Sample, Status

__all__ = [
    "FINISH_STATUS",
    "RolloutManager",
    "group_size",
    "group_sizes",
    "load_generate_fn",
    "load_rewards",
    "sample_seed",
]

log = logging.getLogger(__name__)


def sample_seed(base: int, step: int, index: int) -> int:
    """A 63-bit seed unique to (base, step, index); a fixed mix, not Python's salted hash()."""
    x = (base * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) % (1 << 64)
    x ^= x >> 31
    return x % (1 << 63)


def group_sizes(samples: list[Sample]) -> list[int]:
    """The size of each group of a batch laid out group after group, in order; groups may differ in
    size (a generate function may return any number of samples for a prompt). ValueError when a
    group's samples are not contiguous (the estimators read groups as runs of the batch)."""
    sizes: list[int] = []
    seen: set[int] = set()
    last: int | None = None
    for s in samples:
        if s.group_index != last:
            if s.group_index in seen:
                raise ValueError(f"samples of group {s.group_index} are not contiguous")
            seen.add(s.group_index)
            sizes.append(0)
            last = s.group_index
        sizes[-1] += 1
    return sizes


def group_size(samples: list[Sample]) -> int | list[int]:
    """The samples per group as the estimators take it (`tidal.algo.Groups`): an int when every
    group of the batch has that many (0 for no samples), else each group's size in order (ragged
    groups). ValueError when groups are not contiguous."""
    sizes = group_sizes(samples)
    if len(set(sizes)) <= 1:
        return sizes[0] if sizes else 0
    return sizes


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


def load_rewards(
    reward: RewardConfig, judge: JudgeConfig, rm: RewardModelConfig | None = None
) -> tuple[ScoreFn | None, GroupScoreFn | None]:
    """(per-sample reward, group reward) from the config; exactly one of them is set:
    `reward.group_fn` when given, else `reward.fn` (``judge``: the LLM judge `judge` configures;
    ``rm``: the reward model `rm` configures, loaded on its first batch)."""
    if reward.group_fn:
        from tidal.reward.group import load_group_reward

        return None, load_group_reward(reward.group_fn)
    if reward.judged:
        from tidal.reward.judge import JudgeReward

        return JudgeReward(judge, reward.backoff), None
    if reward.uses_rm:
        from tidal.reward.reward_model import RewardModel

        return RewardModel(rm or RewardModelConfig()), None
    return get_reward_fn(reward.fn, reward.workers), None


def _is_partial(out: list[Sample]) -> bool:
    return len(out) == 1 and out[0].status == Status.ABORTED and out[0].metadata.get("finish_reason") == "abort"


class RolloutManager:
    """Fans prompts out to the generate functions in groups, then scores every sample with the reward.

    `generate` is for synchronous callers (the loop): it runs `agenerate` on `loop`, the rollout
    role's long-lived event loop (one of its own when none is given). The option groups it reads
    besides `rollout` default to their defaults."""

    def __init__(
        self,
        engine: Engine,
        rollout: RolloutConfig,
        tokenizer=None,
        loop: LoopThread | None = None,
        routed_experts: bool = False,
        *,
        sampling: SamplingConfig | None = None,
        reward: RewardConfig | None = None,
        judge: JudgeConfig | None = None,
        rm: RewardModelConfig | None = None,
        tools: ToolsConfig | None = None,
        agent: AgentConfig | None = None,
        images: ImageReader | None = None,
    ) -> None:
        """`images`: a vision-language model's processor, for the images an agent sends its door."""
        self.engine = engine
        self.images = images
        self.routed_experts = routed_experts  # ask the engine for MoE routing (algo.routing_replay)
        self.rollout = rollout
        self.sampling = sampling or SamplingConfig()
        self.reward = reward or RewardConfig()
        self.tools, self.agent = tools or ToolsConfig(), agent or AgentConfig()
        self.tokenizer = tokenizer
        self.loop = loop if loop is not None else LoopThread()
        self._own_loop = loop is None
        self.reward_fn, self.group_reward_fn = load_rewards(self.reward, judge or JudgeConfig(), rm)
        self.reward_errors = ErrorLog()
        self.generate_fn = load_generate_fn(rollout.generate)
        self.extra: dict = {}  # shared state of built-in generate functions (tools, the agent door)
        # partial rollouts (the overlapped loop): a sample whose request was aborted (new weights
        # were on their way) is sent again at once, continuing from its own tokens; the engine is
        # paused until the weights have loaded, so the continuation runs on them
        self.continue_partial = False
        self.aborted = self.resumed = 0
        self._rollouts = itertools.count()

    @classmethod
    def from_config(
        cls, engine: Engine, cfg, tokenizer=None, loop: LoopThread | None = None, images: ImageReader | None = None
    ) -> RolloutManager:
        """The manager of a run's `tidal.config.Config`: its rollout, sampling, reward, judge, rm, tools
        and agent groups; MoE routing asked for with `algo.routing_replay`."""
        return cls(
            engine,
            cfg.rollout,
            tokenizer,
            loop,
            cfg.algo.routing_replay,
            sampling=cfg.sampling,
            reward=cfg.reward,
            judge=cfg.judge,
            rm=cfg.rm,
            tools=cfg.tools,
            agent=cfg.agent,
            images=images,
        )

    def sampling_params(self, seed: int) -> SamplingParams:
        c = self.sampling
        return SamplingParams(
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k,
            max_new_tokens=self.rollout.max_new_tokens,
            stop_token_ids=list(c.stop_token_ids),
            stop=list(c.stop),
            seed=seed,
            return_routed_experts=self.routed_experts,
        )

    def generate(self, records: list[PromptRecord], step: int, first_index: int = 0) -> list[Sample]:
        """Sample and score `n_samples_per_prompt` responses for each record, group by group.

        Seeds come from (seed, step, first_index + sample position), so a second call in the same
        step (dynamic sampling) passes the number of samples already drawn to get fresh ones."""
        return self.loop.run(self.agenerate(records, step, first_index))

    async def agenerate(self, records: list[PromptRecord], step: int, first_index: int = 0) -> list[Sample]:
        n = self.rollout.n_samples_per_prompt
        rollout = next(self._rollouts)  # group keys unique to this call
        # a reward that renders the conversation itself (the reward model, with its own chat template)
        wants_messages = getattr(self.reward_fn, "wants_messages", False)
        jobs = []
        for g, rec in enumerate(records):
            fn = self.generate_fn
            if rec.metadata.get("generate"):
                fn = load_generate_fn(rec.metadata["generate"], f"prompt {rec.index}: metadata field 'generate'")
            for j in range(n):
                i = g * n + j
                sample = Sample(
                    tokens=list(rec.input_ids),
                    prompt=rec.text,
                    label=rec.label,
                    group_index=g,
                    index=i,
                    metadata={**rec.metadata, "prompt_index": rec.index},
                    images=rec.images,  # one list for the group
                )
                if wants_messages and rec.messages is not None:
                    sample.metadata["prompt_messages"] = rec.messages  # reward_model.MESSAGES_KEY
                ctx = GenerateContext(
                    self.engine,
                    self.tokenizer,
                    self.rollout,
                    rec,
                    step,
                    (rollout, g),
                    self.extra,
                    i,
                    self.tools,
                    self.agent,
                    self.images,
                )
                params = self.sampling_params(sample_seed(self.sampling.seed, step, first_index + i))
                jobs.append((fn, ctx, sample, params))
        results = await asyncio.gather(*(self._run_one(*job) for job in jobs))
        samples: list[Sample] = []
        for out in results:
            for s in out:
                s.index = len(samples)
                samples.append(s)
        group_sizes(samples)  # groups must be contiguous runs for the estimators
        await score_rollout(
            samples,
            self.reward_fn,
            self.reward,
            self.rollout.max_failed_ratio,
            self.reward_errors,
            self.group_reward_fn,
        )
        check_reward_key(samples, self.reward.key)  # a dict reward must hold the key trained on
        for s in samples:
            if s.status == Status.FAILED:  # nothing trustworthy to learn from
                s.loss_mask = [0] * s.response_length
        return samples

    async def _run_one(
        self, fn: GenerateFn, ctx: GenerateContext, sample: Sample, params: SamplingParams
    ) -> list[Sample]:
        out = await self._call(fn, ctx, sample, params)
        while self.continue_partial and _is_partial(out):
            self.aborted += 1
            out = await self._call(fn, ctx, out[0], params)
            self.resumed += 1
        return out

    async def _call(self, fn: GenerateFn, ctx: GenerateContext, sample: Sample, params: SamplingParams) -> list[Sample]:
        try:
            out = await fn(ctx, sample, params)
        except Exception as e:  # one broken trajectory fails its sample, not the rollout
            prompt = sample.metadata.get("prompt_index")
            log.warning("generate failed for sample %d (prompt %s): %r", sample.index, prompt, e)
            sample.status = Status.FAILED
            sample.metadata["error"] = f"generate: {e!r}"
            sample.reward = 0.0
            out = sample
        out = out if isinstance(out, list) else [out]
        for s in out:
            if not isinstance(s, Sample):
                raise TypeError(f"generate function returned {type(s).__name__}, expected Sample or list[Sample]")
            s.validate()
            s.group_index = sample.group_index
        return out

    def close(self) -> None:
        """Stop the event loop this manager made for itself (a given one is its owner's)."""
        if self._own_loop:
            self.loop.close()
