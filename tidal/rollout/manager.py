"""RolloutManager: prompts in, scored `Sample`s out.

Each prompt is sampled `n_samples_per_prompt` times; every sample gets its own seed derived from
(base seed, step, sample index), so a rollout is reproducible whatever else runs (and a resumed
run samples exactly what an uninterrupted one would have).
"""

from __future__ import annotations

import asyncio

from tidal.config import RolloutConfig
from tidal.data.dataset import PromptRecord
from tidal.engine.base import Engine
from tidal.engine.sampling import SamplingParams
from tidal.rollout.rewards import get_reward_fn, score_samples
from tidal.types import Sample, Status

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def sample_seed(base: int, step: int, index: int) -> int:
    """A 63-bit seed unique to (base, step, index); a fixed mix, not Python's salted hash()."""
    x = (base * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) % (1 << 64)
    x ^= x >> 31
    return x % (1 << 63)


class RolloutManager:
    """Fans prompts out to an engine in groups, then scores every sample with the reward."""

    def __init__(self, engine: Engine, cfg: RolloutConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self.reward_fn = get_reward_fn(cfg.reward)

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
        n = self.cfg.n_samples_per_prompt
        prompts, params = [], []
        for g, rec in enumerate(records):
            for j in range(n):
                prompts.append(rec.input_ids)
                params.append(self.sampling_params(sample_seed(self.cfg.seed, step, first_index + g * n + j)))
        outs = self.engine.generate(prompts, params)
        samples = []
        for i, out in enumerate(outs):
            rec = records[i // n]
            r = len(out.token_ids)
            samples.append(
                Sample(
                    tokens=list(rec.input_ids) + list(out.token_ids),
                    response_length=r,
                    loss_mask=[1] * r,
                    rollout_log_probs=list(out.log_probs),
                    prompt=rec.text,
                    response=out.text,
                    label=rec.label,
                    status=FINISH_STATUS[out.finish_reason],
                    group_index=i // n,
                    index=i,
                    weight_version=out.weight_version,
                    metadata={**rec.metadata, "prompt_index": rec.index, "finish_reason": out.finish_reason},
                )
            )
        asyncio.run(score_samples(samples, self.reward_fn, timeout=self.cfg.reward_timeout))
        for s in samples:
            if s.status == Status.FAILED:  # nothing trustworthy to learn from
                s.loss_mask = [0] * s.response_length
        return samples
