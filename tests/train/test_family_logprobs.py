"""The trainer scores the engine's samples as the engine did, for every model family: a tiny
random model of each family samples 8 responses (two groups sharing a prompt, seeded, temperature
1) in tidal's engine, and the trainer's log-probs of the same tokens, packed (the group's prompt
stored once) and padded, equal the engine's within 1e-4 in fp32, for the MoE families also with
the engine's routing replayed. Sliding windows (prompts and responses outgrow them),
soft-capping and MoE routing are all inside that comparison."""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, MOE, tiny_model

from tidal.algo.options import AlgoConfig
from tidal.contracts import SamplingParams
from tidal.engine.llm_engine import LLMEngine
from tidal.moe import routing_record
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig
from tidal.types import Sample

PROMPTS = [[1, 5, 9, 33, 70, 8, 100, 11, 12], [7, 300, 17, 250, 99, 3, 64, 128, 190, 211, 16]]
GROUP = 4


pytestmark = pytest.mark.usefixtures("one_thread")


def engine_samples(family: str, routing: bool = False) -> list[Sample]:
    engine = LLMEngine(tiny_model(family), None, dtype="float32", block_size=4, kv_cache_tokens=512)
    prompts = [p for p in PROMPTS for _ in range(GROUP)]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=14, seed=i, return_routed_experts=routing)
        for i in range(len(prompts))
    ]
    outs = engine.generate_batch(prompts, params)
    samples = []
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        n = len(o.token_ids)
        samples.append(
            Sample(
                tokens=p + o.token_ids,
                response_length=n,
                loss_mask=[1] * n,
                rollout_log_probs=list(o.log_probs),
                group_index=i // GROUP,
                index=i,
            )
        )
        if routing:
            samples[-1].set_routed_experts(routing_record(o.routed_experts))
    return samples


def gap(actor: Actor, samples: list[Sample]) -> float:
    lp = actor.compute_log_probs(samples)
    worst = 0.0
    for i, s in enumerate(samples):
        diff = lp[i, : s.response_length] - torch.tensor(s.rollout_log_probs)
        worst = max(worst, float(diff.abs().max()))
    return worst


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_the_trainer_scores_engine_samples_as_the_engine_did(family, packing):
    samples = engine_samples(family)
    assert sum(s.response_length for s in samples) > 8 * 8  # most responses outgrow the windows
    cfg = TrainConfig(micro_batch_size=4, global_batch_size=8, dtype="float32", packing=packing)
    actor = Actor(tiny_model(family), cfg, AlgoConfig(), temperature=1.0)
    assert gap(actor, samples) < 1e-4


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_with_routing_replay_too(family, packing):
    """The engine's recorded experts, replayed by the trainer (`algo.routing_replay`)."""
    samples = engine_samples(family, routing=True)
    assert all(s.routed_experts is not None for s in samples)
    cfg = TrainConfig(micro_batch_size=4, global_batch_size=8, dtype="float32", packing=packing)
    actor = Actor(tiny_model(family), cfg, AlgoConfig(routing_replay=True), temperature=1.0)
    assert gap(actor, samples) < 1e-4
