"""SGLang's native API: `/generate` (with its sampling and output fields, streaming) and the
control routes a trainer drives (health, abort, pause/continue, weight updates, memory).

    POST /generate                   input_ids | text, sampling_params, return_logprob, top_logprobs_num,
                                     logprob_start_len (-1 only), return_text_in_logprobs, rid, stream;
                                     sampling_params.n > 1 answers a list of n samples per prompt
                                     (prompt-major, rids `{rid}_{j}`, seeds seed + j)
    GET  /health                     200 while the engine runs, else 503 (never behind the API key)
    GET  /health_generate            200 once the engine produces a token (or is busy producing them), else 503
    GET  /get_model_info             {"model_path", "tokenizer_path", "is_generation", "max_model_len", "dtype",
                                     "engine": "tidal", "max_weights_body_bytes", ...}
    GET  /get_load                   [{"dp_rank", "num_reqs", "num_waiting_reqs"}] (sglang-router reads it)
    GET  /get_weight_version         {"weight_version"}; ?checksum=true adds "weight_checksum" (CRC-32)
    GET  /get_server_info            engine stats
    POST /flush_cache                {"success"} (400 while requests run)
    POST /abort_request              {"rid"} or {"abort_all": true}
    POST /pause_generation           optional {"mode": "in_place" | "retract" | "abort"}
    POST /continue_generation
    POST /update_weights_from_disk   {"model_path", "weight_version"?, "flush_cache"?, "abort_all_requests"?,
                                     "allow_older"?}
    POST /update_weights_from_tensor tidal's format: a safetensors blob as the body (application/octet-stream),
                                     ?weight_version=N&flush_cache=true&stage=false[&partial=true]
                                     [&allow_older=true]; or JSON {"tensors": the blob as base64,
                                     "weight_version": int | null, "flush_cache", "stage", "allow_older"?};
                                     staged chunks load with the next unstaged one; a tensor larger than a
                                     chunk comes in pieces (`tidal.adapters.client`). SGLang's own format
                                     (`serialized_named_tensors`) carries in-process tensor handles and is
                                     refused with a 400 saying so.
    POST /release_memory_occupation, /resume_memory_occupation    free / take back KV cache and weights
    POST /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group
                                     weights by broadcast from a trainer (`tidal.server.weight_group`)

The weight routes are `tidal.server.sglang_weights`'s. Every weight update is all or nothing:
checked against the model before any live weight changes. A `weight_version` is an int >= 0, never
older than the version held unless the body says `allow_older: true` (`tidal.server.versions`).
While the engine is asleep or holds no weights (woken, none sent since), generating routes answer
503 saying what to do.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from tidal.adapters.client import TIDAL_SERVER, encode_routing
from tidal.chat.body import Body
from tidal.chat.errors import BadRequest
from tidal.chat.http_errors import error_response
from tidal.chat.render import render_images
from tidal.chat.text import trim_stop
from tidal.contracts import SamplingParams
from tidal.server.common import EventStream, Stream, check_budget, sampling_params
from tidal.server.options import ServerConfig
from tidal.server.state import Served, State

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
    # a vision-language model's images of the (one) prompt, in order: data: URIs or base64 strings
    image_data: str | list[str] | None = None


class AbortBody(Body):
    rid: str | None = None
    abort_all: bool = False


class PauseBody(Body):
    mode: Literal["in_place", "retract", "abort"] = "in_place"


def _params(
    sp: SamplingParamsBody, top: int, prefix: str, sample: int = 0, vocab_size: int | None = None
) -> SamplingParams:
    """The engine's sampling parameters for sample `sample` of a prompt: a seeded request's
    sample j uses seed + j, so n samples differ and each is reproducible (stop ids are checked
    against `vocab_size`)."""
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise BadRequest(f"{prefix}seed: give seed or sampling_seed, not two different values")
    seed = sp.seed if sp.seed is not None else sp.sampling_seed
    return sampling_params(
        prefix,
        vocab_size,
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
    body: GenerateBody, prompts: list[list[int]], batched: bool, cfg: ServerConfig, vocab_size: int | None = None
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
            out[1].append(_params(sp, top, prefix, j, vocab_size))
            out[1][-1].return_routed_experts = body.return_routed_experts
            out[2].append(sp)
            out[3].append(name if n == 1 else f"{name}_{j}" if body.rid is not None else uuid.uuid4().hex)
    check_budget(cfg, out[0], out[1])
    return out


def _piece(tok: Any, t: int, with_text: bool) -> str | None:
    return tok.decode([t]) if with_text and tok is not None else None


def _logprob_meta(tok: Any, out: Any, body: GenerateBody) -> dict:
    """SGLang's log-prob fields of one sample: [log-prob, token id, its text or None] per token."""
    with_text = body.return_text_in_logprobs
    meta: dict[str, Any] = {
        "output_token_logprobs": [
            [lp, t, _piece(tok, t, with_text)] for lp, t in zip(out.log_probs, out.token_ids, strict=True)
        ],
        "input_token_logprobs": [],
    }
    if body.top_logprobs_num:
        meta["output_top_logprobs"] = [
            [[lp, t, _piece(tok, t, with_text)] for t, lp in alts] for alts in (out.top_logprobs or [])
        ]
    return meta


def result(tok: Any, out: Any, body: GenerateBody, sp: SamplingParamsBody) -> dict:
    """SGLang's answer for one sample: its text, its token ids and `meta_info`."""
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
        meta.update(_logprob_meta(tok, out, body))
    if body.return_routed_experts and out.routed_experts is not None:
        meta["routed_experts"] = encode_routing(out.routed_experts)
    return {"text": text, "output_ids": list(out.token_ids), "meta_info": meta}


routes = APIRouter()


# ---------------------------------------------------------------------------- health and info
@routes.get("/health")
async def health(s: State) -> JSONResponse:
    """200 while the engine thread runs, else 503."""
    if not s.engine.alive:
        return error_response(503, "the engine thread is not running", "server_error")
    return JSONResponse({"status": "ok"})


@routes.get("/get_model_info")
async def model_info(s: State) -> dict:
    """The model served, its context and dtype, and that the engine is tidal's."""
    return {
        "model_path": s.model_name,
        "tokenizer_path": s.model_name,
        "is_generation": True,
        "max_model_len": s.engine.max_model_len,
        "weight_version": s.engine.weight_version,
        "dtype": str(s.engine.dtype).removeprefix("torch."),
        "engine": TIDAL_SERVER,
        # tidal's: the largest /update_weights_from_tensor body, so a trainer checks its chunks fit first
        "max_weights_body_bytes": s.cfg.max_weights_body_bytes,
    }


@routes.get("/health_generate")
async def health_generate(s: State) -> JSONResponse:
    """200 once the engine produces a token (or is busy producing them), else 503."""
    engine = s.engine
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


@routes.get("/get_load")
async def get_load(s: State) -> list:
    """The requests running and waiting (sglang-router reads it)."""
    engine = s.engine
    return [{"dp_rank": 0, "num_reqs": engine.load(), "num_waiting_reqs": int(engine.stats().get("waiting", 0))}]


@routes.get("/get_weight_version")
async def weight_version(s: State, checksum: bool = False) -> dict:
    """The weights' version, and with `checksum` a CRC-32 of them."""
    out: dict[str, Any] = {"weight_version": s.engine.weight_version}
    if checksum:  # a CRC-32 of the loaded weights, for the trainer to check a transfer
        out["weight_checksum"] = await s.engine.weights_checksum()
    return out


@routes.get("/get_server_info")
async def server_info(s: State) -> dict:
    """The engine's stats."""
    return {"model_path": s.model_name, **(await s.engine.get_stats())}


# ---------------------------------------------------------------------------- generate
async def _prompts(s: Served, body: GenerateBody) -> tuple[list[list[int]], bool]:
    """(the prompt ids of a `/generate` body, whether it gave a batch)."""
    if body.text is not None:
        batched = isinstance(body.text, list)
        return await s.texts.encode(body.text if batched else [body.text], "text"), batched
    ids = body.input_ids or []
    batched = bool(ids) and isinstance(ids[0], list)
    return ([list(p) for p in ids] if batched else [list(ids)]), batched  # type: ignore[arg-type]


async def _with_images(s: Served, body: GenerateBody) -> tuple[list[list[int]], bool, list]:
    """`_prompts`, and the images of `image_data` (one prompt's): with `text`, the model's
    processor expands each image marker of the text into its placeholders; `input_ids` carry them
    already (as the processor expanded them)."""
    values = [body.image_data] if isinstance(body.image_data, str) else list(body.image_data or [])
    if not values:
        return (*await _prompts(s, body), [])
    if s.images is None:
        raise BadRequest("image_data: this model takes no images")
    if isinstance(body.text, list) or (body.input_ids and isinstance(body.input_ids[0], list)):
        raise BadRequest("image_data: give one prompt per request with images")
    uris = [v if v.startswith("data:") else f"data:image;base64,{v}" for v in values]
    if body.text is not None:
        ids, images = await render_images(s.images, body.text, uris, "image_data")
        return [ids], False, images
    _, images = await render_images(s.images, None, uris, "image_data")
    return [list(body.input_ids or [])], False, images


@routes.post("/generate")
async def generate(body: GenerateBody, request: Request, s: State) -> Any:
    """Sample every prompt of the body; one result, or a list for a batch or n > 1."""
    _check_generate(body)
    prompts, batched, images = await _with_images(s, body)
    prompts, params, sps, rids = _samples(body, prompts, batched, s.cfg, s.engine.vocab_size)
    batched = batched or len(prompts) > 1  # n > 1 answers a list too, as SGLang does
    if body.stream:  # refused requests are answered as errors
        stream = await s.runner.stream(prompts, params, rids, images)
        return EventStream(generate_events(s, body, stream, prompts, sps, rids), s.engine, rids)
    outs = await s.runner.run(request, prompts, params, rids, images)
    results = [result(s.tok, o, body, sp) for o, sp in zip(outs, sps, strict=True)]
    return results if batched else results[0]


async def generate_events(
    s: Served,
    body: GenerateBody,
    stream: Stream,
    prompts: list[list[int]],
    sps: list[SamplingParamsBody],
    rids: list[str],
) -> AsyncIterator[str]:
    """SGLang's streaming: one `data:` event per step and request, with the text and tokens so
    far (cumulative), the final one with the whole result; then `data: [DONE]`."""
    tok = s.tok
    ids: list[list[int]] = [[] for _ in prompts]
    async for i, new, _, _, out in stream:
        if out is not None:
            event = {"index": i, **result(tok, out, body, sps[i])}
        else:
            ids[i].extend(new)
            text = tok.decode(ids[i], skip_special_tokens=sps[i].skip_special_tokens) if tok else ""
            event = {"index": i, "text": text, "output_ids": list(ids[i]), "meta_info": {"id": rids[i]}}
        yield f"data: {json.dumps(event)}\n\n"
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------- control
@routes.post("/flush_cache")
async def flush_cache(s: State) -> JSONResponse:
    """Empty the prefix cache; 400 while requests run."""
    if await s.engine.flush_cache():
        return JSONResponse({"success": True, "message": "Cache flushed."})
    return error_response(400, "flush_cache: requests are still running", param="flush_cache")


@routes.post("/abort_request")
async def abort_request(body: AbortBody, s: State) -> dict:
    """Abort one request by rid, or all of them."""
    if body.abort_all:
        outs = await s.engine.abort(None)
    elif body.rid is not None:
        outs = await s.engine.abort(body.rid)
    else:
        raise BadRequest("rid: give a rid or abort_all: true")
    return {"success": True, "aborted": [o.request_id for o in outs]}


@routes.post("/pause_generation")
async def pause_generation(s: State, body: PauseBody | None = None) -> dict:
    """Stop stepping the engine (after aborting every request in mode "abort")."""
    mode = body.mode if body is not None else "in_place"
    if mode == "abort":
        await s.engine.abort(None)
    await s.engine.pause()
    return {"success": True, "message": f"paused ({mode})"}


@routes.post("/continue_generation")
async def continue_generation(s: State) -> dict:
    """Step the engine again."""
    await s.engine.resume()
    return {"success": True, "message": "resumed"}


@routes.post("/release_memory_occupation")
async def release_memory(s: State) -> dict:
    """Free the KV cache and the weights."""
    try:
        await s.engine.sleep()
    except RuntimeError as e:
        raise BadRequest(f"release_memory_occupation: {e}") from None
    return {"success": True, "message": "KV cache and weights released"}


@routes.post("/resume_memory_occupation")
async def resume_memory(s: State) -> dict:
    """Take the memory back; the weights must be sent again before generating."""
    await s.engine.wake()
    return {"success": True, "message": "memory taken back; send weights before generating"}
