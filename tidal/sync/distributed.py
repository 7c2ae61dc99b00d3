"""Weights to SGLang-protocol servers by broadcast over a process group (`distributed`), as slime
updates SGLang: the trainer is rank 0 of a group with every server's ranks
(`/init_weights_update_group`), and each push sends the weights in buckets: for each bucket it
posts the names, dtypes and shapes to every server (`/update_weights_from_distributed`) while it
broadcasts the bucket's tensors, one broadcast per tensor, in that order. Only the last bucket
carries the weight version and asks for a cache flush, so a server's version changes when the
whole push is in. tidal servers (their `/get_model_info` says `"engine": "tidal"`) are asked to
stage all buckets but the last and load everything at once (all or nothing), and are checked by
checksum; SGLang servers load bucket by bucket and are checked by version.

The sender is this process: an in-process `Actor`, or FSDP2 ranks behind `TrainerGroup`, whose
`named_weights` gathers the full weights here first. Every wait is bounded by the sync timeout;
a failure names the server, destroys the group, and the next push forms it again.

On GPUs the group is NCCL (`backend="nccl"`) and the trainer's tensors must be CUDA tensors; on
the CPU it is gloo. SGLang runs a model update only when no request is running (or generation is
paused): push between rollouts, or pause the servers first.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse

import torch

from tidal.adapters.client import TIDAL_SERVER, EngineClient, EngineError
from tidal.aio import LoopThread
from tidal.contracts import Trainer
from tidal.net import host_store, node_ip
from tidal.sync.base import PushBound, SyncError, check_engine
from tidal.sync.group import WeightGroup, join_weight_group
from tidal.sync.remote import _RemoteSync

log = logging.getLogger("tidal")

BUCKET_BYTES = 64 * 2**20
GROUP_NAME = "tidal-weights"
EXPLAIN_GRACE_S = 3.0  # after the broadcast fails, how long the servers get to report why


def buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors, about `bucket_bytes` each (a larger tensor goes alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return [b for b in out if b]


def _in_thread(fn: Callable[[], Any], name: str) -> asyncio.Future:
    """Run a blocking call on a daemon thread of its own (a collective stuck on a dead peer must
    not hold up the event loop's shutdown) and return a future of its result."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:  # handed to the waiting loop
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is gone: nobody waits any more
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


class DistributedSync(_RemoteSync):
    """Trainer (rank 0, this process) to SGLang-protocol servers by broadcast; see the module
    docstring. `clients` are the servers themselves (not a router): weight calls go to each."""

    transport = "distributed"

    def __init__(
        self,
        trainer: Trainer,
        clients: Sequence[EngineClient],
        timeout: float = 300.0,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        group_name: str = GROUP_NAME,
        backend: str = "gloo",
        master_address: str | None = None,
        check: bool = True,
        engines=None,
        loop: LoopThread | None = None,
        bound: PushBound | None = None,
    ) -> None:
        super().__init__(trainer, clients, timeout, check, engines, loop, bound)
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.backend = backend
        self.master_address = master_address
        self.group: WeightGroup | None = None
        self.members: list[str] = []  # the servers in the group, in rank order
        self._info: dict[str, tuple[bool, int]] = {}  # url -> (a tidal server, its ranks)
        self._deadline = 0.0

    # ---------------------------------------------------------------- push
    def push(self, version: int) -> dict[str, float]:
        if self._refresh() and self.group is not None:
            self._leave()  # the servers changed: a new group with those in service
        self._run(self._probe())
        dtypes = {self._dtypes.get(c.base_url) for c in self.active}
        dtype = dtypes.pop() if len(dtypes) == 1 else None  # one broadcast serves all: their common dtype
        named = [(n, t.detach().contiguous()) for n, t in self.trainer.named_weights(dtype)]
        parts = buckets(named, self.bucket_bytes)
        try:
            self._run(self._send(version, named, parts))
        except BaseException:
            self._leave()
            raise
        return {
            "sync/bytes": float(sum(t.numel() * t.element_size() for _, t in named)),
            "sync/tensors": float(len(named)),
            "sync/buckets": float(len(parts)),
            **self._confirmed(version),
        }

    async def _probe(self) -> None:
        """What each new server is: tidal (stages, reports checksums) or not, how many ranks it
        has in the group (SGLang: its tensor-parallel size), and its dtype."""
        new = [c for c in self.active if c.base_url not in self._info]

        async def one(c: EngineClient) -> None:
            try:
                model = await c.get_model_info()
                server = await c.get_server_info()
            except EngineError as e:
                raise SyncError(c.base_url, self.transport, f"asking what the server is failed: {e}") from e
            dtype = getattr(torch, str(model.get("dtype") or server.get("dtype")), None)
            self._dtypes[c.base_url] = dtype if isinstance(dtype, torch.dtype) else None
            self._info[c.base_url] = (model.get("engine") == TIDAL_SERVER, int(server.get("tp_size") or 1))

        try:
            await asyncio.gather(*(one(c) for c in new))
        finally:
            await self._close_clients()

    async def _send(self, version: int, named, parts) -> None:
        self._deadline = time.monotonic() + self.timeout
        try:
            if self.group is None:
                await self._connect()
            for i, part in enumerate(parts):
                await self._bucket(part, version if i == len(parts) - 1 else None)
            self._wants = {}
            await self._together({c.base_url: self._check(c, version, named) for c in self.active}, None, "checking")
        finally:
            self._wants = {}
            await self._close_clients()

    async def _bucket(self, part: list[tuple[str, torch.Tensor]], version: int | None) -> None:
        names = [n for n, _ in part]
        dtypes = [t.dtype for _, t in part]
        shapes = [tuple(t.shape) for _, t in part]
        last = version is not None
        left = self._left()
        calls = {
            c.base_url: c.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                self.group_name,
                weight_version=version,
                flush_cache=last,
                stage=not last and self._info[c.base_url][0],
                timeout=left,
                allow_older=last and self.may_go_back and self._info[c.base_url][0],  # tidal's field
            )
            for c in self.active
        }
        group = self.group
        assert group is not None

        def send() -> None:
            for _, t in part:
                group.broadcast(t)

        sent = _in_thread(send, "tidal-weight-broadcast")
        what = "loading the weights" if last else f"sending {len(part)} tensors"
        await self._together(calls, sent, what)

    async def _check(self, c: EngineClient, version: int, named) -> None:
        """The server's version, and for tidal servers its checksum against ours."""
        if self.check and self._info[c.base_url][0]:
            await self._verify(c, version, named)
            return
        try:
            got = await c.get_weight_version()
        except EngineError as e:
            raise SyncError(c.base_url, self.transport, f"checking the loaded weights failed: {e}") from e
        check_engine(c.base_url, self.transport, version, None, got, None)

    # ---------------------------------------------------------------- the group
    def _master(self) -> str:
        if self.master_address:
            return self.master_address
        hosts = {urlparse(c.base_url).hostname or "" for c in self.active}
        local = all(h == "localhost" or h.startswith("127.") for h in hosts)
        return "127.0.0.1" if local else node_ip()

    async def _connect(self) -> None:
        """Form the group: this process is rank 0, each server's ranks follow in order."""
        address = self._master()
        # served here and bound before the servers are told its port (`host_store`): a port chosen
        # free and bound a moment later can be taken meanwhile
        store = host_store(address, self._left())
        port = store.port
        offsets, world = {}, 1
        for c in self.active:
            offsets[c.base_url] = world
            world += self._info[c.base_url][1]
        left = self._left()

        async def stale(c: EngineClient) -> None:
            try:  # a group of this name left by an earlier run or a failed push
                await c.destroy_weights_update_group(self.group_name, timeout=c.control_timeout)
            except EngineError as e:
                if e.status != 400:  # 400: the server has no such group
                    raise

        await self._together({c.base_url: stale(c) for c in self.active}, None, "clearing an old weight group")
        calls = {
            c.base_url: c.init_weights_update_group(
                address, port, offsets[c.base_url], world, self.group_name, self.backend, timeout=left
            )
            for c in self.active
        }
        joined = _in_thread(
            lambda: join_weight_group(address, port, 0, world, self.group_name, self.backend, left, store=store),
            "tidal-weight-group",
        )
        await self._together(calls, joined, f"joining the weight group at {address}:{port}")
        self.group = joined.result()
        self.members = [c.base_url for c in self.active]
        log.info("weight group %r formed: %d servers, %d ranks", self.group_name, len(self.members), world)

    def _leave(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None
        self.members = []

    # ---------------------------------------------------------------- waiting
    def _left(self) -> float:
        return max(0.001, self._deadline - time.monotonic())

    async def _together(self, calls: dict[str, Any], local: asyncio.Future | None, what: str) -> None:
        """Await a call per server (by URL) and this process's part of a collective, within the
        push's deadline. A failure raises SyncError naming the server; when this process's part
        fails first, the servers get a moment to report what broke it (a server that died)."""
        tasks = {asyncio.ensure_future(coro): url for coro, url in ((v, k) for k, v in calls.items())}
        waiting: set[asyncio.Future] = set(tasks) | ({local} if local is not None else set())
        try:
            while waiting:
                done, waiting = await asyncio.wait(waiting, timeout=self._left(), return_when=asyncio.FIRST_EXCEPTION)
                if not done:
                    late = [tasks[t] for t in waiting if t in tasks] or await self._silent() or list(calls)
                    raise SyncError(", ".join(late), self.transport, f"{what} timed out after {self.timeout:g} s")
                for t in done:
                    if t.exception() is None:
                        continue
                    if t in tasks:
                        raise self._error(tasks[t], what, t.exception())
                    # our own broadcast broke: usually because a server went away; let it say so
                    rest = [x for x in waiting if x in tasks]
                    if rest:
                        more, _ = await asyncio.wait(rest, timeout=min(EXPLAIN_GRACE_S, self._left()))
                        for x in more:
                            if x.exception() is not None:
                                raise self._error(tasks[x], what, x.exception())
                    culprits = await self._silent() or list(calls)
                    raise SyncError(", ".join(culprits), self.transport, f"{what}: {t.exception()}")
        finally:
            for t in tasks:
                t.cancel()
            if local is not None:  # its error, if any, was reported through a server's or is moot now
                local.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _error(self, url: str, what: str, error: BaseException) -> SyncError:
        if isinstance(error, SyncError):
            return error
        return SyncError(url, self.transport, f"{what} failed: {error}")

    async def _silent(self) -> list[str]:
        """The servers that do not answer /health (they are what everyone waits for)."""

        async def one(c: EngineClient) -> str | None:
            try:
                await c.health()
            except EngineError:
                return c.base_url
            return None

        return [u for u in await asyncio.gather(*(one(c) for c in self.active)) if u]

    async def _close_clients(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)

    def close(self) -> None:
        """Destroy the group on the servers (best effort) and here."""
        if self.group is None:
            return

        async def main() -> None:
            calls = [c.destroy_weights_update_group(self.group_name, timeout=c.control_timeout) for c in self.active]
            await asyncio.gather(*calls, return_exceptions=True)
            await self._close_clients()

        try:
            self._run(main())
        finally:
            self._leave()
