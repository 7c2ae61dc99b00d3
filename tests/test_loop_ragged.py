"""Ragged groups through the whole loop: a generate function fans prompt k out into k % 3 + 1
samples, and the trainer gets every sample, unpadded, with per-prompt GRPO advantages."""

import math

import pytest
import torch
from conftest import loop_config

import tidal.loop
from tidal.rollout.manager import group_sizes
from tidal.train.actor import Actor
from tidal.types import Sample


async def fan_out(ctx, sample: Sample, sampling) -> list[Sample]:
    """Prompt k becomes k % 3 + 1 samples (1, 2 or 3), each one engine call."""
    out = []
    for _ in range(sample.metadata["prompt_index"] % 3 + 1):
        s = Sample(tokens=list(sample.tokens), label=sample.label, metadata=dict(sample.metadata))
        o = await ctx.generate(s.tokens, sampling)
        s.append_policy(o.token_ids, o.log_probs, o.weight_version)
        out.append(s)
    return out


async def odd_position(sample: Sample) -> float:
    """1 for odd batch positions: rewards known in advance whatever the model samples."""
    return float(sample.index % 2)


def test_ragged_fan_out_trains_with_per_prompt_advantages(tiny_model_dir, tmp_path, monkeypatch):
    seen: list[tuple[list[Sample], torch.Tensor]] = []
    train_sums = Actor.train_sums

    def spy(self, samples, advantages, *args, **kw):
        seen.append((list(samples), advantages.detach().clone()))
        return train_sums(self, samples, advantages, *args, **kw)

    monkeypatch.setattr(Actor, "train_sums", spy)
    cfg = loop_config(
        tiny_model_dir,
        tmp_path,
        **{
            "train.num_steps": 2,
            "train.global_batch_size": 4,
            "train.micro_batch_size": 2,
            "rollout.n_samples_per_prompt": 1,
            "rollout.generate": "test_loop_ragged:fan_out",
            "reward.fn": "test_loop_ragged:odd_position",
            "data.shuffle": False,
        },
    )
    history = tidal.loop.train(cfg)

    # step 1: prompts 0..3 give 1, 2, 3, 1 samples; every one reaches the trainer, in order
    samples, adv = seen[0]
    assert [s.metadata["prompt_index"] for s in samples] == [0, 1, 1, 2, 2, 2, 3]
    assert group_sizes(samples) == [1, 2, 3, 1]
    assert [s.index for s in samples] == list(range(7))
    assert adv.shape[0] == 7 and all(s.response_length >= 1 for s in samples)
    # rewards 0 | 1 0 | 1 0 1 | 0. [0], [0]: lone members, 0. [1, 0]: mean 1/2, std sqrt(1/2).
    # [1, 0, 1]: mean 2/3, std sqrt((1/9 + 4/9 + 1/9) / 2) = sqrt(1/3).
    h, t = 1 / math.sqrt(2), math.sqrt(1 / 3)
    expected = [0.0, 0.5 / h, -0.5 / h, (1 / 3) / t, (-2 / 3) / t, (1 / 3) / t, 0.0]
    for s, row, want in zip(samples, adv, expected, strict=True):
        trained = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert row[: s.response_length][trained].tolist() == pytest.approx([want] * int(trained.sum()), abs=1e-5)
        assert not row[: s.response_length][~trained].any() and not row[s.response_length :].any()
    # optimizer batches are whole prompts within 4 samples: [1, 2] | [3, 1] on step 1, and on step 2
    # (prompts 4..7: 2, 3, 1, 2 samples) [2] | [3, 1] | [2]
    assert group_sizes(seen[1][0]) == [2, 3, 1, 2]
    assert [row["actor/updates"] for row in history] == [2.0, 3.0]
    assert all(math.isfinite(row["actor/grad_norm"]) for row in history)
