"""SGLang's weight update by broadcast, as `tidal serve` answers it.

    POST /init_weights_update_group      {master_address, master_port, rank_offset, world_size, group_name, backend}
    POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, weight_version,
                                           abort_all_requests, load_format; tidal's own: stage}
    POST /destroy_weights_update_group   {group_name}

The trainer (rank 0) forms a process group with the server (`tidal.sync.group`, one rank here:
`rank_offset`), then for each call announces tensors by name, dtype and shape and broadcasts them
in that order, one broadcast per tensor. The server always receives every announced tensor (the
trainer broadcasts them whatever the server thinks of them, and a skipped one would shift every
later broadcast), then checks them against the model before any live weight changes: a call
loads all of its tensors or none. Names a call does not send keep their values, as in SGLang.

`stage: true` (tidal's extension, sent only to tidal servers) keeps a call's checked tensors for
the next call without it, which loads them all at once: a push in several buckets is then all or
nothing too. A call the server refuses before receiving (a malformed body) leaves the group out
of step with the trainer, so the group is destroyed; the trainer forms it again. What depends on
the engine (its state, the version it holds: `tidal.server.versions`) is judged once the tensors
are received, so such a refusal keeps the group in step; it drops what was staged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence

import torch

from tidal.adapters.async_engine import AsyncEngine
from tidal.chat.errors import ApiError, BadRequest
from tidal.contracts import EngineUnavailable
from tidal.engine.weights import WeightsError, check_named_tensors
from tidal.server.versions import not_older, weight_version
from tidal.sync.group import WeightGroup, join_weight_group

log = logging.getLogger("tidal.server")

GROUP_TIMEOUT_S = 600.0  # joining a group, and each broadcast on it (a trainer gone silent frees the server then)


def parse_dtype(name: str, field: str) -> torch.dtype:
    """`torch.<name>` for a dtype name as SGLang sends it ("bfloat16", "float32", ...)."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise BadRequest(f"{field}: {name!r} is not a torch dtype")
    return dtype


def receive(group: WeightGroup, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes) -> dict:
    """Receive one broadcast per announced tensor, in order."""
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(tuple(shape), dtype=dtype)
        group.broadcast(tensor)
        out[name] = tensor
    return out


class WithCurrent:
    """Tensors to load plus, for every parameter not among them, the model's own tensor (which
    the loader leaves as it is: the same storage). Iterated on the engine thread, so it reads the
    model between two engine steps. Lets a partial update through the all-or-nothing loader."""

    def __init__(self, model: torch.nn.Module, named: dict[str, torch.Tensor]) -> None:
        self.model, self.named = model, named

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.named.items()
        for name, param in self.model.named_parameters():
            if name not in self.named:
                yield name, param


class WeightReceiver:
    """The weight-update groups of one server, by name, and the tensors staged in each."""

    def __init__(self, engine: AsyncEngine, timeout: float = GROUP_TIMEOUT_S) -> None:
        self.engine = engine
        self.timeout = timeout
        self.groups: dict[str, WeightGroup] = {}
        self.staged: dict[str, dict[str, torch.Tensor]] = {}
        self.lock = asyncio.Lock()  # one call at a time: broadcasts must be received in the order sent

    @property
    def model(self) -> torch.nn.Module | None:
        return getattr(self.engine.core, "model", None)

    async def join(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> WeightGroup:
        if group_name in self.groups:
            raise BadRequest(f"group_name: a group {group_name!r} exists; destroy it first", "group_name")
        if backend not in ("gloo", "nccl"):
            raise BadRequest(f"backend: gloo or nccl, got {backend!r}", "backend")
        if backend == "nccl" and not torch.cuda.is_available():
            raise BadRequest("backend: nccl needs CUDA and this server has none; use gloo", "backend")
        if not 0 < rank_offset < world_size:
            raise BadRequest(f"rank_offset: {rank_offset} must be in [1, world_size={world_size})", "rank_offset")
        try:
            group = await asyncio.to_thread(
                join_weight_group,
                master_address,
                master_port,
                rank_offset,  # this server has one rank (SGLang: rank_offset + tp_rank)
                world_size,
                group_name,
                backend,
                self.timeout,
            )
        except (RuntimeError, ValueError, OSError) as e:
            raise BadRequest(
                f"init_weights_update_group: cannot join {group_name!r} at {master_address}:{master_port}: {e}"
            ) from None
        self.groups[group_name] = group
        self.staged[group_name] = {}
        return group

    def destroy(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        self.staged.pop(group_name, None)
        if group is None:
            raise BadRequest(f"group_name: no group {group_name!r} on this server", "group_name")
        group.close()

    def _drop(self, group_name: str, why: str) -> None:
        """Destroy a group that is out of step with the trainer (unless it is gone already)."""
        if group_name in self.groups:
            log.warning("weight group %r destroyed: %s", group_name, why)
            self.destroy(group_name)

    async def update(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        version: int | str | None,
        flush_cache: bool = True,
        stage: bool = False,
        abort_all: bool = False,
        load_format: str | None = None,
        allow_older: bool = False,
    ) -> int:
        """Receive one call's tensors, then stage them or load them (with the staged ones) as
        `version` (as the body gave it: judged after receiving); returns the weight version after
        the call."""
        if group_name not in self.groups:
            raise BadRequest(f"group_name: no group {group_name!r} on this server; call /init_weights_update_group")
        try:
            if load_format is not None:
                raise BadRequest(f"load_format: only the default (a broadcast per tensor) is served: {load_format!r}")
            if not len(names) == len(dtypes) == len(shapes):
                raise BadRequest(f"names: {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes")
            parsed = [parse_dtype(d, f"dtypes[{i}]") for i, d in enumerate(dtypes)]
            for i, shape in enumerate(shapes):
                if any(d < 0 for d in shape):
                    raise BadRequest(f"shapes[{i}]: negative size in {shape}")
        except BadRequest as e:
            self._drop(group_name, str(e))
            raise BadRequest(f"{e} (the group {group_name!r} is out of step and was destroyed)", e.param) from None
        async with self.lock:
            group = self.groups.get(group_name)
            if group is None:  # destroyed while this call waited for the one before it
                raise BadRequest(f"group_name: no group {group_name!r} on this server", "group_name")
            try:
                received = await asyncio.to_thread(receive, group, names, parsed, shapes)
            except RuntimeError as e:
                self._drop(group_name, str(e))
                raise ApiError(
                    f"update_weights_from_distributed: the broadcast on {group_name!r} failed ({e}); "
                    "the group was destroyed",
                    500,
                    "server_error",
                ) from None
            return await self._apply(group_name, received, version, flush_cache, stage, abort_all, allow_older)

    async def _apply(self, group_name, received, version, flush_cache, stage, abort_all, allow_older) -> int:
        model = self.model
        staged = self.staged[group_name]
        try:
            version = weight_version(version)
            if self.engine.asleep:  # its parameters are empty: every tensor would look the wrong shape
                raise EngineUnavailable("update_weights_from_distributed: the engine is asleep", "asleep")
            if stage:
                if model is not None:
                    check_named_tensors(model, received, complete=False, where="update_weights_from_distributed")
                staged.update(received)
                return self.engine.weight_version
            named = {**staged, **received}
            staged.clear()
            if abort_all:
                await self.engine.abort(None)
            load = WithCurrent(model, named) if model is not None else named.items()
            keep = self.engine.weight_version if version is None else version
            await self.engine.update_weights_from_tensors(load, keep, flush_cache, not_older(version, allow_older))
        except WeightsError as e:
            staged.clear()
            raise BadRequest(str(e), "names") from None
        except (ApiError, EngineUnavailable):
            staged.clear()  # a refused call drops what was staged for it: all or nothing
            raise
        return self.engine.weight_version

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy(name)
