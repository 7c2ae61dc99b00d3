"""Weights by broadcast over a process group of their own: trainer rank 0 (rank 0 here) and every
engine (ranks 1..E); gloo on CPU, NCCL on GPU. Tensors travel in buckets of about `bucket_bytes`,
each one flat buffer in the engine's dtype; the engines load the whole set at once when the last
bucket has arrived, and report the version and checksum they hold.

The group is separate from the trainers' FSDP2 group (a process group over a TCP store of its
own, which the driver serves), so engines never join the trainers' collectives. Its backend
follows the device the ranks and engines compute on (`tidal.hardware.dist_backend`): gloo for
CPU tensors, NCCL for CUDA ones.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable, Sequence
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from tidal.engine.weights import StreamingChecksum
from tidal.hardware import CPU, is_cuda
from tidal.sync.base import SyncError, SyncSetup, check_engine

BUCKET_BYTES = 64 * 2**20


def join_group(init_method: str, rank: int, world: int, timeout_s: float, device: str | torch.device = CPU):
    """A process group of `world` ranks over the TCP store at `init_method` (tcp://host:port, served
    by the driver's `BroadcastSync`) for tensors on `device`; blocks until every rank has joined,
    at most `timeout_s`."""
    from tidal.net import join_store

    url = urlparse(init_method)
    store = join_store(init_method, timeout_s)
    if is_cuda(device):
        from tidal.sync.group import join_weight_group

        # torch's group helper builds NCCL groups; the store's port names the group apart from
        # the one it replaces after an engine restart
        name = f"tidal_broadcast_{url.port}"
        timeout = 2 * timeout_s + 30
        return join_weight_group(url.hostname, url.port, rank, world, name, "nccl", timeout, store=store).pg
    # gloo's own deadline is later than the sync's, so a stuck peer is found (and named) by the
    # caller's deadline rather than by a bare gloo error on whoever waited for it
    return dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=2 * timeout_s + 30))


def _buckets(shapes: Sequence[tuple[str, tuple[int, ...]]], itemsize: int, bucket_bytes: int) -> list[list[int]]:
    """Indices of consecutive tensors, about `bucket_bytes` each (one larger tensor goes alone)."""
    out: list[list[int]] = [[]]
    size = 0
    for i, (_, shape) in enumerate(shapes):
        n = itemsize
        for d in shape:
            n *= d
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return [b for b in out if b]


def send_weights(group, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = BUCKET_BYTES) -> str:
    """Rank 0: broadcast `named` (all one dtype) bucket by bucket, grouped as `_buckets` groups
    their shapes; returns their checksum. `named` is taken one tensor at a time (a generator that
    gathers each from the shards holds no more than a bucket and the next tensor at once)."""
    check = StreamingChecksum()
    bucket: list[torch.Tensor] = []
    size = 0
    for name, t in named:
        check.add(name, t)
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            group.broadcast(torch.cat([x.reshape(-1) for x in bucket]), 0).wait()
            bucket, size = [], 0
        bucket.append(t)
        size += n
    if bucket:
        group.broadcast(torch.cat([x.reshape(-1) for x in bucket]), 0).wait()
    return check.hexdigest()


def receive_weights(
    group,
    meta: Sequence[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    bucket_bytes: int = BUCKET_BYTES,
    device: str | torch.device = CPU,
) -> list[tuple[str, torch.Tensor]]:
    """Ranks 1..E: receive the broadcast described by `meta` (names and shapes, in order) into
    tensors on `device`."""
    out: list[tuple[str, torch.Tensor]] = []
    for idx in _buckets(meta, dtype.itemsize, bucket_bytes):
        sizes = [torch.Size(meta[i][1]).numel() for i in idx]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        group.broadcast(flat, 0).wait()
        for i, part in zip(idx, flat.split(sizes), strict=True):
            out.append((meta[i][0], part.view(meta[i][1])))
    return out


class BroadcastSync:
    """Trainer ranks (`TrainerGroup`) to engine actors (`EngineGroup`) by broadcast.

    Engines that take partial updates (tidal's) get every tensor on the first push (and the first
    after an engine was restarted), then only those training changes (with LoRA: the merged
    targeted matrices), each checked by the checksum of what was sent."""

    transport = "broadcast"

    @classmethod
    def build(cls, setup: SyncSetup) -> BroadcastSync:
        """Colocated engines sleep while the trainers train and wake with no weights: every push
        to them is whole."""
        return cls(setup.trainer, setup.engines, setup.timeout, partial=not setup.whole)

    def __init__(
        self, trainers, engines, timeout: float, bucket_bytes: int = BUCKET_BYTES, partial: bool = True
    ) -> None:
        """`partial` False: every push sends every tensor (colocated engines free their weights
        while the trainers train, so each push must fill them again)."""
        import ray

        self.trainers, self.engines = trainers, engines
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes
        self._join()
        self.dtype = ray.get(engines.actors[0].dtype.remote(), timeout=timeout)
        accepts = ray.get([a.partial_updates.remote() for a in engines.actors], timeout=timeout)
        self.partial = partial and all(accepts)
        self.meta: dict[bool, list[tuple[str, tuple[int, ...]]]] = {}  # changed_only -> (name, shape)s
        self._pushed = False  # every engine holds a whole push of this trainer's

    def _join(self) -> None:
        """A new process group of trainer rank 0 and the engines there are now (also after an
        engine was restarted or dropped: the old group still counts the dead one)."""
        from tidal.net import host_store, node_ip

        engines = self.engines
        self.names = [f"{u} (engine {i})" for i, u in enumerate(engines.urls)]
        world = 1 + len(engines.actors)
        # served from here, bound before the ranks are told its port (`host_store`); a new one
        # for each group, kept until the next replaces it
        self._store = host_store(node_ip(), self.timeout)
        init = f"tcp://{node_ip()}:{self._store.port}"
        refs = [self.trainers.ranks[0].join_weight_group.remote(init, world, self.timeout)]
        refs += [a.join_weight_group.remote(init, i + 1, world, self.timeout) for i, a in enumerate(engines.actors)]
        self._wait(refs, [self.trainers.rank_name(0), *self.names], "joining the weight-sync group")

    def _wait(self, refs: list, who: list[str], what: str) -> list:
        """Results of `refs` in order. A failure or the sync timeout raises SyncError naming whose
        it was; a process that died is named before the peers whose collective broke because of it
        (they fail first as often as not)."""
        import ray

        names = dict(zip(refs, who, strict=True))
        pending, deadline = list(refs), time.monotonic() + self.timeout
        failed: list[tuple[int, str, str]] = []  # (0 = died, 1 = error), name, detail
        while pending:
            wait = max(0.0, deadline - time.monotonic())
            if failed:  # a little longer for the death that caused the error to be reported
                wait = min(wait, 3.0)
            done, pending = ray.wait(pending, num_returns=1, timeout=wait)
            if not done:
                break
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                failed.append((0, names[done[0]], f"the process died ({type(e).__name__})"))
            except ray.exceptions.RayTaskError as e:
                failed.append((1, names[done[0]], f"failed: {getattr(e, 'cause', e)}"))
        if failed:
            _, name, detail = min(failed, key=lambda f: f[0])
            others = [n for _, n, _ in failed if n != name]
            also = f" (then also: {', '.join(others)})" if others else ""
            raise SyncError(name, self.transport, f"{what}: {detail}{also}")
        if pending:
            late = [names[r] for r in pending]
            silent = self._silent_engines()  # the one everyone waits on does not answer at all
            culprits = [n for n in late if n in silent] or late
            waiting = [n for n in late if n not in culprits]
            detail = f"{what} timed out after {self.timeout:g} s"
            if waiting:
                detail += f" (waiting with it: {', '.join(waiting)})"
            raise SyncError(", ".join(culprits), self.transport, detail)
        return ray.get(refs)

    def _silent_engines(self, timeout: float = 2.0) -> set[str]:
        """Engines whose HTTP server does not answer /health within `timeout` seconds."""
        import httpx

        silent = set()
        for url, name in zip(self.engines.urls, self.names, strict=True):
            try:
                httpx.get(url + "/health", timeout=timeout).raise_for_status()
            except httpx.HTTPError:
                silent.add(name)
        return silent

    def push(self, version: int) -> dict[str, float]:
        """Recover failed engines first (`EngineGroup.recover`), so a restarted one is on `version`
        before it serves, then broadcast to every engine."""
        if self.engines.recover():
            self._join()
            self._pushed = False  # a restarted engine loaded the initial weights: it needs them all
        partial = self.partial and self._pushed
        if partial not in self.meta:
            self.meta[partial] = self.trainers.weight_shapes(partial)
        meta = self.meta[partial]
        sends = [r.broadcast_weights.remote(self.dtype, self.bucket_bytes, partial) for r in self.trainers.ranks]
        recvs = [a.receive_weights.remote(meta, version, self.bucket_bytes, partial) for a in self.engines.actors]
        who = [self.trainers.rank_name(i) for i in range(len(sends))] + self.names
        self._pushed = False  # until every engine confirms this one
        results = self._wait(sends + recvs, who, "the broadcast")
        want = results[0]
        for name, (got_version, got_sum) in zip(self.names, results[len(sends) :], strict=True):
            check_engine(name, self.transport, version, want, got_version, got_sum)
        self._pushed = True
        n = sum(torch.Size(s).numel() for _, s in meta)
        return {
            "sync/bytes": float(n * self.dtype.itemsize),
            "sync/tensors": float(len(meta)),
            **self.engines.confirmed(version),
        }

    def before_train(self) -> None:
        pass  # the engine actors keep what they hold: they are other processes

    def close(self) -> None:
        self._store = None  # stops serving the group's store
