"""SGLang's weight-update routes, as `tidal serve` answers them (the routes are listed in
`tidal.server.sglang`'s docstring). Every update is all or nothing: checked against the model
before any live weight changes. The broadcast ones are `tidal.server.weight_group`'s.

Every update route takes `weight_version` (an int >= 0, never older than the version held unless
the body says `allow_older: true`: `tidal.server.versions`). A refusal is answered in the one error
shape plus SGLang's `success: false` and `message`: 400 for a bad body, 503 while the engine is
asleep (`POST /resume_memory_occupation` first).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from tidal.adapters.client import WEIGHTS_CONTENT_TYPE, decode_tensors
from tidal.chat.body import Body
from tidal.chat.errors import ApiError, BadRequest
from tidal.chat.http_errors import error_response
from tidal.contracts import EngineUnavailable
from tidal.server.common import unavailable
from tidal.server.state import Served, State
from tidal.server.versions import not_older, weight_version


class DiskWeightsBody(Body):
    model_path: str
    weight_version: int | str | None = None
    allow_older: bool = False  # tidal's: the version may be older than the one held (a trainer that restarted)
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
    allow_older: bool = False  # tidal's: the version may be older than the one held (a trainer that restarted)
    load_format: str | None = None
    stage: bool = False  # tidal's: keep these tensors for the next call (a push in buckets, all or nothing)


class TensorWeightsBody(Body):
    tensors: str | None = None
    serialized_named_tensors: list[Any] | None = None  # SGLang's in-process handles: refused
    weight_version: int | str | None = None
    allow_older: bool = False  # tidal's: the version may be older than the one held (a trainer that restarted)
    flush_cache: bool = True
    stage: bool = False
    partial: bool = False  # tidal's: the update names only the tensors that changed (the delta transport)


def _succeeded(message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": True, "message": message, **extra})


def _refused(e: ApiError) -> JSONResponse:
    """The one error shape plus SGLang's `success` and `message`, which its weight clients read."""
    return error_response(e.status, str(e), e.kind, e.param, extra={"success": False, "message": str(e)})


def _check_awake(s: Served) -> None:
    """`EngineUnavailable` while the engine is asleep: refused before a body is decoded or a folder
    read (the engine thread refuses too, should it fall asleep meanwhile)."""
    if s.engine.asleep:
        raise EngineUnavailable("update_weights: the engine is asleep", "asleep")


async def _answered(
    load: Callable[[], Awaitable[JSONResponse]], on_refusal: Callable[[], Awaitable[None]] | None = None
) -> JSONResponse:
    """`await load()`, or its refusal in the weight routes' shape (503 for an engine asleep),
    after `await on_refusal()` when given."""
    try:
        return await load()
    except (EngineUnavailable, ApiError) as e:
        if on_refusal is not None:
            with contextlib.suppress(EngineUnavailable):  # a closed engine has nothing to drop
                await on_refusal()
        return _refused(unavailable(e) if isinstance(e, EngineUnavailable) else e)


routes = APIRouter()


@routes.post("/update_weights_from_disk")
async def update_weights_from_disk(body: DiskWeightsBody, s: State) -> JSONResponse:
    """Load the weights of a model folder, all or nothing."""
    return await _answered(lambda: _load_disk(body, s))


async def _load_disk(body: DiskWeightsBody, s: State) -> JSONResponse:
    engine = s.engine
    version = weight_version(body.weight_version)
    _check_awake(s)
    check = not_older(version, body.allow_older)
    check(engine.weight_version)  # refused before the folder is read; the engine thread checks again
    if body.abort_all_requests:
        await engine.abort(None)
    try:
        await engine.update_weights_from_disk(body.model_path, version, body.flush_cache, check)
    except EngineUnavailable:
        raise
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        raise BadRequest(f"model_path: cannot load {body.model_path}: {e}", "model_path") from None
    msg = f"loaded {body.model_path}; weight version {engine.weight_version}"
    return JSONResponse({"success": True, "message": msg, "weight_version": engine.weight_version})


async def _tensor_request(request: Request) -> tuple[TensorWeightsBody, bytes | None]:
    """An `/update_weights_from_tensor` call's options, and its body when that is the blob, in
    either form (`tidal.adapters.client`): the safetensors blob as the body
    (`WEIGHTS_CONTENT_TYPE`) with the options in the query string, or a JSON body with the blob as
    base64 in `tensors` (None returned for the body). A bad option or body raises what FastAPI
    raises for a bad body (a 400 naming the field)."""
    raw = await request.body()
    binary = request.headers.get("content-type", "").partition(";")[0].strip().lower() == WEIGHTS_CONTENT_TYPE
    try:
        if binary:
            # query values are text: `weight_version=7`, `stage=true` are read as the int and the bool
            return TensorWeightsBody.model_validate(dict(request.query_params), strict=False), raw
        # a JSON body of up to --max-weights-body-bytes: parsed off the event loop
        return await asyncio.to_thread(TensorWeightsBody.model_validate_json, raw), None
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _tensor_blob(body: TensorWeightsBody, raw: bytes | None) -> bytes | str:
    """The call's blob: the body itself, or JSON's base64 `tensors` (decoded with the tensors, off
    the event loop)."""
    if raw is not None:
        if body.tensors is not None or body.serialized_named_tensors is not None:
            raise BadRequest("tensors: give the blob as the body or as a JSON body's `tensors`, not both", "tensors")
        return raw
    if body.serialized_named_tensors is not None:
        raise BadRequest(
            "serialized_named_tensors: SGLang's format carries in-process tensor handles, which no other "
            "process can open; send tidal's (a safetensors blob, see tidal.adapters.client)"
        )
    if body.tensors is None:
        raise BadRequest(
            f"tensors: required (a base64 safetensors blob), or send the blob as the body ({WEIGHTS_CONTENT_TYPE})"
        )
    return body.tensors


def _decode_blob(blob: bytes | str) -> list:
    """The tensors of a blob, raw or (JSON's `tensors`) base64."""
    return decode_tensors(base64.b64decode(blob, validate=True) if isinstance(blob, str) else blob)


@routes.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request, s: State) -> JSONResponse:
    """Load (or stage, for the next call) tensors in tidal's wire format, all or nothing: a
    refused call drops the chunks staged before it too."""
    body, raw = await _tensor_request(request)
    return await _answered(lambda: _load_tensors(body, raw, s), s.engine.drop_staged)


async def _load_tensors(body: TensorWeightsBody, raw: bytes | None, s: State) -> JSONResponse:
    engine = s.engine
    blob = _tensor_blob(body, raw)
    version = weight_version(body.weight_version)
    _check_awake(s)
    check = not_older(version, body.allow_older)
    check(engine.weight_version)  # refused before the blob is decoded; the engine thread checks again
    try:
        named = await asyncio.to_thread(_decode_blob, blob)  # off the event loop
    except Exception as e:
        what = "a base64 safetensors blob" if isinstance(blob, str) else f"a safetensors blob ({WEIGHTS_CONTENT_TYPE})"
        raise BadRequest(f"tensors: not {what} ({type(e).__name__}: {e})") from None
    try:
        if body.stage:
            await engine.stage_weights(named)
        else:
            # null keeps the current version: a partial update (one chunk of several) is not a new version
            keep = engine.weight_version if version is None else version
            extra = {"partial": True} if body.partial else {}
            await engine.update_weights_from_tensors(named, keep, body.flush_cache, check, **extra)
    except EngineUnavailable:
        raise
    except (KeyError, ValueError, RuntimeError) as e:
        raise BadRequest(f"tensors: {e}", "tensors") from None
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
    return await _answered(lambda: _receive(body, s))


async def _receive(body: DistributedWeightsBody, s: State) -> JSONResponse:
    version = await s.receiver.update(
        body.names,
        body.dtypes,
        body.shapes,
        body.group_name,
        body.weight_version,  # judged once the tensors are received: the group stays in step
        flush_cache=body.flush_cache,
        stage=body.stage,
        abort_all=body.abort_all_requests,
        load_format=body.load_format,
        allow_older=body.allow_older,
    )
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
