"""Rewards that hang, crash or fail everywhere: the process pool's timeout, retries with backoff,
the console's first error of each kind, and the failed-share stop."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import textwrap
import time

import pytest

from tidal.reward.failures import ErrorLog, TooManyFailedSamples, check_failed_ratio
from tidal.reward.pool import RewardPool, is_async_callable
from tidal.reward.score import get_reward_fn, score_samples
from tidal.types import Sample, Status

_counter = itertools.count()

SLOW_MODULE = """
import os
import time


def sleepy(sample):
    time.sleep(float(sample.label))
    return float(len(sample.response))


def meet(sample):
    # Mark this call started, then wait until `sample.label` calls have started: calls run one at
    # a time could never all get past this, however fast or slow the machine is.
    open(os.path.join(MARKERS, f"{sample.index}.{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(MARKERS)) < sample.label:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(os.listdir(MARKERS))} of {sample.label} calls ran at once")
        time.sleep(0.01)
    return float(len(sample.response))


def hang_once(sample):
    # the first call for a sample leaves a marker and hangs; the retry finds it and answers
    marker = os.path.join(MARKERS, f"{sample.index}.seen")
    if not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(1000)
    return 2.0
"""


@pytest.fixture
def slow_module(tmp_path, monkeypatch):
    name = f"tidal_test_slow_rewards_{next(_counter)}"
    (tmp_path / "markers").mkdir()
    source = textwrap.dedent(SLOW_MODULE).replace("MARKERS", repr(str(tmp_path / "markers")))
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def _samples(n: int, label) -> list[Sample]:
    return [Sample(response="x" * (i + 1), label=label, index=i) for i in range(n)]


def _started_pids(markers) -> set[int]:
    return {int(f.name.split(".")[1]) for f in markers.iterdir()}


def test_sync_rewards_run_concurrently_in_processes(slow_module, tmp_path):
    """16 sync rewards on 8 worker processes: 8 of them run at once, each in its own process."""
    fn = get_reward_fn(f"{slow_module}:meet", workers=8)
    assert isinstance(fn, RewardPool)
    try:
        samples = _samples(16, 8)
        assert asyncio.run(score_samples(samples, fn, timeout=120)) == 0, [s.metadata for s in samples]
        assert [s.reward for s in samples] == [float(i + 1) for i in range(16)]
        pids = _started_pids(tmp_path / "markers")
        assert len(pids) == 8 and os.getpid() not in pids
    finally:
        fn.close()


def test_sync_rewards_in_threads_are_concurrent_too(slow_module, tmp_path):
    fn = get_reward_fn(f"{slow_module}:meet", workers=0)
    assert not isinstance(fn, RewardPool)
    samples = _samples(16, 4)  # asyncio's default thread pool has at least 5 threads
    assert asyncio.run(score_samples(samples, fn, timeout=120)) == 0, [s.metadata for s in samples]
    assert [s.reward for s in samples] == [float(i + 1) for i in range(16)]
    assert _started_pids(tmp_path / "markers") == {os.getpid()}


def test_a_hanging_sync_reward_times_out_and_the_retry_succeeds(slow_module):
    fn = get_reward_fn(f"{slow_module}:hang_once", workers=2)
    try:
        samples = _samples(2, None)
        t0 = time.perf_counter()
        # the retry (in a new worker process) must finish within the timeout too: 5 s, not less, so
        # that a loaded machine does not miss it
        failed = asyncio.run(score_samples(samples, fn, timeout=5, retries=1, backoff=0.1))
        wall = time.perf_counter() - t0
        assert failed == 0, [s.metadata for s in samples]
        assert [s.reward for s in samples] == [2.0, 2.0]
        assert [s.metadata["reward_retries"] for s in samples] == [1, 1]
        assert 5.1 <= wall < 120, wall  # one timeout + 0.1 s backoff + the retry, not 1000 s
    finally:
        fn.close()


def test_a_hanging_sync_reward_fails_after_its_retries(slow_module):
    fn = get_reward_fn(f"{slow_module}:sleepy", workers=1)
    try:
        s = Sample(response="r", label=1000.0, index=3)
        errors = ErrorLog()
        t0 = time.perf_counter()
        assert asyncio.run(score_samples([s], fn, timeout=0.5, retries=2, backoff=0.05, errors=errors)) == 1
        # three tries of 0.5 s and backoffs of 0.05 and 0.1 s; the upper bound only says the 1000 s
        # sleep was stopped, generous for a loaded machine
        assert 1.65 <= time.perf_counter() - t0 < 120
        assert s.status == Status.FAILED and s.reward == 0.0
        assert s.metadata["error"] == "TimeoutError: reward did not finish within 0.5 s"
        assert s.metadata["reward_retries"] == 2
        assert errors.total == {"TimeoutError": 1}
        # the worker that hung was stopped; a fresh one answers
        ok = Sample(response="abc", label=0.0)
        assert asyncio.run(score_samples([ok], fn, timeout=60)) == 0 and ok.reward == 3.0
    finally:
        fn.close()


def test_retries_only_retryable_errors_with_exponential_backoff(monkeypatch):
    calls: dict[int, list[float]] = {}
    waits: list[float] = []
    sleep = asyncio.sleep

    async def recorded_sleep(delay, *args):
        waits.append(delay)
        return await sleep(delay, *args)

    monkeypatch.setattr(asyncio, "sleep", recorded_sleep)

    async def flaky(sample):
        calls.setdefault(sample.index, []).append(time.perf_counter())
        if sample.label == "value":
            raise ValueError("bad label")
        if len(calls[sample.index]) <= 2:
            raise ConnectionError("grader restarting")
        return 1.0

    samples = [Sample(index=0, label="conn"), Sample(index=1, label="value")]
    errors = ErrorLog()
    assert asyncio.run(score_samples(samples, flaky, retries=3, backoff=0.1, errors=errors)) == 1
    assert len(calls[0]) == 3 and samples[0].reward == 1.0 and samples[0].metadata["reward_retries"] == 2
    assert waits == [0.1, 0.2]  # the backoffs asked for; how long they took depends on the load
    gaps = [b - a for a, b in itertools.pairwise(calls[0])]
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2, gaps
    assert len(calls[1]) == 1 and "reward_retries" not in samples[1].metadata  # not retryable
    assert samples[1].metadata["error"] == "ValueError: bad label"
    assert errors.total == {"ValueError": 1}


def test_retries_exhausted_keep_the_last_error():
    async def down(sample):
        raise ConnectionError("grader unreachable")

    s = Sample(index=0)
    assert asyncio.run(score_samples([s], down, retries=2, backoff=0)) == 1
    assert s.metadata == {"reward_retries": 2, "error": "ConnectionError: grader unreachable"}
    with pytest.raises(ValueError, match="retries and backoff must be >= 0"):
        asyncio.run(score_samples([s], down, retries=-1))


def test_error_log_shows_the_first_of_each_kind_then_counts(caplog):
    errors = ErrorLog()
    samples = [Sample(index=i, metadata={"prompt_index": 40 + i // 2}) for i in range(5)]
    with caplog.at_level(logging.WARNING, logger="tidal"):
        errors.record(samples[0], ValueError("no answer"))
        errors.record(samples[1], ValueError("other text, same kind"))
        errors.record(samples[3], TimeoutError("reward did not finish within 2 s"))
        errors.flush()
        errors.record(samples[4], ValueError("again"))
        errors.flush()
        errors.flush()  # nothing new: nothing logged
    assert [r.getMessage() for r in caplog.records] == [
        "reward failed on sample 0 (prompt 40): ValueError: no answer "
        "(further ValueError errors are counted, not shown)",
        "reward failed on sample 3 (prompt 41): TimeoutError: reward did not finish within 2 s "
        "(further TimeoutError errors are counted, not shown)",
        "reward errors this step: ValueError x2, TimeoutError x1 (run total 3)",
        "reward errors this step: ValueError x1 (run total 4)",
    ]


def test_failed_ratio_threshold():
    samples = [Sample(index=i) for i in range(4)]
    samples[1].status = samples[2].status = Status.FAILED
    samples[1].metadata["error"] = "RuntimeError: grader crashed"
    check_failed_ratio(samples, 0.5)  # 2 of 4 is not more than half
    samples[3].status = Status.FAILED
    with pytest.raises(TooManyFailedSamples) as err:
        check_failed_ratio(samples, 0.5)
    assert str(err.value) == (
        "3 of 4 samples failed (75%), more than rollout.max_failed_ratio 0.5; "
        "first error (sample 1): RuntimeError: grader crashed"
    )
    check_failed_ratio(samples, 1.0)
    check_failed_ratio([], 0.0)


def test_async_callables_stay_on_the_event_loop():
    async def coro(sample):
        return 1.0

    class AsyncCall:
        async def __call__(self, sample):
            return 1.0

    assert is_async_callable(coro) and is_async_callable(AsyncCall())
    assert not is_async_callable(len) and not is_async_callable(lambda s: 1.0)


def test_a_pool_closed_after_its_first_reward_stops_its_workers_once_each_has_started(slow_module):
    """A short eval set closes its pool right after the first rewards, while other workers may
    still be starting: `close` waits for each to start (else it finds its pool's locks gone and
    prints a traceback), then stops them all."""
    pool = RewardPool(f"{slow_module}:sleepy", 3)
    (sample,) = _samples(1, 0)
    assert asyncio.run(pool(sample)) == 1.0
    pool.close()
    assert len(pool.started) == 3 and len(set(pool.started)) == 3 and os.getpid() not in pool.started
    for pid in pool.started:  # stopped, and reaped by the pool
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
