"""Rollout overlapped with training (`overlap.mode: one_step | full`).

A worker thread rolls out one step's batch at a time (a *wave*: `collect`, with dynamic sampling
when it is on, seeded by the step it is for) into the buffer, while the trainer trains on an
earlier one. New weights reach the engine only through the weight-sync role, pushed by the
trainer's thread at a point the worker makes safe (`push`): between two waves, or, with partial
rollout, at once: the engine is paused, its in-flight requests are aborted and sent again at once
(each continuing from exactly the tokens it has, queued behind the pause), the weights load, and
the engine resumes, so every token keeps the version that sampled it. This works for every engine
behind the contract (in-process, Ray engine actors, remote servers, vLLM, SGLang).

Admission control bounds staleness: the wave for step w starts only while the engine's weights
are at least version w - K (K = `overlap.max_staleness`; 1 in one_step mode). Every token of it
is then sampled by version >= w - K, and FIFO trains it at step w, so no trained token is more
than K versions old. K = 0 is the synchronous loop, sample for sample.

At a checkpoint the worker finishes its wave and pauses; the buffer's waves (samples not yet
trained) and the prompt source's position are saved, so a resumed run trains every prompt once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tidal.aio import LoopThread
from tidal.algo.options import AlgoConfig
from tidal.contracts import Engine
from tidal.data.source import DataSource
from tidal.rollout.buffer import Buffer, load_buffer_filter
from tidal.rollout.collect import collect
from tidal.rollout.manager import RolloutManager
from tidal.rollout.options import OverlapConfig
from tidal.types import Sample
from tidal.utils import load_object

log = logging.getLogger(__name__)


def staleness_metrics(samples: list[Sample], step: int, max_staleness: int) -> dict[str, float]:
    """Trained tokens by how many versions older than the trainer (`step`) their weights were:
    `staleness/mean`, `staleness/max` and the share at each age 0..K (`staleness/share_<k>`)."""
    ages = [step - v for s in samples for v, m in zip(s.token_versions, s.loss_mask, strict=True) if m and v >= 0]
    if not ages:
        return {}
    out = {"staleness/mean": sum(ages) / len(ages), "staleness/max": float(max(ages))}
    for k in range(max(max_staleness, max(ages)) + 1):
        out[f"staleness/share_{k}"] = sum(a == k for a in ages) / len(ages)
    return out


def mask_older_segments(samples: list[Sample]) -> int:
    """`overlap.partial_loss: mask`: tokens sampled by an older version than the sample's newest
    are not trained on. Returns how many tokens were masked."""
    n = 0
    for s in samples:
        versions = [v for v in s.token_versions if v >= 0]
        if not versions:
            continue
        newest = max(versions)
        for i, v in enumerate(s.token_versions):
            if 0 <= v < newest and s.loss_mask[i]:
                s.loss_mask[i] = 0
                n += 1
    return n


def push_cutting_requests(
    engine: Engine, loop: LoopThread, push: Callable[[], dict[str, float]], timeout: float
) -> dict[str, float]:
    """A weight push that cuts the requests in flight (partial rollout): the engine pauses, its
    requests are aborted (their samples send them again at once, continuing from their tokens;
    they wait behind the pause), `push()` loads the new weights, and the engine resumes on them."""
    loop.run(engine.pause(), timeout, "pausing the engine for a weight push")
    try:
        loop.run(engine.abort(), timeout, "aborting the engine's requests for a weight push")
        return push()
    finally:
        loop.run(engine.resume(), timeout, "resuming the engine after a weight push")


class OverlappedRollout:
    """The rollout role of the overlapped loop: `next_batch(step)` for the trainer,
    `push(version, push_fn)` around its weight sync, `pause`/`state_dict`/`resume` for checkpoints."""

    def __init__(
        self,
        overlap: OverlapConfig,
        algo: AlgoConfig,
        num_steps: int,
        source: DataSource,
        manager: RolloutManager,
        start_step: int = 0,
        state: dict | None = None,
    ) -> None:
        """`num_steps` (`train.num_steps`): nothing is rolled out for a step that never trains;
        `algo` shapes each wave's samples (`tidal.rollout.collect`)."""
        o = self.overlap = overlap
        self.algo, self.source, self.manager = algo, source, manager
        self.engine: Engine = manager.engine
        self.k = 1 if o.mode == "one_step" else o.max_staleness
        self.partial = o.mode == "full" and o.partial_rollout
        manager.continue_partial = self.partial
        self.groups_per_step = manager.rollout.rollout_batch_size
        if o.buffer:
            self.buffer = load_object(o.buffer, callable_required=True)()
        else:
            self.buffer = Buffer(load_buffer_filter(o.buffer_filter), self.k)
        self.engine_version = start_step
        self.next_wave = start_step
        self.last_wave = num_steps - 1
        self.wave_metrics: dict[int, dict] = {}
        if state is not None:
            self.buffer.load_state_dict(state["buffer"])
            self.next_wave = int(state["next_wave"])
            self.wave_metrics = {int(k): v for k, v in state.get("wave_metrics", {}).items()}
        self._cv = threading.Condition()
        self._stop = self._pause = False
        self._pushing = False  # a weight push is under way: no wave starts
        self._busy = False  # a wave is being rolled out
        self._error: BaseException | None = None
        self.engine_idle = 0.0  # seconds the worker waited for admission since the last batch
        self._thread = threading.Thread(target=self._run, name="tidal-rollout", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the worker thread
    def _admitted(self) -> bool:
        return self.next_wave <= min(self.engine_version + self.k, self.last_wave)

    def _run(self) -> None:
        try:
            while True:
                t0 = time.perf_counter()
                with self._cv:
                    while not self._stop and (self._pause or self._pushing or not self._admitted()):
                        self._cv.wait()
                    if self._stop:
                        return
                    self.engine_idle += time.perf_counter() - t0
                    wave = self.next_wave
                    self._busy = True
                self.manager.aborted = self.manager.resumed = 0
                samples, metrics = collect(self.source, self.manager, wave, self.algo, self.manager.reward.key)
                metrics["rollout/aborted"] = float(self.manager.aborted)
                metrics["rollout/resumed"] = float(self.manager.resumed)
                groups: dict[int, list[Sample]] = {}
                for s in samples:
                    s.metadata["wave"] = wave
                    groups.setdefault(s.group_index, []).append(s)
                with self._cv:
                    self.buffer.add(list(groups.values()))
                    self.wave_metrics[wave] = metrics
                    self.next_wave = wave + 1
                    self._busy = False
                    self._cv.notify_all()
        except BaseException as e:  # the trainer hears of it at its next wait
            log.exception("rollout worker failed")
            with self._cv:
                self._error = e
                self._busy = False
                self._cv.notify_all()

    # ---------------------------------------------------------------- the trainer's side
    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollout worker failed: {self._error!r}") from self._error

    def next_batch(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """Step `step`'s groups (renumbered as one batch) and its metrics, waiting at most
        `overlap.wait_timeout` seconds for them."""
        t0 = time.perf_counter()
        deadline = t0 + self.overlap.wait_timeout
        with self._cv:
            while True:
                self._check()
                groups = self.buffer.get(self.groups_per_step, step)
                if groups is not None:
                    break
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(
                        f"waited {self.overlap.wait_timeout:g} s for the rollout of step {step}: the buffer holds "
                        f"{len(self.buffer)} of {self.groups_per_step} groups, the engine is at weight version "
                        f"{self.engine_version}, the worker is on wave {self.next_wave} (overlap.wait_timeout)"
                    )
                self._cv.wait(min(left, 1.0))
            waves = sorted({g[0].metadata.get("wave", step) for g in groups})
            metrics = dict(self.wave_metrics.pop(waves[0], {})) if waves else {}
            for w in waves[1:]:
                self.wave_metrics.pop(w, None)
            engine_idle, self.engine_idle = self.engine_idle, 0.0
        samples = []
        for g, group in enumerate(groups):  # groups may differ in size: index is the batch position
            for s in group:
                s.group_index, s.index = g, len(samples)
                samples.append(s)
        metrics.update(staleness_metrics(samples, step, self.k))
        if self.overlap.partial_loss == "mask":
            metrics["rollout/masked_older_tokens"] = float(mask_older_segments(samples))
        metrics["time/trainer_idle"] = time.perf_counter() - t0
        metrics["time/engine_idle"] = engine_idle
        metrics["buffer/groups"] = float(len(self.buffer))
        metrics["buffer/evicted"] = float(getattr(self.buffer, "evicted", 0))
        return samples, metrics

    def push(self, version: int, push_fn: Callable[[int], dict[str, float]]) -> dict[str, float]:
        """Run the weight sync `push_fn(version)` (on the caller's thread: the trainer's weights hold
        still) at a point that is safe for the rollout, and return its metrics.

        Without partial rollout that point is the end of the wave in flight (waited for, at most
        `overlap.wait_timeout`); no wave starts until the push is done. With partial rollout it is
        now: the engine pauses, its requests are aborted and continue from their tokens once the
        engine resumes on the new weights. `time/push_wait` in the metrics: seconds spent waiting
        for the wave."""
        loop, timeout = self.manager.loop, self.overlap.wait_timeout
        t0 = time.perf_counter()
        with self._cv:
            self._check()
            self._pushing = True
            if not self.partial and not self._cv.wait_for(lambda: not self._busy or self._error is not None, timeout):
                self._pushing = False
                self._cv.notify_all()
                raise TimeoutError(
                    f"waited {timeout:g} s for the rollout of wave {self.next_wave} to end before pushing weight "
                    f"version {version} (overlap.wait_timeout)"
                )
        waited = time.perf_counter() - t0
        try:
            self._check()
            if self.partial:
                metrics = push_cutting_requests(self.engine, loop, lambda: push_fn(version), timeout)
            else:
                metrics = push_fn(version)
        finally:
            with self._cv:
                self._pushing = False
                self._cv.notify_all()
        with self._cv:
            self.engine_version = version
            self._cv.notify_all()
        return {**metrics, "time/push_wait": waited}

    def pause(self, timeout: float | None = None) -> None:
        """Let the current wave finish, then hold: the buffer and source are then consistent."""
        timeout = self.overlap.wait_timeout if timeout is None else timeout
        with self._cv:
            self._pause = True
            if not self._cv.wait_for(lambda: not self._busy or self._error is not None, timeout):
                raise TimeoutError(f"waited {timeout:g} s for the rollout worker to finish wave {self.next_wave}")
            self._check()

    def resume(self) -> None:
        with self._cv:
            self._pause = False
            self._cv.notify_all()

    def state_dict(self) -> dict:
        """The buffer (finished, untrained groups) and the next wave; call between pause and resume."""
        return {
            "buffer": self.buffer.state_dict(),
            "next_wave": self.next_wave,
            "wave_metrics": {str(k): v for k, v in self.wave_metrics.items()},
        }

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=self.overlap.wait_timeout)
