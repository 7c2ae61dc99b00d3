"""The overlapped loop (overlap.mode one_step / full) on a tiny model: staleness 0 is the synchronous
loop exactly, no trained token is older than the bound, partial rollouts continue from their own
tokens, and a resumed run trains every prompt once; plus the buffer and the config checks."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import loop_config, make_model, make_tokenizer
from safetensors.torch import load_file

import tidal.loop
from tidal.adapters.async_engine import AsyncEngine
from tidal.contracts import GenerationOutput
from tidal.data.dataset import PromptRecord
from tidal.engine.llm_engine import LLMEngine
from tidal.options import ConfigError
from tidal.reward.options import RewardConfig
from tidal.rollout.buffer import Buffer, newest_first, oldest_version, reward_stratified
from tidal.rollout.manager import RolloutManager
from tidal.rollout.options import RolloutConfig
from tidal.rollout.overlap import mask_older_segments, staleness_metrics
from tidal.types import Sample, Status

# engine/: how much of the rollout running beside the trainer each step's read of the engine's
# counters finds done depends on timing
VOLATILE = ("time/", "perf/", "buffer/", "rollout/aborted", "rollout/resumed", "staleness/", "sync/", "engine/")


def stable(history):
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in history]


def trained_prompts(monkeypatch) -> list[list[int]]:
    """Records the prompt index of every sample each train step trains on."""
    seen: list[list[int]] = []
    real = tidal.loop.compute_advantages

    def spy(a_cfg, samples, *args, **kw):
        seen.append([s.metadata["prompt_index"] for s in samples])
        return real(a_cfg, samples, *args, **kw)

    monkeypatch.setattr(tidal.loop, "compute_advantages", spy)
    return seen


def test_staleness_zero_is_the_synchronous_loop(tiny_model_dir, tmp_path):
    sync = tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "sync", **{"train.num_steps": 3}))
    over = tidal.loop.train(
        loop_config(
            tiny_model_dir, tmp_path / "over",
            **{"train.num_steps": 3, "overlap.mode": "full", "overlap.max_staleness": 0},
        )
    )  # fmt: skip
    assert stable(over) == stable(sync)
    assert all(h["staleness/max"] == 0 for h in over)
    a = load_file(tmp_path / "sync/checkpoints/step_3/model.safetensors")
    b = load_file(tmp_path / "over/checkpoints/step_3/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], load_file(tiny_model_dir / "model.safetensors")[k]) for k in a)  # it trained


@pytest.mark.parametrize("mode,k", [("full", 2), ("one_step", 1)])
def test_no_trained_token_is_older_than_the_bound(tiny_model_dir, tmp_path, monkeypatch, mode, k):
    seen = []
    real = tidal.loop.compute_advantages

    def spy(a_cfg, samples, *args, **kw):
        seen.append([list(s.token_versions) for s in samples])
        return real(a_cfg, samples, *args, **kw)

    monkeypatch.setattr(tidal.loop, "compute_advantages", spy)
    cfg = loop_config(
        tiny_model_dir, tmp_path,
        **{"train.num_steps": 5, "overlap.mode": mode, "overlap.max_staleness": k, "algo.is_correction": "truncate"},
    )  # fmt: skip
    history = tidal.loop.train(cfg)
    assert len(seen) == 5
    for step, versions in enumerate(seen):
        ages = [step - v for vs in versions for v in vs if v >= 0]
        assert ages and 0 <= min(ages) and max(ages) <= k
        assert history[step]["staleness/max"] == max(ages)
    assert all(sum(h[f"staleness/share_{a}"] for a in range(k + 1)) == pytest.approx(1.0) for h in history)


def test_a_stale_loop_refuses_to_start_without_a_correction(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"algo.is_correction: overlap.mode full trains on tokens sampled by older"):
        loop_config(tiny_model_dir, tmp_path, **{"overlap.mode": "full", "overlap.max_staleness": 2})
    with pytest.raises(ConfigError, match=r"algo.is_correction: overlap.mode one_step"):
        loop_config(tiny_model_dir, tmp_path, **{"overlap.mode": "one_step"})
    with pytest.raises(ConfigError, match=r"overlap.partial_rollout: continuing an aborted request needs"):
        loop_config(
            tiny_model_dir, tmp_path,
            **{"overlap.mode": "full", "overlap.max_staleness": 0, "rollout.generate": "tools"},
        )  # fmt: skip


def test_resume_in_full_mode_trains_every_prompt_once(tiny_model_dir, tmp_path, monkeypatch):
    over = {"overlap.mode": "full", "overlap.max_staleness": 2, "algo.is_correction": "truncate"}
    seen = trained_prompts(monkeypatch)
    tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "whole", **{"train.num_steps": 6, **over}))
    whole = list(seen)
    seen.clear()
    cut = loop_config(tiny_model_dir, tmp_path / "cut", **{"train.num_steps": 3, "train.save_interval": 3, **over})
    tidal.loop.train(cut)
    state = __import__("json").loads((tmp_path / "cut/checkpoints/step_3/state.json").read_text())
    assert state["overlap"]["next_wave"] >= 3  # waves rolled out ahead are in the checkpoint
    more = loop_config(tiny_model_dir, tmp_path / "cut", **{"train.num_steps": 6, "train.save_interval": 3, **over})
    tidal.loop.train(more, resume=True)
    assert len(seen) == 6
    flat = [p for step in seen for p in step]
    # every prompt trained once per sample of its group, in the order the uninterrupted run took them
    assert [sorted(set(s)) for s in seen] == [sorted(set(s)) for s in whole]
    assert all(flat.count(p) == 4 for p in set(flat)) and len(set(flat)) == 6 * 4


class AbortingEngine:
    """A scripted engine whose first request for prompt i samples [10 + i, 20 + i] and is aborted
    (weights were on their way: the next version is 1); a continuation samples [30 + i] and stops."""

    def __init__(self):
        self.calls, self.weight_version = [], 0

    async def generate(self, input_ids, sampling, *, request_id=None, group=None):
        self.calls.append(list(input_ids))
        if len(input_ids) == 2:
            i = sampling.seed % 2  # the two samples of the group have distinct seeds
            return GenerationOutput([10 + i, 20 + i], [-1.0, -2.0], "abort", "", 0)
        i = input_ids[2] - 10
        assert sampling.max_new_tokens == 3  # what is left of 5
        return GenerationOutput([30 + i], [-3.0], "stop", "", 1)


def test_an_aborted_request_continues_from_its_own_tokens():
    engine = AbortingEngine()
    cfg = RolloutConfig(n_samples_per_prompt=2, max_new_tokens=5)
    manager = RolloutManager(engine, cfg, reward=RewardConfig(fn="exact_match"))
    manager.continue_partial = True
    rec = PromptRecord(index=0, prompt="p", text="p", input_ids=[1, 2], label="x")
    samples = manager.generate([rec], step=0)
    parity = [s.tokens[2] - 10 for s in samples]
    assert sorted(parity) == [0, 1]
    # each continuation asked for exactly the prompt + its own cut tokens, with what is left of the budget
    assert sorted(engine.calls) == [[1, 2], [1, 2], [1, 2, 10, 20], [1, 2, 11, 21]]
    for i, s in zip(parity, samples, strict=True):
        assert s.tokens == [1, 2, 10 + i, 20 + i, 30 + i] and s.token_versions == [0, 0, 1]
        assert s.rollout_log_probs == [-1.0, -2.0, -3.0] and s.loss_mask == [1, 1, 1]
        assert s.status == Status.COMPLETED and s.metadata["segments"] == 2 and s.weight_version == 0
    assert (manager.aborted, manager.resumed) == (2, 2)
    manager.close()


class HeldEngine(LLMEngine):
    """tidal's engine, held still after its `hold_after`-th step until the test lets it go."""

    def __init__(self, *args, hold_after: int, **kw):
        super().__init__(*args, **kw)
        import threading

        self.hold_after, self.reached, self.release = hold_after, threading.Event(), threading.Event()

    def step(self):
        out = super().step()
        if self.counters["steps"] == self.hold_after:
            self.reached.set()
            assert self.release.wait(60), "the test never released the engine"
        return out


def test_a_partial_rollout_on_the_real_engine_keeps_its_tokens_and_log_probs():
    """The overlapped loop's push with partial rollout, step by step on tidal's engine: pause,
    abort (the samples are sent again at once and wait), load version 1, resume."""
    tok = make_tokenizer()
    core = HeldEngine(make_model(), tok, dtype="float32", block_size=4, kv_cache_tokens=512, hold_after=5)
    engine = AsyncEngine(core)
    cfg = RolloutConfig(n_samples_per_prompt=2, max_new_tokens=12)
    manager = RolloutManager(engine, cfg, tok, reward=RewardConfig(fn="exact_match"))
    manager.continue_partial = True
    cut = []
    real = RolloutManager._call

    async def spy(self, fn, ctx, sample, params):
        if sample.response_length:  # a continuation: remember what it had
            cut.append((sample.index, list(sample.tokens), list(sample.rollout_log_probs)))
        return await real(self, fn, ctx, sample, params)

    RolloutManager._call = spy
    try:
        rec = PromptRecord(index=0, prompt="p", text="p", input_ids=tok.encode("hello"), label="x")
        rollout = manager.loop.submit(manager.agenerate([rec], step=0))
        assert core.reached.wait(60)  # five steps in: the prompt's prefill and four decodes

        async def queue_pause_and_abort():
            tasks = [asyncio.ensure_future(engine.pause()), asyncio.ensure_future(engine.abort())]
            await asyncio.sleep(0)  # both tasks ran to their first await: their commands are queued
            return tasks

        # Queued while the engine is held inside its fifth step, so it runs them before a sixth
        # (released first, the engine could take another step before the loop thread queued them).
        tasks = manager.loop.run(queue_pause_and_abort(), 60)
        assert len(engine._commands) == 2
        core.release.set()

        async def finish(tasks):
            return await asyncio.gather(*tasks)

        manager.loop.run(finish(tasks), 60)
        engine.load_weights(make_model(seed=1).named_parameters(), version=1, timeout=60)
        manager.loop.run(engine.resume(), 60)
        samples = rollout.result(60)
    finally:
        RolloutManager._call = real
        manager.close()
        engine.close()
    assert len(cut) == 2
    for index, tokens, logps in cut:
        s = samples[index]
        assert s.tokens[: len(tokens)] == tokens and s.rollout_log_probs[: len(logps)] == logps
        n_old = len(tokens) - len(rec.input_ids)
        assert n_old == 5 and s.token_versions == [0] * n_old + [1] * (s.response_length - n_old)
    assert (manager.aborted, manager.resumed) == (2, 2)


def group(versions, reward=0.0, mask=None):
    s = Sample(tokens=[1] + [5] * len(versions), response_length=len(versions), reward=reward)
    s.loss_mask = mask or [1] * len(versions)
    s.rollout_log_probs = [0.0] * len(versions)
    s.token_versions = versions
    return [s]


def test_buffer_filters_and_staleness_eviction():
    buf = Buffer(max_staleness=1)
    buf.add([group([0, 0]), group([1]), group([2, 1])])
    assert buf.get(4, step=2) is None and buf.evicted == 1  # version 0 is 2 behind step 2: too old
    assert [oldest_version(g) for g in buf.get(2, step=2)] == [1, 1]
    assert oldest_version(group([3, -1, 2], mask=[1, 0, 1])) == 2
    gs = [group([0]), group([2]), group([1])]
    assert newest_first(gs, 2, 3) == [1, 2]
    rs = [group([0], reward=r) for r in (0.9, 0.1, 0.5, 0.3)]
    assert reward_stratified(rs, 2, 0) == [1, 2]  # sorted 0.1, 0.3, 0.5, 0.9: every second one
    restored = Buffer()
    buf.add([group([4], reward=1.0)])
    restored.load_state_dict(buf.state_dict())
    assert [g[0].to_dict() for g in restored.groups] == [g[0].to_dict() for g in buf.groups]


def test_staleness_metrics_and_masking_older_segments():
    s = group([1, 1, -1, 3, 3], mask=[1, 1, 0, 1, 1])[0]
    m = staleness_metrics([s], step=3, max_staleness=2)
    assert m == {"staleness/mean": 1.0, "staleness/max": 2.0, "staleness/share_0": 0.5, "staleness/share_1": 0.0,
                 "staleness/share_2": 0.5}  # fmt: skip
    assert mask_older_segments([s]) == 2 and s.loss_mask == [0, 0, 0, 1, 1]
