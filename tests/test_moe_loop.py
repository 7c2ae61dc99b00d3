"""An MoE model (tiny Qwen3-MoE, and the hybrid tiny Qwen3-Next) through the whole GRPO loop: the
engine records the experts it chose, the samples carry them, and with `algo.routing_replay` the
trainer routes its forward with them, so it computes the policy that sampled."""

from __future__ import annotations

import pytest
from conftest import loop_config
from families import tiny_model

import tidal.loop
from tidal.moe import routing_tensor
from tidal.rollout.manager import RolloutManager


def saved(tmp_path_factory, tokenizer, family: str):
    path = tmp_path_factory.mktemp(f"tiny_{family}")
    tiny_model(family).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def spy_samples(monkeypatch) -> list:
    """Every rollout's samples, as the manager returns them to the loop."""
    seen = []
    real = RolloutManager.agenerate

    async def spy(self, *args, **kwargs):
        out = await real(self, *args, **kwargs)
        seen.extend(out)
        return out

    monkeypatch.setattr(RolloutManager, "agenerate", spy)
    return seen


# family, routing replay, MoE layers: tiny Qwen3-MoE (layer 0 dense, layer 1 MoE) and tiny
# Qwen3-Next (GDN, attention, GDN; MoE in layers 1 and 2: the engine's recurrent states and the
# trainer's packed rows meet routing replay); 4 experts, top-2 in both
RUNS = [("qwen3_moe", True, 1), ("qwen3_moe", False, 1), ("qwen3_next", True, 2)]


@pytest.mark.parametrize(("family", "replay", "layers"), RUNS, ids=["moe-replay", "moe-free", "hybrid-replay"])
def test_an_moe_model_trains_through_the_loop(
    tmp_path_factory, tokenizer, tmp_path, monkeypatch, family, replay, layers
):
    seen = spy_samples(monkeypatch)
    over = {"train.num_steps": 3, "train.global_batch_size": 16, "algo.routing_replay": replay}
    history = tidal.loop.train(loop_config(saved(tmp_path_factory, tokenizer, family), tmp_path, **over))
    assert len(history) == 3 and all(h["actor/grad_norm"] > 0 for h in history)
    # fp32 engine and trainer, the policy at the weights that sampled: the same log-probs
    assert all(h["actor/rollout_logprob_abs_diff"] < 1e-4 for h in history)
    assert len(seen) == 3 * 16
    if not replay:
        assert all(s.routed_experts is None for s in seen)  # nobody asked the engine for it
        return
    for s in seen:
        rec = routing_tensor(s.routed_experts)
        assert rec.shape == (len(s.tokens) - 1, layers, 2)  # every position recorded
        assert int(rec.min()) >= 0 and int(rec.max()) < 4
