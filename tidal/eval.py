"""Score a model on a prompt set with the run's reward: the check that a trained policy really
got better, not just its training-batch reward.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from tidal.config import Config
from tidal.convert import ensure_model, load_tokenizer
from tidal.data.load import load_data
from tidal.engine.factory import make_engine
from tidal.rollout.manager import RolloutManager
from tidal.rollout.rewards import scalar_reward
from tidal.types import Status


def evaluate(cfg: Config, model: str, num_prompts: int = 100, batch_size: int = 64) -> dict[str, float]:
    """Mean reward of `model` over the first `num_prompts` prompts of `cfg.data` (file order, no
    shuffle), sampling `cfg.rollout.n_samples_per_prompt` responses each with `cfg.rollout`."""
    model_dir = ensure_model(model)
    tokenizer = load_tokenizer(model_dir)
    records = load_data(cfg.data, tokenizer)[:num_prompts]
    engine = make_engine(cfg.rollout, model_dir, tokenizer, cfg.data.max_prompt_length, prompts=batch_size)
    rollout = RolloutManager(engine, cfg.rollout, tokenizer)
    samples = []
    for i in range(0, len(records), batch_size):
        samples += rollout.generate(records[i : i + batch_size], step=i)
    rewards = [scalar_reward(s, cfg.rollout.reward_key) for s in samples]
    return {
        "model": str(Path(model_dir)),
        "prompts": len(records),
        "samples": len(samples),
        "reward/mean": statistics.fmean(rewards),
        "response/length_mean": statistics.fmean(s.response_length for s in samples),
        "response/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        "response/failed_ratio": sum(s.status == Status.FAILED for s in samples) / len(samples),
    }
