"""The rollout on the async, per-request engine contract, with tidal's real engine (tiny model):
a rollout submitted at once is the batch a batch call runs, step for step (so it repeats exactly
for fixed seeds); and no sample waits for another (no round barrier)."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import make_model, make_tokenizer

from tidal.adapters.async_engine import AsyncEngine
from tidal.contracts import Engine
from tidal.data.dataset import PromptRecord
from tidal.engine.llm_engine import LLMEngine
from tidal.reward.options import RewardConfig
from tidal.rollout.manager import RolloutManager, sample_seed
from tidal.rollout.options import RolloutConfig, SamplingConfig
from tidal.types import Sample

TOK = make_tokenizer()


def core():
    return LLMEngine(make_model(), TOK, dtype="float32", block_size=4, kv_cache_tokens=2048)


def records(n=4):
    texts = [f"question {i}: what is {i} + {i}?" for i in range(n)]
    return [PromptRecord(index=i, prompt=t, text=t, input_ids=TOK.encode(t), label="x") for i, t in enumerate(texts)]


CFG = RolloutConfig(n_samples_per_prompt=4, max_new_tokens=10)
GROUPS = {"sampling": SamplingConfig(seed=3), "reward": RewardConfig(fn="exact_match")}


def test_a_rollout_is_the_batch_call_step_for_step_and_repeats_exactly():
    engine = AsyncEngine(core())
    assert isinstance(engine, Engine)
    manager = RolloutManager(engine, CFG, TOK, **GROUPS)
    try:
        first = manager.generate(records(), step=1)
        steps = engine.core.counters["steps"]
        again = manager.generate(records(), step=1)
    finally:
        manager.close()
        engine.close()
    batch = core()
    params = [manager.sampling_params(sample_seed(3, 1, i)) for i in range(16)]
    ref = batch.generate_batch([r.input_ids for r in records() for _ in range(4)], params)
    assert [s.response_tokens for s in first] == [o.token_ids for o in ref] == [s.response_tokens for s in again]
    assert [s.rollout_log_probs for s in first] == [o.log_probs for o in ref]
    # the 16 requests joined the engine in one step, as the batch call's did: the same steps
    assert steps == batch.counters["steps"]
    assert batch.stats()["prefix_hit_blocks"] > 0  # a group's prompt blocks were shared


async def call_sleep_call(ctx, sample: Sample, sampling):
    """A generate function that samples, waits on its tool (here: until every other sample of the
    rollout is done), then samples again; its first call's tokens are its response."""
    out = await ctx.generate(sample.tokens, sampling)
    ctx.extra["first_done"] = time.monotonic()
    await ctx.extra["tool"]()
    again = await ctx.generate(sample.tokens, sampling)
    ctx.extra["second_call"] = time.monotonic()
    sample.append_policy(out.token_ids, out.log_probs, out.weight_version)
    sample.metadata["second"] = again.token_ids
    return sample


def test_single_turn_samples_do_not_wait_for_a_sample_on_its_tool():
    """16 single-turn samples and one whose tool returns only once those 16 are done: a round
    barrier would hold the 16 (or never end); per request they all finish first."""
    engine = AsyncEngine(core())
    cfg = RolloutConfig(n_samples_per_prompt=1, max_new_tokens=10)
    manager = RolloutManager(engine, cfg, TOK, **GROUPS)
    rows = records(17)
    rows[16].metadata["generate"] = "test_per_request:call_sleep_call"
    done_at: list[float] = []
    single = manager.generate_fn

    async def timed(ctx, sample, sampling):
        s = await single(ctx, sample, sampling)
        done_at.append(time.monotonic())
        if len(done_at) == 16:
            others_done.set()
        return s

    others_done = asyncio.Event()
    manager.generate_fn = timed
    manager.extra["tool"] = lambda: asyncio.wait_for(others_done.wait(), 120)
    try:
        samples = manager.generate(rows, step=0)
    finally:
        manager.close()
        engine.close()
    assert len(samples) == 17 and len(done_at) == 16
    assert max(done_at) <= manager.extra["second_call"]
    assert samples[16].response_length > 0 and samples[16].metadata["second"]


@pytest.mark.parametrize("bad", ["prompt", "seed"])
def test_one_bad_request_fails_its_sample_only(bad):
    """Requests that reach the engine in one command are still answered one by one: a request the
    engine refuses fails its own sample, and the others of the same turn run."""
    engine = AsyncEngine(core())
    manager = RolloutManager(engine, CFG, TOK, **GROUPS)
    rows = records(2)
    if bad == "prompt":
        rows[1].input_ids = [10_000]  # not in the vocabulary
    else:
        rows[1].input_ids = list(range(3, 3 + 600))  # longer than the model's 512 positions
    try:
        samples = manager.generate(rows, step=0)
    finally:
        manager.close()
        engine.close()
    failed = [s.index for s in samples if s.metadata.get("error")]
    assert failed == [4, 5, 6, 7]
    assert all(s.response_length > 0 for s in samples[:4])
