"""Weights to engines behind HTTP: tensors in the request body (`http`, `delta`) or a safetensors
folder the servers read (`disk`, what SGLang and vLLM servers load)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tidal.adapters.client import DEFAULT_CHUNK_BYTES, EngineClient, EngineError, body_bytes, encode_tensors
from tidal.aio import LoopThread
from tidal.contracts import Trainer
from tidal.engine.weights import tensor_crc, weights_checksum
from tidal.sync.base import PushBound, SyncError, SyncSetup, check_engine, megabytes
from tidal.utils import atomic_directory


class _RemoteSync:
    """What the HTTP transports share. Each weight request is bounded by `bound` (base seconds plus
    its bytes at a minimum throughput, at most the sync timeout), so an engine that stops
    answering is found after one request's bound, named with the request it did not answer."""

    transport = "?"

    def __init__(
        self,
        trainer: Trainer,
        clients: Sequence[EngineClient],
        timeout: float,
        check: bool = True,
        engines=None,
        loop: LoopThread | None = None,
        bound: PushBound | None = None,
    ) -> None:
        self.trainer = trainer
        # the rollout role's event loop when given (one loop for every HTTP client of the run)
        self.loop = loop if loop is not None else LoopThread("tidal-sync")
        self._own_loop = loop is None
        self.clients = list(clients)
        self.active = list(clients)  # those a push goes to: the engines in service
        self.engines = engines  # the rollout role, when it takes failed engines out of service
        self.timeout = timeout
        self.bound = bound if bound is not None else PushBound(cap=timeout)
        self.check = check
        # Until a push is confirmed, this trainer may be behind what the servers hold (it restarted,
        # or resumed from a checkpoint behind servers that lived on): its pushes say `allow_older`,
        # which tidal's servers otherwise refuse. Later pushes only go forward.
        self.may_go_back = True
        self._dtypes: dict[str, torch.dtype | None] = {}
        self._wants: dict[torch.dtype, asyncio.Task] = {}  # per push: our checksum per engine dtype

    @classmethod
    def build(cls, setup: SyncSetup) -> _RemoteSync:
        """This transport to the servers of `setup.engines` (their URLs and API key), on the
        rollout role's event loop; `_options` adds what the transport takes besides."""
        timeout = setup.timeout
        clients = [EngineClient(u, timeout, api_key=setup.engines.api_key) for u in setup.engines.urls]
        kw = {"engines": setup.engines, "loop": setup.engines.loop, "bound": setup.bound}
        return cls(setup.trainer, clients, timeout=timeout, **cls._options(setup), **kw)

    @classmethod
    def _options(cls, setup: SyncSetup) -> dict:
        return {}

    def _run(self, coro, limit: float | None = None):
        # every wait inside is bounded (`_bounded`, `_each`, the transports' deadlines); this one
        # is a backstop
        limit = 3 * self.timeout if limit is None else limit
        return self.loop.run(coro, limit + 60, f"weight sync over {self.transport}")

    def _index(self, c: EngineClient) -> int:
        """The engine's index among the run's engines (as given, then restarted ones)."""
        return self.clients.index(c)

    async def _bounded(self, c: EngineClient, request: str, nbytes: int, call: Callable[[float], Awaitable[Any]]):
        """`await call(limit)`, `limit` being the bound of a request of `nbytes` bytes; when the engine
        does not answer within it, SyncError names the engine, the request, its bytes and the bound."""
        limit = self.bound.seconds(nbytes)
        try:
            return await call(limit)
        except EngineError as e:
            if not e.timed_out:
                raise
            raise SyncError(
                c.base_url,
                self.transport,
                f"{request} got no answer within {limit:.3g} s ({self.bound.explain(nbytes)}): the engine is "
                "stopped, stalled or slower than that",
                index=self._index(c),
            ) from None

    async def _engine_dtype(self, c: EngineClient) -> torch.dtype | None:
        if c.base_url not in self._dtypes:
            info = await self._bounded(
                c, "GET /get_model_info", 0, lambda t: c._request("GET", "/get_model_info", timeout=t)
            )
            dtype = getattr(torch, str(info.get("dtype")), None) if isinstance(info, dict) else None
            self._dtypes[c.base_url] = dtype if isinstance(dtype, torch.dtype) else None
        return self._dtypes[c.base_url]

    async def _verify(self, c: EngineClient, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """The engine's version, and its checksum against ours (tidal servers report one)."""
        try:
            if not self.check:
                got = await c.get_weight_version()
                check_engine(c.base_url, self.transport, version, None, got, None)
                return
            dtype = await self._engine_dtype(c)
            n = sum(t.numel() * t.element_size() for _, t in named)  # the engine hashes all its weights
            got_version, got_sum = await self._bounded(
                c,
                f"GET /get_weight_version?checksum=true (a checksum of {megabytes(n)})",
                n,
                lambda t: c.get_weight_checksum(timeout=t),
            )
        except EngineError as e:
            raise SyncError(
                c.base_url, self.transport, f"checking the loaded weights failed: {e}", index=self._index(c)
            ) from e
        want = None
        if dtype is not None:
            if dtype not in self._wants:
                self._wants[dtype] = asyncio.ensure_future(asyncio.to_thread(weights_checksum, named, dtype))
            want = await self._wants[dtype]
        check_engine(c.base_url, self.transport, version, want, got_version, got_sum)

    def _refresh(self) -> bool:
        """Let the rollout role recover engines, then push to those in service (a server the
        router took out stays out until it answers again, and then gets this push's weights).
        True when the set changed or a server came back."""
        if self.engines is None:
            return False
        recovered = self.engines.recover()  # a server restarted at the same URL is new to us too
        known = {c.base_url: c for c in self.clients}
        for url in self.engines.live_urls():  # a restarted engine listens at a new URL
            if url.rstrip("/") not in known:
                client = EngineClient(url, self.timeout, api_key=self.engines.api_key)
                self.clients.append(client)
                known[client.base_url] = client
        active = [known[u.rstrip("/")] for u in self.engines.live_urls()]
        if not active:
            why = "; ".join(self.engines.down().values()) or "none is in service"
            raise SyncError(", ".join(c.base_url for c in self.clients), self.transport, f"no engine to push to: {why}")
        changed = [c.base_url for c in active] != [c.base_url for c in self.active]
        self.active = active
        return changed or recovered

    async def _each(self, fn, what: str, limit: float | None = None) -> None:
        """Run `fn(client)` on every engine at once, each within `limit` seconds (default: the sync
        timeout; the requests inside have bounds of their own, which come first); the first failure
        raises `SyncError` naming its engine."""
        limit = self.timeout if limit is None else limit

        async def one(c: EngineClient) -> None:
            try:
                async with asyncio.timeout(limit):
                    await fn(c)
            except TimeoutError:
                raise SyncError(
                    c.base_url, self.transport, f"{what} timed out after {limit:.3g} s", index=self._index(c)
                ) from None
            except EngineError as e:
                raise SyncError(c.base_url, self.transport, f"{what} failed: {e}", index=self._index(c)) from e

        self._wants = {}
        try:
            await asyncio.gather(*(one(c) for c in self.active))
        finally:
            self._wants = {}
            await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)

    def _confirmed(self, version: int) -> dict[str, float]:
        """Every engine holds `version`: the rollout's engine reports it from now on. Returns the
        engines' failure counts so far (restarts, requests sent again to another server)."""
        self.may_go_back = False
        if self.engines is None:  # engines given as clients alone: nothing failed over
            return {"engines/restarts": 0.0, "engines/resent_requests": 0.0}
        return self.engines.confirmed(version)

    def before_train(self) -> None:
        pass  # the servers' engines keep what they hold: they are other processes

    def close(self) -> None:
        if self._own_loop:
            self.loop.close()


class HttpSync(_RemoteSync):
    """Tensors in tidal's wire format to `/update_weights_from_tensor` (tidal servers), in chunks of
    at most `chunk_bytes` of tensors (a larger tensor split into pieces, see
    `tidal.adapters.client`), all chunks but the last staged so a server loads all or nothing.
    A push whose largest body is over an engine's `tidal serve --max-weights-body-bytes` (which
    it reports) is refused before anything is sent.

    `delta`: send only the tensors whose bytes changed since the last push every engine confirmed
    (for slow links, and models with frozen parts: with LoRA, the merged targeted matrices), as a
    partial update (tidal's engine; vLLM's takes whole models); the first push, and any push after
    a failed one, sends everything."""

    @classmethod
    def _options(cls, setup: SyncSetup) -> dict:
        return {"delta": setup.transport.changed_only}

    def __init__(
        self,
        trainer: Trainer,
        clients: Sequence[EngineClient],
        timeout: float = 300.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        delta: bool = False,
        check: bool = True,
        engines=None,
        loop: LoopThread | None = None,
        bound: PushBound | None = None,
    ) -> None:
        super().__init__(trainer, clients, timeout, check, engines, loop, bound)
        self.transport = "delta" if delta else "http"
        self.chunk_bytes = chunk_bytes
        self.delta = delta
        self._sent: dict[str, int] | None = None  # tensor CRCs every engine holds
        self._limits: dict[str, int | None] = {}  # each engine's limit on a weight body, when it says

    def push(self, version: int) -> dict[str, float]:
        if self._refresh():
            self._sent = None  # an engine back in service needs every tensor
        named = [(n, t.detach()) for n, t in self.trainer.named_weights()]
        send = named
        crcs = {n: tensor_crc(t) for n, t in named} if self.delta else None
        if self.delta and self._sent is not None:
            send = [(n, t) for n, t in named if self._sent.get(n) != crcs[n]]
        self._sent = None  # until every engine confirms this push
        send = send or named[:1]  # nothing changed: one tensor still carries the new version
        partial = len(send) < len(named)
        blobs = list(encode_tensors(send, self.chunk_bytes))
        sizes = [body_bytes(b) for b in blobs]  # bytes on the wire
        # the last request has the engine load every staged chunk: it gets time for all of them
        loads = [*sizes[:-1], sum(sizes)]
        model_bytes = sum(t.numel() * t.element_size() for _, t in named)

        async def load(c: EngineClient) -> None:
            for i, blob in enumerate(blobs):
                last = i == len(blobs) - 1
                request = f"POST /update_weights_from_tensor (chunk {i + 1} of {len(blobs)}: {megabytes(sizes[i])}"
                request += f", then loading all {megabytes(loads[i])})" if last and len(blobs) > 1 else ")"

                def send(limit: float, blob=blob, last=last) -> Awaitable[None]:
                    return c.send_tensor_chunk(
                        blob,
                        version if last else None,
                        flush_cache=last,
                        timeout=limit,
                        partial=last and partial,
                        allow_older=last and self.may_go_back,
                    )

                try:
                    await self._bounded(c, request, loads[i], send)
                except EngineError as e:  # refused (a 4xx names the tensor) or lost: say which request
                    raise SyncError(c.base_url, self.transport, f"{request} failed: {e}", index=self._index(c)) from e
            await self._verify(c, version, named)

        # every engine takes bodies this large, or none is sent anything
        self._run(self._each(lambda c: self._check_body_limit(c, blobs), "asking the engine's weight body limit"))
        # a backstop over each engine's requests, each bounded on its own
        limit = sum(map(self.bound.seconds, loads)) + self.bound.seconds(model_bytes) + self.bound.seconds(0)
        self._run(self._each(load, "loading the weights", limit), limit)
        counts = self._confirmed(version)
        self._sent = crcs
        return {
            "sync/bytes": float(sum(t.numel() * t.element_size() for _, t in send)),
            "sync/tensors": float(len(send)),
            **counts,
        }

    async def _check_body_limit(self, c: EngineClient, blobs: list[str]) -> None:
        """`SyncError` when the largest of this push's bodies is over what the engine takes (`tidal
        serve --max-weights-body-bytes`, in /get_model_info; a server that does not say is sent the
        push, and answers a body too large with a 413)."""
        if c.base_url not in self._limits:
            info = await self._bounded(
                c, "GET /get_model_info", 0, lambda t: c._request("GET", "/get_model_info", timeout=t)
            )
            limit = info.get("max_weights_body_bytes") if isinstance(info, dict) else None
            self._limits[c.base_url] = limit if isinstance(limit, int) else None
        limit = self._limits[c.base_url]
        sizes = [body_bytes(b) for b in blobs]
        if limit is None or max(sizes) <= limit:
            return
        i = sizes.index(max(sizes))
        raise SyncError(
            c.base_url,
            self.transport,
            f"chunk {i + 1} of {len(blobs)} is a body of up to {sizes[i]} bytes (at most {self.chunk_bytes} bytes "
            f"of tensors and their header) and the engine takes weight bodies of at most {limit} bytes: start it with "
            f"`tidal serve --max-weights-body-bytes {sizes[i]}` or more (nothing of this push was sent)",
            index=self._index(c),
        )


class DiskSync(_RemoteSync):
    """The trainer writes a safetensors folder under `root` (on a filesystem every server can
    read) and each server loads it with `/update_weights_from_disk`; the folder of the previous
    version is removed once every server has moved on."""

    transport = "disk"

    @classmethod
    def _options(cls, setup: SyncSetup) -> dict:
        return {"root": setup.sync_dir}

    def __init__(
        self,
        trainer: Trainer,
        clients: Sequence[EngineClient],
        root: str | Path,
        timeout: float = 600.0,
        check=True,
        engines=None,
        loop: LoopThread | None = None,
        bound: PushBound | None = None,
    ) -> None:
        super().__init__(trainer, clients, timeout, check, engines, loop, bound)
        self.root = Path(root)
        self._last: Path | None = None

    def push(self, version: int) -> dict[str, float]:
        self._refresh()
        folder = self.root / f"weights_v{version}"
        if folder.exists():
            shutil.rmtree(folder)
        with atomic_directory(folder) as tmp:
            self.trainer.save_model(tmp)
        named = [(n, t.detach()) for n, t in self.trainer.named_weights()]
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))  # what each engine reads
        model_bytes = sum(t.numel() * t.element_size() for _, t in named)

        async def load(c: EngineClient) -> None:
            await self._bounded(
                c,
                f"POST /update_weights_from_disk ({folder}: {megabytes(size)})",
                size,
                lambda limit: c.update_weights_from_disk(folder, version, limit, self.may_go_back),
            )
            await self._verify(c, version, named)

        # a backstop over each engine's requests, each bounded on its own
        limit = self.bound.seconds(size) + self.bound.seconds(model_bytes) + self.bound.seconds(0)
        self._run(self._each(load, f"loading {folder}", limit), limit)
        counts = self._confirmed(version)
        if self._last is not None and self._last != folder:
            shutil.rmtree(self._last, ignore_errors=True)
        self._last = folder
        return {"sync/bytes": float(size), "sync/tensors": float(len(named)), **counts}

    def close(self) -> None:
        if self._last is not None:
            shutil.rmtree(self._last, ignore_errors=True)
        super().close()
