"""RolloutManager: prompts in, scored `Sample`s out.

Each prompt is sampled `n_samples_per_prompt` times, each time by the prompt's generate function
(`tidal.rollout.generate`); every sample gets its own seed derived from (base seed, step, sample
index), so a rollout is reproducible whatever else runs (and a resumed run samples exactly what an
uninterrupted one would have).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tidal.config import RolloutConfig
from tidal.data.dataset import PromptRecord
from tidal.engine.base import Engine
from tidal.engine.sampling import SamplingParams
from tidal.rollout.failures import ErrorLog
from tidal.rollout.generate import FINISH_STATUS, GenerateContext, RoundBatcher, load_generate_fn
from tidal.rollout.rewards import check_reward_key, get_reward_fn, score_rollout
from tidal.types import Sample, Status

__all__ = ["FINISH_STATUS", "RolloutManager", "group_size", "sample_seed"]

log = logging.getLogger(__name__)


def sample_seed(base: int, step: int, index: int) -> int:
    """A 63-bit seed unique to (base, step, index); a fixed mix, not Python's salted hash()."""
    x = (base * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) % (1 << 64)
    x ^= x >> 31
    return x % (1 << 63)


def group_size(samples: list[Sample]) -> int:
    """The samples per group of a batch laid out group after group; ValueError when groups are not
    contiguous or differ in size (advantages compare equal-sized groups)."""
    sizes: dict[int, int] = {}
    order: list[int] = []
    for s in samples:
        if not order or order[-1] != s.group_index:
            if s.group_index in sizes:
                raise ValueError(f"samples of group {s.group_index} are not contiguous")
            order.append(s.group_index)
        sizes[s.group_index] = sizes.get(s.group_index, 0) + 1
    distinct = set(sizes.values())
    if len(distinct) > 1:
        raise ValueError(
            f"groups differ in size ({dict(sorted(sizes.items()))}): a generate function that fans a "
            "prompt out must return the same number of samples for every prompt of a batch"
        )
    return distinct.pop() if distinct else 0


def _is_partial(out: list[Sample]) -> bool:
    return len(out) == 1 and out[0].status == Status.ABORTED and out[0].metadata.get("finish_reason") == "abort"


class RolloutManager:
    """Fans prompts out to the generate functions in groups, then scores every sample with the reward."""

    def __init__(self, engine: Engine, cfg: RolloutConfig, tokenizer=None) -> None:
        self.engine = engine
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.reward_fn = get_reward_fn(cfg.reward, cfg.reward_workers)
        self.reward_errors = ErrorLog()
        self.generate_fn = load_generate_fn(cfg.generate)
        self.extra: dict = {}  # shared state of built-in generate functions (tools, agent door)
        # partial rollouts (the overlapped loop): asked between engine steps whether to cut the
        # round short; `on_abort` then runs (it loads new weights) and the cut samples continue
        self.should_abort: Callable[[], bool] | None = None
        self.on_abort: Callable[[], None] | None = None
        self.aborted = self.resumed = 0

    def sampling_params(self, seed: int) -> SamplingParams:
        c = self.cfg
        return SamplingParams(
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k,
            max_new_tokens=c.max_new_tokens,
            stop_token_ids=list(c.stop_token_ids),
            stop=list(c.stop),
            seed=seed,
        )

    def generate(self, records: list[PromptRecord], step: int, first_index: int = 0) -> list[Sample]:
        """Sample and score `n_samples_per_prompt` responses for each record, group by group.

        Seeds come from (seed, step, first_index + sample position), so a second call in the same
        step (dynamic sampling) passes the number of samples already drawn to get fresh ones."""
        return asyncio.run(self.agenerate(records, step, first_index))

    async def agenerate(self, records: list[PromptRecord], step: int, first_index: int = 0) -> list[Sample]:
        n = self.cfg.n_samples_per_prompt
        batcher = RoundBatcher(self.engine, self.should_abort)
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
                )
                ctx = GenerateContext(batcher, self.tokenizer, self.cfg, rec, step, i, self.extra)
                params = self.sampling_params(sample_seed(self.cfg.seed, step, first_index + i))
                jobs.append((fn, ctx, sample, params))
        results = await asyncio.gather(*(self._run_one(*job, batcher) for job in jobs))
        while self.on_abort is not None:
            cut = [i for i, out in enumerate(results) if _is_partial(out)]
            if not cut:
                break
            self.aborted += len(cut)
            self.on_abort()
            self.resumed += len(cut)
            again = await asyncio.gather(*(self._run_one(*jobs[i], batcher) for i in cut))
            for i, out in zip(cut, again, strict=True):
                results[i] = out
        samples: list[Sample] = []
        for out in results:
            for s in out:
                s.index = len(samples)
                samples.append(s)
        group_size(samples)  # refuse ragged fan-out before anyone trains on it
        await score_rollout(samples, self.reward_fn, self.cfg, self.reward_errors)
        check_reward_key(samples, self.cfg.reward_key)  # a dict reward must hold the key trained on
        for s in samples:
            if s.status == Status.FAILED:  # nothing trustworthy to learn from
                s.loss_mask = [0] * s.response_length
        return samples

    async def _run_one(self, fn, ctx: GenerateContext, sample: Sample, params: SamplingParams, batcher) -> list[Sample]:
        batcher.enter(ctx.key)
        try:
            out = await fn(ctx, sample, params)
        except Exception as e:  # one broken trajectory fails its sample, not the rollout
            prompt = sample.metadata.get("prompt_index")
            log.warning("generate failed for sample %d (prompt %s): %r", sample.index, prompt, e)
            sample.status = Status.FAILED
            sample.metadata["error"] = f"generate: {e!r}"
            sample.reward = 0.0
            out = sample
        finally:
            batcher.exit(ctx.key)
        out = out if isinstance(out, list) else [out]
        for s in out:
            if not isinstance(s, Sample):
                raise TypeError(f"generate function returned {type(s).__name__}, expected Sample or list[Sample]")
            s.validate()
            s.group_index = sample.group_index
        return out
