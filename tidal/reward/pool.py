"""Sync reward functions in worker processes, where a timeout can stop them.

A sync reward called on the event loop blocks every other sample (one at a time) and cannot be
interrupted, so `reward.timeout` could not hold. A thread pool would give concurrency but
a hung thread cannot be killed: it keeps its worker forever. Here each call runs in a process of a
`pebble.ProcessPool`; when the caller gives up (timeout, or the step is cancelled) the worker
running that call is terminated and the pool starts a fresh one.

What that asks of the reward: it is found by its dotted path in the worker (so it must be
importable, not defined in ``__main__``), the `Sample` and the result travel by pickle, and changes
the function makes to the sample are not seen by the caller. As with any multiprocessing code, a
script that starts training must guard its entry point (``if __name__ == "__main__":``): a new
worker imports the parent's main script (the `tidal` command is guarded).
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import os
import queue
import sys
import time
import weakref
from typing import Any

from tidal.types import Sample

__all__ = ["RewardPool", "is_async_callable"]

_FUNCTIONS: dict[str, Any] = {}  # per worker process: spec -> the loaded function


def is_async_callable(fn: Any) -> bool:
    """True for coroutine functions, partials of them, and objects with an async ``__call__``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


READY_TIMEOUT = 10.0  # seconds `close` waits for workers still starting before it stops them


def _init_worker(path: list[str], ready: Any = None) -> None:
    # the parent's import path, so a reward module found there (a tmp folder, a project) is found here
    sys.path[:] = path + [p for p in sys.path if p not in path]
    if ready is not None:
        ready.put(os.getpid())  # this worker has read what the parent sent it: see `_stop`


def _call(spec: str, sample: Sample) -> Any:
    """In the worker: load `spec` once, call it on `sample`."""
    from tidal.utils import load_object

    fn = _FUNCTIONS.get(spec)
    if fn is None:
        fn = _FUNCTIONS[spec] = load_object(spec, callable_required=True)
    result = fn(sample)
    if inspect.isawaitable(result):  # a sync callable that returned an awaitable
        result = asyncio.run(_await(result))
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable


class RewardPool:
    """`workers` processes calling the reward at dotted path `spec`; started on first use.

    Processes come from the ``forkserver`` start method: forking the trainer itself (threads, torch
    state, open sockets) is unsafe, and a fork server makes a new worker cheap after the first.
    """

    def __init__(self, spec: str, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"RewardPool needs at least 1 worker, got {workers}")
        self.spec = spec
        self.workers = workers
        self._pool = None

    def _get(self):
        if self._pool is None:
            from pebble import ProcessPool

            context = multiprocessing.get_context("forkserver")
            self.ready = context.Queue()  # the pid of each worker once it has started
            self.started: list[int] = []
            self._pool = ProcessPool(
                max_workers=self.workers,
                initializer=_init_worker,
                initargs=(list(sys.path), self.ready),
                context=context,
            )
            # the workers go when this pool object does (a finished rollout manager), or at exit
            self._finalizer = weakref.finalize(self, _stop, self._pool, self.ready, self.workers, self.started)
        return self._pool

    async def __call__(self, sample: Sample) -> Any:
        """The reward of `sample`, computed in a worker. Cancelling the await (a timeout) stops the
        worker running it. A worker that dies raises `pebble.ProcessExpired`."""
        future = self._get().schedule(_call, (self.spec, sample))
        try:
            return await asyncio.wrap_future(future)
        finally:
            if not future.done():
                future.cancel()  # pebble terminates the process running a cancelled task

    def close(self) -> None:
        """Stop the workers (a hung one included)."""
        if self._pool is not None:
            self._finalizer()
            self._pool = None


def _stop(pool, ready: Any, workers: int, started: list[int]) -> None:
    """Stop `pool` once each of its `workers` first workers has started (appending their pids to
    `started`), waiting at most READY_TIMEOUT. A worker is still reading what the parent sent it
    (its pool's locks among them) for a moment after `start()` returns; stopped and freed before
    that, the locks are gone and the worker prints a FileNotFoundError traceback (a short eval set
    closes its pool right after its first rewards)."""
    deadline = time.monotonic() + READY_TIMEOUT
    while len(started) < workers:
        try:
            started.append(ready.get(timeout=max(0.0, deadline - time.monotonic())))
        except queue.Empty:  # one that cannot start (its import path broken) is stopped as it is
            break
    pool.stop()
    pool.join(timeout=10)
    ready.close()
