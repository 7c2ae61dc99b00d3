"""One long-lived asyncio event loop on a thread of its own, for the rollout role.

The training loop is synchronous; rollout (generate functions, rewards, HTTP clients, the agent
door) is asyncio. Every rollout call runs on this one loop, so connection pools and engine
clients live as long as the run instead of being rebuilt by an `asyncio.run` per call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from tidal.hardware import release_openmp_workers

T = TypeVar("T")

__all__ = ["LoopThread"]


class LoopThread:
    """An event loop running forever on a daemon thread; `run(coro)` from any other thread."""

    def __init__(self, name: str = "tidal-rollout") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def closed(self) -> bool:
        return self.loop.is_closed() or not self._thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
        """Schedule `coro` on the loop; returns a thread-safe future."""
        if self.closed:
            coro.close()
            raise RuntimeError("the rollout event loop is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None, what: str = "") -> T:
        """Run `coro` on the loop and wait for its result (at most `timeout` seconds: then it is
        cancelled and TimeoutError names `what`). Not from the loop's own thread: that would wait
        for itself."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop; await the coroutine instead")
        fut = self.submit(coro)
        release_openmp_workers()  # this thread waits while the rollout's engine computes
        try:
            return fut.result(timeout)
        except cf.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"{what or 'rollout call'}: no result within {timeout:g} s") from None
        except BaseException:
            fut.cancel()  # interrupted (Ctrl-C): do not leave the coroutine running
            raise

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what still runs on the loop, stop it and join the thread."""
        if self.closed:
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout)
        except (cf.TimeoutError, RuntimeError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
