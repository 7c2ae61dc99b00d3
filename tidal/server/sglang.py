"""SGLang's native API: `/generate` (with its sampling and output fields, streaming) and the
control routes a trainer drives (health, abort, pause/continue, weight updates, memory).

    POST /generate                   input_ids | text, sampling_params, return_logprob, top_logprobs_num,
                                     logprob_start_len (-1 only), return_text_in_logprobs, rid, stream;
                                     sampling_params.n > 1 answers a list of n samples per prompt
                                     (prompt-major, rids `{rid}_{j}`, seeds seed + j)
    GET  /health                     200 while the engine runs, else 503 (never behind the API key)
    GET  /health_generate            200 once the engine produces a token (or is busy producing them), else 503
    GET  /get_model_info             {"model_path", "tokenizer_path", "is_generation", "max_model_len", "dtype",
                                     "engine": "tidal", ...}
    GET  /get_load                   [{"dp_rank", "num_reqs", "num_waiting_reqs"}] (sglang-router reads it)
    GET  /get_weight_version         {"weight_version"}; ?checksum=true adds "weight_checksum" (CRC-32)
    GET  /get_server_info            engine stats
    POST /flush_cache                {"success"} (400 while requests run)
    POST /abort_request              {"rid"} or {"abort_all": true}
    POST /pause_generation           optional {"mode": "in_place" | "retract" | "abort"}
    POST /continue_generation
    POST /update_weights_from_disk   {"model_path", "weight_version"?, "flush_cache"?, "abort_all_requests"?}
    POST /update_weights_from_tensor tidal's format: {"tensors": base64 safetensors blob, "weight_version":
                                     int | null, "flush_cache", "stage"}; staged chunks load with the next
                                     unstaged one. SGLang's own format (`serialized_named_tensors`) carries
                                     in-process tensor handles and is refused with a 400 saying so.
    POST /release_memory_occupation, /resume_memory_occupation    free / take back KV cache and weights
    POST /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group
                                     weights by broadcast from a trainer (`tidal.server.weight_group`)

Every weight update is all or nothing: checked against the model before any live weight changes.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from tidal.adapters.async_engine import AsyncEngine
from tidal.adapters.client import decode_tensors, encode_routing
from tidal.chat.body import Body
from tidal.chat.errors import ApiError, BadRequest
from tidal.chat.http_errors import error_response
from tidal.chat.text import trim_stop
from tidal.engine.sampling import SamplingParams
from tidal.server.common import EventStream, Runner, Texts, check_budget, sampling_params
from tidal.server.options import ServerConfig
from tidal.server.weight_group import WeightReceiver

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's default for the same check


class SamplingParamsBody(Body):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # SGLang spells "off" as -1; 0 is accepted too
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's name for seed
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1  # samples of each prompt; with n > 1 the answer is a list, prompt-major


class GenerateBody(Body):
    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] = Field(default_factory=SamplingParamsBody)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False  # an MoE model's expert choices, as SGLang gives them
    rid: str | list[str] | None = None
    stream: bool = False


class AbortBody(Body):
    rid: str | None = None
    abort_all: bool = False


class PauseBody(Body):
    mode: Literal["in_place", "retract", "abort"] = "in_place"


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


def _params(sp: SamplingParamsBody, top: int, prefix: str, sample: int = 0) -> SamplingParams:
    """The engine's sampling parameters for sample `sample` of a prompt: a seeded request's
    sample j uses seed + j, so n samples differ and each is reproducible."""
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise BadRequest(f"{prefix}seed: give seed or sampling_seed, not two different values")
    seed = sp.seed if sp.seed is not None else sp.sampling_seed
    return sampling_params(
        prefix,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        max_new_tokens=sp.max_new_tokens,
        stop=sp.stop,
        stop_token_ids=sp.stop_token_ids,
        seed=None if seed is None else seed + sample,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        ignore_eos=sp.ignore_eos,
        top_logprobs=top,
    )


def _check_generate(body: GenerateBody) -> None:
    """BadRequest for a `/generate` body's fields that need no tokenizer or engine to judge."""
    body.warn_unknown("/generate")
    for sp in body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params]:
        sp.warn_unknown("/generate sampling_params")
    if body.logprob_start_len != -1:
        raise BadRequest(
            "logprob_start_len: only -1 (no prompt log-probs) is supported; the engine does not score prompts"
        )
    if not 0 <= body.top_logprobs_num <= 20:
        raise BadRequest(f"top_logprobs_num: must be in [0, 20], got {body.top_logprobs_num}")
    if (body.input_ids is None) == (body.text is None):
        raise BadRequest("input_ids: give exactly one of input_ids and text")


def _samples(
    body: GenerateBody, prompts: list[list[int]], batched: bool, cfg: ServerConfig
) -> tuple[list[list[int]], list[SamplingParams], list[SamplingParamsBody], list[str]]:
    """(prompt, engine parameters, body parameters, rid) of every sample a `/generate` request
    asks for: `sampling_params.n` samples of each prompt, prompt-major (SGLang's order). A given
    rid names a prompt's only sample, or its samples `{rid}_0` ... `{rid}_{n-1}`."""
    if not prompts or any(not p for p in prompts):
        raise BadRequest("input_ids: empty prompt")
    count = len(prompts)
    if count > cfg.max_batch:
        raise BadRequest(f"input_ids: {count} prompts; this server takes at most {cfg.max_batch} per request")
    many = isinstance(body.sampling_params, list)
    sps = body.sampling_params if many else [body.sampling_params] * count
    if len(sps) != count:
        raise BadRequest(f"sampling_params: {len(sps)} given for {count} prompts")
    n = sps[0].n
    if any(sp.n != n for sp in sps):
        raise BadRequest(f"sampling_params.n: must be the same for every prompt, got {sorted({sp.n for sp in sps})}")
    if not 1 <= n <= cfg.max_n:
        raise BadRequest(f"sampling_params.n: must be between 1 and {cfg.max_n} on this server, got {n}")
    if body.rid is None:
        names = [uuid.uuid4().hex for _ in range(count)]
    elif isinstance(body.rid, list) != batched or (batched and len(body.rid) != count):
        raise BadRequest(f"rid: give one rid per prompt ({count}) as {'a list' if batched else 'a string'}")
    else:
        names = list(body.rid) if isinstance(body.rid, list) else [body.rid]
    top = body.top_logprobs_num if body.return_logprob else 0
    out: tuple[list, list, list, list] = ([], [], [], [])
    for i, (prompt, sp, name) in enumerate(zip(prompts, sps, names, strict=True)):
        prefix = f"sampling_params[{i}]." if many else "sampling_params."
        for j in range(n):
            out[0].append(prompt)
            out[1].append(_params(sp, top, prefix, j))
            out[1][-1].return_routed_experts = body.return_routed_experts
            out[2].append(sp)
            out[3].append(name if n == 1 else f"{name}_{j}" if body.rid is not None else uuid.uuid4().hex)
    check_budget(cfg, out[0], out[1])
    return out


def router(engine: AsyncEngine, model_name: str, cfg: ServerConfig, texts: Texts | None = None) -> APIRouter:
    """SGLang's routes over `engine`; `texts` tokenises (shared with the other routes, so its
    limit on text being tokenised at once holds server-wide)."""
    api = APIRouter()
    runner = Runner(engine)
    texts = texts or Texts(engine.tokenizer, engine.max_model_len, cfg)
    receiver = WeightReceiver(engine)
    tok = engine.tokenizer

    def piece(t: int, with_text: bool) -> str | None:
        return tok.decode([t]) if with_text and tok is not None else None

    def result(out: Any, body: GenerateBody, sp: SamplingParamsBody) -> dict:
        # the engine's text skips special tokens; decode again only when they are wanted
        text = out.text if sp.skip_special_tokens or tok is None else tok.decode(out.token_ids)
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        if out.finish_reason == "stop" and stops and not sp.no_stop_trim:
            text = trim_stop(text, stops)
        meta: dict[str, Any] = {
            "id": out.request_id,
            "finish_reason": {"type": out.finish_reason},
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(out.token_ids),
            "cached_tokens": out.cached_tokens,
            "weight_version": out.weight_version,
        }
        if body.return_logprob:
            with_text = body.return_text_in_logprobs
            meta["output_token_logprobs"] = [
                [lp, t, piece(t, with_text)] for lp, t in zip(out.log_probs, out.token_ids, strict=True)
            ]
            meta["input_token_logprobs"] = []
            if body.top_logprobs_num:
                meta["output_top_logprobs"] = [
                    [[lp, t, piece(t, with_text)] for t, lp in alts] for alts in (out.top_logprobs or [])
                ]
        if body.return_routed_experts and out.routed_experts is not None:
            meta["routed_experts"] = encode_routing(out.routed_experts)
        return {"text": text, "output_ids": list(out.token_ids), "meta_info": meta}

    @api.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return error_response(503, "the engine thread is not running", "server_error")
        return JSONResponse({"status": "ok"})

    @api.get("/get_model_info")
    async def model_info() -> dict:
        return {
            "model_path": model_name,
            "tokenizer_path": model_name,
            "is_generation": True,
            "max_model_len": engine.max_model_len,
            "weight_version": engine.weight_version,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "engine": "tidal",  # a trainer's cue for tidal's extensions (staged updates, weight checksums)
        }

    @api.get("/health_generate")
    async def health_generate() -> JSONResponse:
        # SGLang's check that the engine really produces a token; a busy engine evidently does
        if engine.alive and engine.load() == 0 and not engine.paused:
            probe = sampling_params("", temperature=0.0, max_new_tokens=1)
            try:
                async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                    await engine.generate([0], probe)
            except (TimeoutError, RuntimeError, ValueError) as e:
                return error_response(503, f"health_generate: no token within {HEALTH_GENERATE_TIMEOUT_S:g} s ({e})")
        if not engine.alive:
            return error_response(503, "the engine thread is not running", "server_error")
        return JSONResponse({"status": "ok"})

    @api.get("/get_load")
    async def get_load() -> list:
        return [{"dp_rank": 0, "num_reqs": engine.load(), "num_waiting_reqs": int(engine.stats().get("waiting", 0))}]

    @api.get("/get_weight_version")
    async def weight_version(checksum: bool = False) -> dict:
        out: dict[str, Any] = {"weight_version": engine.weight_version}
        if checksum:  # a CRC-32 of the loaded weights, for the trainer to check a transfer
            out["weight_checksum"] = await engine.weights_checksum()
        return out

    @api.get("/get_server_info")
    async def server_info() -> dict:
        return {"model_path": model_name, **(await engine.get_stats())}

    @api.post("/generate")
    async def generate(body: GenerateBody, request: Request) -> Any:
        _check_generate(body)
        if body.text is not None:
            batched = isinstance(body.text, list)
            prompts = await texts.encode(body.text if batched else [body.text], "text")
        else:
            ids = body.input_ids or []
            batched = bool(ids) and isinstance(ids[0], list)
            prompts = [list(p) for p in ids] if batched else [list(ids)]  # type: ignore[arg-type]
        prompts, params, sps, rids = _samples(body, prompts, batched, cfg)
        batched = batched or len(prompts) > 1  # n > 1 answers a list too, as SGLang does
        if body.stream:
            return EventStream(_stream(body, prompts, params, sps, rids), engine, rids)
        outs = await runner.run(request, prompts, params, rids)
        results = [result(o, body, sp) for o, sp in zip(outs, sps, strict=True)]
        return results if batched else results[0]

    async def _stream(body, prompts, params, sps, rids):
        """SGLang's streaming: one `data:` event per step and request, with the text and tokens so
        far (cumulative), the final one with the whole result; then `data: [DONE]`."""
        ids: list[list[int]] = [[] for _ in prompts]
        async for i, new, _, _, out in runner.stream(prompts, params, rids):
            if out is not None:
                event = {"index": i, **result(out, body, sps[i])}
            else:
                ids[i].extend(new)
                text = tok.decode(ids[i], skip_special_tokens=sps[i].skip_special_tokens) if tok else ""
                event = {"index": i, "text": text, "output_ids": list(ids[i]), "meta_info": {"id": rids[i]}}
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    @api.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        if await engine.flush_cache():
            return JSONResponse({"success": True, "message": "Cache flushed."})
        return error_response(400, "flush_cache: requests are still running", param="flush_cache")

    @api.post("/abort_request")
    async def abort_request(body: AbortBody) -> dict:
        if body.abort_all:
            outs = await engine.abort(None)
        elif body.rid is not None:
            outs = await engine.abort(body.rid)
        else:
            raise BadRequest("rid: give a rid or abort_all: true")
        return {"success": True, "aborted": [o.request_id for o in outs]}

    @api.post("/pause_generation")
    async def pause_generation(body: PauseBody | None = None) -> dict:
        mode = body.mode if body is not None else "in_place"
        if mode == "abort":
            await engine.abort(None)
        await engine.pause()
        return {"success": True, "message": f"paused ({mode})"}

    @api.post("/continue_generation")
    async def continue_generation() -> dict:
        await engine.resume()
        return {"success": True, "message": "resumed"}

    @api.post("/release_memory_occupation")
    async def release_memory() -> dict:
        try:
            await engine.sleep()
        except RuntimeError as e:
            raise BadRequest(f"release_memory_occupation: {e}") from None
        return {"success": True, "message": "KV cache and weights released"}

    @api.post("/resume_memory_occupation")
    async def resume_memory() -> dict:
        await engine.wake()
        return {"success": True, "message": "memory taken back; send weights before generating"}

    @api.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: DiskWeightsBody) -> JSONResponse:
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

    @api.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: TensorWeightsBody) -> JSONResponse:
        if body.serialized_named_tensors is not None:
            raise BadRequest(
                "serialized_named_tensors: SGLang's format carries in-process tensor handles, which no other "
                "process can open; send tidal's `tensors` (a base64 safetensors blob, see tidal.adapters.client)"
            )
        if body.tensors is None:
            raise BadRequest("tensors: required (a base64 safetensors blob)")
        # null keeps the current version: a partial update (one chunk of several) is not a new version.
        version = _version(body.weight_version)
        version = engine.weight_version if version is None else version
        try:
            named = await asyncio.to_thread(decode_tensors, body.tensors)  # ~1 s per GB: off the event loop
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

    @api.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitGroupBody) -> JSONResponse:
        body.warn_unknown("/init_weights_update_group")
        try:
            group = await receiver.join(
                body.master_address, body.master_port, body.rank_offset, body.world_size, body.group_name, body.backend
            )
        except ApiError as e:
            return _refused(e)
        return _succeeded(f"joined {group.name!r} as rank {group.rank} of {group.world_size}")

    @api.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: DistributedWeightsBody) -> JSONResponse:
        body.warn_unknown("/update_weights_from_distributed")
        try:
            version = await receiver.update(
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

    @api.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyGroupBody) -> JSONResponse:
        try:
            receiver.destroy(body.group_name)
        except ApiError as e:
            return _refused(e)
        return _succeeded(f"destroyed {body.group_name!r}")

    return api
