"""The engines' counters as each step's `engine/*` metrics (`tidal.rollout.engine_stats`)."""

from __future__ import annotations

import asyncio
import logging

from conftest import loop_config

import tidal.loop
from tidal.adapters.client import HttpEngine
from tidal.rollout.engine_stats import EngineCounters, engine_metrics
from tidal.samples_log import read_samples


def _prompt_tokens(samples: list[dict]) -> tuple[int, int]:
    """(prompt tokens of every sample, of each distinct prompt once)."""
    distinct = {s["prompt"]: s["prompt_length"] for s in samples}
    return sum(s["prompt_length"] for s in samples), sum(distinct.values())


def test_each_step_logs_the_tokens_the_engine_computed_and_spared(tiny_model_dir, tmp_path):
    # 4 prompts x 4 samples a step: each prompt is computed once, its other samples take its
    # blocks from the prefix cache and copy the rest (no preemption: the cache holds them all)
    history = tidal.loop.train(loop_config(tiny_model_dir, tmp_path, **{"train.num_steps": 2}))
    saved = read_samples(tmp_path)
    for h in history:
        samples = saved[h["step"]]
        every, distinct = _prompt_tokens(samples)
        assert h["engine/prefill_tokens"] == distinct
        assert h["engine/cached_tokens"] == every - distinct
        # each token sampled is fed back once, except each sample's last
        assert h["engine/decode_tokens"] == sum(s["response_length"] - 1 for s in samples)
        assert h["engine/preemptions"] == 0
        assert h["engine/steps"] >= max(s["response_length"] for s in samples)
        assert h["engine/overlapped_steps"] == 0  # a CPU engine reads each step before the next


def test_a_kv_cache_too_small_for_the_batch_shows_as_preemptions_said_once(tiny_model_dir, tmp_path, caplog):
    # 6 blocks of 16 tokens: a prompt of 33 tokens and its 4 samples fill them at admission, and
    # a sample growing past its third block preempts the newest (computed again later)
    over = {"train.num_steps": 2, "engine.kv_cache_tokens": 96, "rollout.max_new_tokens": 32}
    with caplog.at_level(logging.WARNING, logger="tidal"):
        history = tidal.loop.train(loop_config(tiny_model_dir, tmp_path, **over))
    assert all(h["engine/preemptions"] > 0 for h in history)
    said = [r.getMessage() for r in caplog.records if "were preempted" in r.getMessage()]
    assert len(said) == 1 and "engine.kv_cache_tokens" in said[0]
    # preempted sequences' tokens are computed again: more than the samples hold
    for h in history:
        samples = read_samples(tmp_path)[h["step"]]
        every, _ = _prompt_tokens(samples)
        fed = every + sum(s["response_length"] - 1 for s in samples)
        assert h["engine/prefill_tokens"] + h["engine/cached_tokens"] + h["engine/decode_tokens"] > fed


def test_a_metric_is_the_growth_of_its_counters_and_a_restarted_engine_counts_from_zero():
    before = {"steps": 10, "prefill_tokens": 100, "prefix_hit_tokens": 32, "prefill_tokens_copied": 5}
    now = {"steps": 14, "prefill_tokens": 40, "prefix_hit_tokens": 48, "prefill_tokens_copied": 9, "paused": 0}
    assert engine_metrics(before, now) == {
        "engine/steps": 4.0,
        "engine/prefill_tokens": 40.0,  # went back: its engine started again, all 40 are new
        "engine/cached_tokens": 20.0,  # (48 - 32) + (9 - 5)
    }
    # vLLM's core counts its steps and cached prompt tokens only; nothing else is made up
    assert engine_metrics({}, {"steps": 3, "cached_prompt_tokens": 16, "generated_tokens": 40}) == {
        "engine/steps": 3.0,
        "engine/cached_tokens": 16.0,
    }


def test_servers_stats_are_summed_over_those_that_answer():
    engine = HttpEngine(["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"])
    answers = [
        {"model_path": "m", "steps": 3, "decode_tokens": 10, "paused": False, "kv_usage": 0.25},
        {"model_path": "m", "steps": 4, "decode_tokens": 20, "paused": True, "kv_usage": 0.5},
    ]

    def answer(i):
        async def info():
            if i == 2:
                raise ConnectionError("gone")
            return answers[i]

        return info

    for i, c in enumerate(engine.control.clients):
        c.get_server_info = answer(i)
    engine.control.down[1] = "taken out earlier"  # out of service: not asked
    assert asyncio.run(engine.get_stats()) == {"steps": 3, "decode_tokens": 10, "kv_usage": 0.25}
    engine.control.down.clear()
    assert asyncio.run(engine.get_stats()) == {"steps": 7, "decode_tokens": 30, "kv_usage": 0.75}


def test_an_engine_that_does_not_answer_costs_the_step_its_metrics_not_the_run(caplog):
    class Engines:
        answers = [
            {"steps": 2},
            TimeoutError("engine stats: the engine thread did not get to it within 60 s"),
            {"steps": 9},
        ]

        def stats(self):
            got = self.answers.pop(0)
            if isinstance(got, Exception):
                raise got
            return got

    counters = EngineCounters(Engines())
    with caplog.at_level(logging.WARNING, logger="tidal"):
        assert counters.read() == {}
    assert "no answer this step" in caplog.text and "within 60 s" in caplog.text
    assert counters.read() == {"engine/steps": 7.0}  # since the last read that answered

    # no answer at the start either: the first read that answers starts the count
    Engines.answers = [RuntimeError("engine closed"), {"steps": 5}, {"steps": 6}]
    counters = EngineCounters(Engines())
    assert counters.read() == {}
    assert counters.read() == {"engine/steps": 1.0}
