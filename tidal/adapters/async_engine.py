"""An asyncio front for a step-based core engine: the `tidal.contracts.Engine` contract.

A core (`tidal.engine.llm_engine.LLMEngine`, vLLM's or transformers' behind their adapters) is
synchronous and single-threaded. `AsyncEngine` owns one background thread that makes every core
call: it runs queued commands (add a request, abort, update weights, ...) between steps and calls
`core.step()` while there is work and the engine is not paused. Callers in any asyncio event loop
await results through `concurrent.futures.Future`s, so several loops (or threads) can share one
engine. Requests join the running batch at the next step: continuous batching, per request.

Requests submitted in the same turn of a caller's event loop reach the engine thread as one
command, so they join the same step: a rollout that submits a whole batch at once gets the same
batch, step for step, whatever the thread timing (the same numerics, so the same tokens).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from torch import Tensor

from tidal.contracts import EngineCore, EngineUnavailable, RequestOutput, SamplingParams
from tidal.hardware import release_openmp_workers

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "CoreEngine", "EngineClosed"]

CoreEngine = EngineCore  # the name this module used before the contracts moved to tidal.contracts
VersionCheck = Callable[[int], None]  # called with the weight version held; raises to refuse an update


class EngineClosed(EngineUnavailable):
    """The engine was closed before the call could run or finish."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "closed")


def _resolve(fut: cf.Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Set a future's outcome unless it is already done (e.g. cancelled by its waiter)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except cf.InvalidStateError:
        pass


def _vocab_size(core: Any) -> int | None:
    """The number of token ids the core's model scores (its logits' width), when it says."""
    size = getattr(core, "vocab_size", None)
    for holder in (getattr(core, "model", None), core):
        if size is None:
            size = getattr(getattr(holder, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


class AsyncEngine:
    """Runs a core engine on a background thread; meets `tidal.contracts.Engine`, and every
    coroutine is safe from any event loop.

    `stats()`, `load()` and `weight_version` are plain (non-blocking) reads of values the engine
    thread keeps up to date; `stats()` is refreshed at most every `stats_interval_s` while busy.
    `call(fn)` runs `fn()` on the engine thread from synchronous code (no event loop needed).
    """

    def __init__(self, core: EngineCore, *, stats_interval_s: float = 0.25) -> None:
        self.core = core
        # Read-only attributes the HTTP layer needs; read once here, before the thread starts.
        self.tokenizer = core.tokenizer
        self.max_model_len: int = core.max_model_len
        self.dtype = getattr(core, "dtype", None)
        model = getattr(core, "model", None)
        if self.dtype is None and model is not None:
            self.dtype = next(model.parameters()).dtype
        self.vocab_size: int | None = _vocab_size(core)
        # whether a weight update may name only the tensors that changed (`partial=True`)
        self.partial_updates: bool = core.partial_updates
        self._weight_version: int = core.weight_version
        self._asleep = False  # between a sleep() and the next wake()
        self._stats_interval_s = stats_interval_s
        self._stats: dict = {}
        self._stats_at = 0.0
        self._cv = threading.Condition()
        self._commands: deque[tuple[Callable[[], Any], cf.Future]] = deque()
        self._pending: dict[str, cf.Future] = {}  # touched only on the engine thread
        self._streams: dict[str, list] = {}  # rid -> [on_tokens, tokens delivered]; engine thread
        self._adds: dict[asyncio.AbstractEventLoop, list] = {}  # this turn's requests, per caller loop
        self._paused = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tidal-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ plain reads
    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def asleep(self) -> bool:
        """Between `sleep()` and `wake()`: the core's memory is released."""
        return self._asleep

    @property
    def alive(self) -> bool:
        """False once closed or if the engine thread died."""
        return not self._closed and self._thread.is_alive()

    def load(self) -> int:
        """Number of unfinished requests (waiting, running or paused)."""
        return len(self._pending)

    def stats(self) -> dict:
        """The core's last stats snapshot plus the engine's own state."""
        return {**self._stats, "paused": self._paused, "load": self.load(), "weight_version": self._weight_version}

    # ------------------------------------------------------------------ requests
    async def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        on_tokens: Callable[[list[int], list[float], list], None] | None = None,
        images: Sequence | None = None,
    ) -> asyncio.Future:
        """Queue a request and return a future for its `RequestOutput`.

        Raises the core's ValueError (prompt too long, ...) here, so a server can tell a bad
        request from a failure while generating. Cancelling the returned future aborts the request.
        `on_tokens(ids, log_probs, top_logprobs)` is called on the engine thread with the tokens
        each step added (for streaming), the last time before the future resolves. `images`: a
        vision-language prompt's (`tidal.vision.Image`), for a core that runs them.
        """
        rid = request_id if request_id is not None else uuid.uuid4().hex
        done: cf.Future = cf.Future()
        added: cf.Future = cf.Future()
        loop = asyncio.get_running_loop()
        batch = self._adds.get(loop)
        if batch is None:  # the first request of this turn: the whole turn's requests go together
            batch = self._adds[loop] = []
            loop.call_soon(self._send_adds, loop)
        if images and not self.core.takes_images:
            raise ValueError(f"a prompt with images: {type(self.core).__name__} runs none (the tidal engine does)")
        extra = {"images": list(images)} if images else {}  # cores without images keep their signature
        batch.append((rid, list(prompt_ids), params, on_tokens, done, added, extra))
        try:
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:  # it may still be added: this abort is queued after the add
            self._submit(lambda: self._abort(rid))
            raise
        done.add_done_callback(lambda f: f.cancelled() and self._submit(lambda: self._abort(rid)))
        return asyncio.wrap_future(done)

    def _send_adds(self, loop: asyncio.AbstractEventLoop) -> None:
        batch = self._adds.pop(loop, [])

        def add_all() -> None:
            for rid, ids, params, on_tokens, done, added, extra in batch:
                try:
                    if rid in self._pending:
                        raise ValueError(f"request id {rid!r} is already in use")
                    self.core.add_request(rid, ids, params, **extra)
                except BaseException as e:  # this request's caller hears of it; the others go on
                    _resolve(added, exc=e)
                    continue
                self._pending[rid] = done
                if on_tokens is not None:
                    self._streams[rid] = [on_tokens, 0]
                _resolve(added, None)

        sent = self._submit(add_all)
        sent.add_done_callback(
            lambda f: f.exception() is not None and [_resolve(b[5], exc=f.exception()) for b in batch]
        )

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        group: Hashable | None = None,
        images: Sequence | None = None,
    ) -> RequestOutput:
        """Generate one response (the `Engine` contract); returns the core's `RequestOutput`
        (finish_reason "abort" if aborted). `group` is for engines with several servers: one
        engine shares a group's prompt through its prefix cache anyway."""
        return await (await self.add_request(input_ids, sampling, request_id, images=images))

    async def abort(self, request_id: str | None = None) -> list:
        """Abort one request (None = all); their `generate` calls resolve with the partial outputs."""
        return await self._call(lambda: self._abort(request_id))

    def abort_nowait(self, request_ids: Iterable[str]) -> cf.Future:
        """Queue the abort of these requests and return at once (a future of their outputs).

        For places that cannot await: the `finally` of a streamed response whose client went
        away runs in a cancelled task, where an awaited abort is cancelled before it is sent."""
        rids = list(request_ids)
        return self._submit(lambda: [out for rid in rids for out in self._abort(rid)])

    # ------------------------------------------------------------------ control
    async def pause(self) -> None:
        """Stop stepping after the current step; requests wait and nothing is lost."""

        def pause() -> None:
            self._paused = True

        await self._call(pause)

    async def resume(self) -> None:
        def resume() -> None:
            self._paused = False

        await self._call(resume)

    async def update_weights_from_tensors(
        self,
        named: Iterable[tuple[str, Tensor]],
        version: int | None = None,
        flush_cache: bool = True,
        check_version: VersionCheck | None = None,
        **kw: Any,
    ) -> None:
        """Load new weights between two steps (all or nothing; `kw` goes to the core, e.g.
        `share`); in-flight requests continue on the new weights. `check_version(held)` is called
        on the engine thread just before loading, with the version the engine holds then (no other
        update can come between); what it raises refuses the update, and the chunks staged for it
        are dropped, as when a load fails."""
        load = self.core.update_weights_from_tensors
        await self._call(lambda: self._update(load, named, version, flush_cache, kw, check_version))

    async def update_weights_from_disk(
        self, path: str, version: int | None = None, flush_cache: bool = True, check_version: VersionCheck | None = None
    ) -> None:
        """Load a model folder's weights between two steps (all or nothing); `check_version` as
        for `update_weights_from_tensors`."""
        load = self.core.update_weights_from_disk
        await self._call(lambda: self._update(load, str(path), version, flush_cache, {}, check_version))

    async def stage_weights(self, named: Iterable[tuple[str, Tensor]]) -> None:
        """Check tensors and keep them for the next `update_weights_from_tensors` (a chunked
        update: all or nothing)."""
        await self._call(lambda: self.core.update_weights_from_tensors(named, None, stage=True))

    async def drop_staged(self) -> None:
        """Forget the chunks staged for the next update (it was refused), as a failed load does."""
        await self._call(self._drop_staged)

    async def weights_checksum(self) -> str:
        return await self._call(self.core.weights_checksum)

    async def sleep(self) -> None:
        """Free the KV cache and weights (see `LLMEngine.sleep`)."""

        def sleep() -> None:
            self.core.sleep()
            self._asleep = True

        await self._call(sleep)

    async def wake(self) -> None:
        def wake() -> None:
            self.core.wake()
            self._asleep = False
            self._weight_version = self.core.weight_version

        await self._call(wake)

    async def flush_cache(self) -> bool:
        return bool(await self._call(self.core.flush_cache))

    async def get_stats(self) -> dict:
        """Fresh stats straight from the core (one trip through the engine thread)."""
        await self._call(self._refresh_stats)
        return self.stats()

    def call(self, fn: Callable[[], Any], timeout: float | None = None, what: str = "engine call") -> Any:
        """Run `fn()` on the engine thread between two steps and return its result, from
        synchronous code; at most `timeout` seconds (then TimeoutError naming `what`)."""
        fut = self._submit(fn)
        release_openmp_workers()  # this thread waits while the engine's computes
        try:
            return fut.result(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"{what}: the engine thread did not get to it within {timeout:g} s") from None

    def load_weights(
        self,
        named: Iterable[tuple[str, Tensor]],
        version: int | None = None,
        timeout: float | None = None,
        flush_cache: bool = True,
        checksum: bool = True,
        **kw: Any,
    ) -> tuple[int, str | None]:
        """`update_weights_from_tensors` from synchronous code (the weight-sync role, an engine
        actor); returns (the version, the checksum of the weights when asked) the core reports."""

        def load() -> tuple[int, str | None]:
            self._update(self.core.update_weights_from_tensors, named, version, flush_cache, kw)
            return self.core.weight_version, self.core.weights_checksum() if checksum else None

        return self.call(load, timeout, f"loading weight version {version}")

    def close(self, timeout: float = 10.0, close_core: bool = True) -> None:
        """Stop the engine thread; queued commands and unfinished requests fail with EngineClosed.
        Then the core is closed too when it can be (`close_core`): vLLM's holds process-wide state."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            close = getattr(self.core, "close", None)
            if close_core and close is not None and not self._thread.is_alive():
                close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    # ------------------------------------------------------------------ engine thread
    def _submit(self, fn: Callable[[], Any]) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._cv:
            if self._closed:
                fut.set_exception(EngineClosed("engine is closed"))
                return fut
            self._commands.append((fn, fut))
            self._cv.notify()
        return fut

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._submit(fn))

    def _update(
        self,
        load: Callable,
        source: Any,
        version: int | None,
        flush_cache: bool,
        kw: dict,
        check_version: VersionCheck | None = None,
    ) -> None:
        if check_version is not None:
            try:
                check_version(self.core.weight_version)
            except Exception:
                self._drop_staged()  # a refused update leaves nothing behind
                raise
        load(source, version, **kw)
        self._weight_version = self.core.weight_version
        if flush_cache:
            # Cached prefixes were computed with the old weights; the core may refuse while requests run.
            self.core.flush_cache()

    def _drop_staged(self) -> None:
        drop = getattr(self.core, "drop_staged", None)  # a core that stages nothing has none
        if drop is not None:
            drop()

    def _abort(self, request_id: str | None) -> list:
        if request_id is not None and request_id not in self._pending:
            return []
        outs = self.core.abort(request_id)
        self._finish(outs)
        # Any waiter the core returned nothing for must not hang.
        left = [request_id] if request_id is not None else list(self._pending)
        for rid in left:
            fut = self._pending.pop(rid, None)
            if fut is not None:
                _resolve(fut, exc=RuntimeError(f"request {rid!r} was aborted but the core returned no output"))
        return outs

    def _deliver(self, rid: str, ids: list[int], log_probs: list[float], tops: list | None) -> None:
        stream = self._streams.get(rid)
        if stream is None or len(ids) <= stream[1]:
            return
        k = stream[1]
        stream[1] = len(ids)
        try:
            stream[0](ids[k:], log_probs[k:], (tops or [])[k:])
        except Exception:
            log.exception("streaming callback of request %s failed", rid)

    def _finish(self, outs: Iterable[Any]) -> None:
        for out in outs:
            self._deliver(out.request_id, out.token_ids, out.log_probs, getattr(out, "top_logprobs", None))
            self._streams.pop(out.request_id, None)
            fut = self._pending.pop(out.request_id, None)
            if fut is not None:
                _resolve(fut, out)

    def _refresh_stats(self) -> None:
        self._stats = dict(self.core.stats())
        self._stats_at = time.monotonic()

    def _run(self) -> None:
        try:
            while True:
                has_work = self.core.has_unfinished()
                if not has_work and self._pending:
                    # A core bug must not leave waiters hanging forever.
                    self._fail_pending(RuntimeError("the core has no unfinished requests but returned no output"))
                busy = has_work and not self._paused
                if not busy:
                    self._safe(self._refresh_stats)
                    # the training loop's thread computes next: this thread's OpenMP workers would
                    # slow its parallel regions (`release_openmp_workers`)
                    release_openmp_workers()
                with self._cv:
                    if not busy:
                        self._cv.wait_for(lambda: self._commands or self._closed)
                    if self._closed:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, fut in commands:
                    if fut.set_running_or_notify_cancel():
                        try:
                            _resolve(fut, fn())
                        except BaseException as e:  # handed to the caller
                            _resolve(fut, exc=e)
                if not self._paused and self.core.has_unfinished():
                    self._step()
                    if time.monotonic() - self._stats_at > self._stats_interval_s:
                        self._safe(self._refresh_stats)
        except BaseException as e:  # never die silently with waiters attached
            log.exception("engine thread crashed")
            with self._cv:
                self._closed = True
            self._fail_all(EngineClosed(f"engine thread crashed: {e!r}"))
            raise
        self._fail_all(EngineClosed("engine is closed"))

    def _step(self) -> None:
        try:
            outs = self.core.step()
        except Exception as e:
            # We cannot tell which requests the failed step touched: fail every unfinished one
            # and clear them from the core, so the engine goes on serving new requests.
            log.exception("core.step() failed; failing %d unfinished request(s)", len(self._pending))
            # clear the core before waking the waiters, so none of them sees the failed requests
            self._safe(lambda: self.core.abort(None))
            self._fail_pending(e)
            return
        self._finish(outs)
        progress = getattr(self.core, "progress", None)
        for rid in list(self._streams) if progress is not None else []:
            now = progress(rid)
            if now is not None:
                self._deliver(rid, *now)

    def _safe(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception:
            log.exception("engine housekeeping call failed")

    def _fail_all(self, exc: BaseException) -> None:
        with self._cv:
            commands = list(self._commands)
            self._commands.clear()
        for _, fut in commands:
            _resolve(fut, exc=exc)
        self._fail_pending(exc)

    def _fail_pending(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        self._streams.clear()
        for fut in pending.values():
            _resolve(fut, exc=exc)
