"""SGLang's weight-update routes, as `tidal serve` answers them (the routes are listed in
`tidal.server.sglang`'s docstring). Every update is all or nothing: checked against the model
before any live weight changes. The broadcast ones are `tidal.server.weight_group`'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from tidal.adapters.client import decode_tensors
from tidal.chat.body import Body
from tidal.chat.errors import ApiError, BadRequest
from tidal.chat.http_errors import error_response
from tidal.server.state import State


class DiskWeightsBody(Body):
    model_path: str
    weight_version: int | str | None = None
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class InitGroupBody(Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"  # SGLang's default; tidal serves gloo (CPU)


class DestroyGroupBody(Body):
    group_name: str = "weight_update_group"


class DistributedWeightsBody(Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: int | str | None = None
    load_format: str | None = None
    stage: bool = False  # tidal's: keep these tensors for the next call (a push in buckets, all or nothing)


class TensorWeightsBody(Body):
    tensors: str | None = None
    serialized_named_tensors: list[Any] | None = None  # SGLang's in-process handles: refused
    weight_version: int | str | None = None
    flush_cache: bool = True
    stage: bool = False
    partial: bool = False  # tidal's: the update names only the tensors that changed (the delta transport)


def _version(value: int | str | None) -> int | None:
    """Weight versions are ints; SGLang clients send them as strings, so digits are accepted too."""
    if value is None or isinstance(value, int):
        return value
    try:
        return int(value)
    except ValueError:
        raise BadRequest(f"weight_version: must be an int, got {value!r}") from None


def _succeeded(message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": True, "message": message, **extra})


def _refused(e: ApiError) -> JSONResponse:
    """The one error shape plus SGLang's `success` and `message`, which its weight clients read."""
    return error_response(e.status, str(e), e.kind, e.param, extra={"success": False, "message": str(e)})


routes = APIRouter()


@routes.post("/update_weights_from_disk")
async def update_weights_from_disk(body: DiskWeightsBody, s: State) -> JSONResponse:
    """Load the weights of a model folder, all or nothing."""
    engine = s.engine
    version = _version(body.weight_version)
    if body.abort_all_requests:
        await engine.abort(None)
    try:
        await engine.update_weights_from_disk(body.model_path, version, flush_cache=body.flush_cache)
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        msg = f"model_path: cannot load {body.model_path}: {e}"
        return error_response(400, msg, param="model_path", extra={"success": False, "message": msg})
    msg = f"loaded {body.model_path}; weight version {engine.weight_version}"
    return JSONResponse({"success": True, "message": msg, "weight_version": engine.weight_version})


def _tensor_blob(body: TensorWeightsBody) -> str:
    """The base64 blob of an `/update_weights_from_tensor` body (tidal's format only)."""
    if body.serialized_named_tensors is not None:
        raise BadRequest(
            "serialized_named_tensors: SGLang's format carries in-process tensor handles, which no other "
            "process can open; send tidal's `tensors` (a base64 safetensors blob, see tidal.adapters.client)"
        )
    if body.tensors is None:
        raise BadRequest("tensors: required (a base64 safetensors blob)")
    return body.tensors


@routes.post("/update_weights_from_tensor")
async def update_weights_from_tensor(body: TensorWeightsBody, s: State) -> JSONResponse:
    """Load (or stage, for the next call) tensors in tidal's wire format, all or nothing."""
    engine = s.engine
    blob = _tensor_blob(body)
    # null keeps the current version: a partial update (one chunk of several) is not a new version.
    version = _version(body.weight_version)
    version = engine.weight_version if version is None else version
    try:
        named = await asyncio.to_thread(decode_tensors, blob)  # ~1 s per GB: off the event loop
    except Exception as e:
        raise BadRequest(f"tensors: not a base64 safetensors blob ({type(e).__name__}: {e})") from None
    try:
        if body.stage:
            await engine.stage_weights(named)
        else:
            extra = {"partial": True} if body.partial else {}
            await engine.update_weights_from_tensors(named, version, flush_cache=body.flush_cache, **extra)
    except (KeyError, ValueError, RuntimeError) as e:
        msg = f"tensors: {e}"
        return error_response(400, msg, param="tensors", extra={"success": False, "message": msg})
    what = "staged" if body.stage else "updated"
    msg = f"{what} {len(named)} tensors; weight version {engine.weight_version}"
    return JSONResponse({"success": True, "message": msg, "weight_version": engine.weight_version})


@routes.post("/init_weights_update_group")
async def init_weights_update_group(body: InitGroupBody, s: State) -> JSONResponse:
    """Join a trainer's process group for weights by broadcast."""
    body.warn_unknown("/init_weights_update_group")
    try:
        group = await s.receiver.join(
            body.master_address, body.master_port, body.rank_offset, body.world_size, body.group_name, body.backend
        )
    except ApiError as e:
        return _refused(e)
    return _succeeded(f"joined {group.name!r} as rank {group.rank} of {group.world_size}")


@routes.post("/update_weights_from_distributed")
async def update_weights_from_distributed(body: DistributedWeightsBody, s: State) -> JSONResponse:
    """Receive the announced tensors by broadcast and load (or stage) them, all or nothing."""
    body.warn_unknown("/update_weights_from_distributed")
    try:
        version = await s.receiver.update(
            body.names,
            body.dtypes,
            body.shapes,
            body.group_name,
            _version(body.weight_version),
            flush_cache=body.flush_cache,
            stage=body.stage,
            abort_all=body.abort_all_requests,
            load_format=body.load_format,
        )
    except ApiError as e:
        return _refused(e)
    what = "staged" if body.stage else "loaded"
    return _succeeded(f"{what} {len(body.names)} tensors; weight version {version}", weight_version=version)


@routes.post("/destroy_weights_update_group")
async def destroy_weights_update_group(body: DestroyGroupBody, s: State) -> JSONResponse:
    """Leave a weight-update group."""
    try:
        s.receiver.destroy(body.group_name)
    except ApiError as e:
        return _refused(e)
    return _succeeded(f"destroyed {body.group_name!r}")
