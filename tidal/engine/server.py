"""HTTP server for the embedded engine, speaking SGLang's native API plus the OpenAI basics.

Endpoints (JSON in, JSON out; a bad request is HTTP 400 with `{"error": "<field>: <what>"}`;
a failure while generating is HTTP 500 with `{"error": "<ExceptionType>: <what>"}`):

    POST /generate                   SGLang: input_ids | text, sampling_params, return_logprob, rid
    GET  /health                     200 while the engine runs, else 503
    GET  /get_model_info             {"model_path", "tokenizer_path", "is_generation", "max_model_len", ...}
    GET  /get_weight_version         {"weight_version": int}; ?checksum=true adds "weight_checksum" (CRC-32)
    GET  /get_server_info            engine stats
    POST /flush_cache                {"success": bool} (400 when the core refused)
    POST /abort_request              {"rid": str} or {"abort_all": true}
    POST /pause_generation           optional {"mode": "in_place" | "retract" | "abort"}
    POST /continue_generation
    POST /update_weights_from_disk   {"model_path", "weight_version"?, "flush_cache"?, "abort_all_requests"?}
                                     -> {"success", "message", "weight_version"}
    POST /update_weights_from_tensor tidal's format: {"tensors": base64 safetensors blob,
                                     "weight_version": int | null (null keeps the current one),
                                     "flush_cache": bool = true, "stage": bool = false}; staged
                                     chunks load with the next unstaged one, all or nothing
                                     (see `tidal.engine.client`, which also encodes it)
    POST /release_memory_occupation  free the KV cache and weights (a colocated trainer trains)
    POST /resume_memory_occupation   take them back; a weight update must follow before generating
    POST /v1/completions, POST /v1/chat/completions, GET /v1/models   (OpenAI, no streaming)
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tidal.engine.async_engine import AsyncEngine
from tidal.engine.client import decode_tensors
from tidal.engine.sampling import SamplingParams

__all__ = ["BackgroundServer", "build_app", "serve"]

DISCONNECT_POLL_S = 1.0


class BadRequest(Exception):
    """Turned into HTTP 400 `{"error": message}`."""


class _Body(BaseModel):
    """Request bodies: unknown fields and wrong types are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)


# ---------------------------------------------------------------------- request bodies
class SamplingParamsBody(_Body):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # SGLang spells "off" as -1; 0 is accepted too
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's name for seed


class GenerateBody(_Body):
    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] = Field(default_factory=SamplingParamsBody)
    return_logprob: bool = False
    rid: str | list[str] | None = None
    stream: bool = False


class AbortBody(_Body):
    rid: str | None = None
    abort_all: bool = False


class PauseBody(_Body):
    mode: Literal["in_place", "retract", "abort"] = "in_place"


def _version(value: int | str | None) -> int | None:
    """Weight versions are ints; SGLang clients send them as strings, so digits are accepted too."""
    if value is None or isinstance(value, int):
        return value
    try:
        return int(value)
    except ValueError:
        raise BadRequest(f"weight_version must be an int, got {value!r}") from None


class DiskWeightsBody(_Body):
    model_path: str
    weight_version: int | str | None = None
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class TensorWeightsBody(_Body):
    tensors: str
    weight_version: int | str | None = None
    flush_cache: bool = True
    stage: bool = False  # keep these tensors; the next request without `stage` loads all at once


class _OpenAIBody(_Body):
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    user: str | None = None


class CompletionBody(_OpenAIBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_OpenAIBody):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# ---------------------------------------------------------------------- helpers
def _sampling_params(
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    max_new_tokens: int,
    stop: str | list[str] | None,
    stop_token_ids: list[int] | None,
    seed: int | None,
    field_prefix: str = "",
) -> SamplingParams:
    """A validated SamplingParams; a bad value raises BadRequest naming the field."""
    if top_k < -1:
        raise BadRequest(f"{field_prefix}top_k must be -1 or 0 (off) or >= 1, got {top_k}")
    try:
        return SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=max(top_k, 0),
            min_p=min_p,
            max_new_tokens=max_new_tokens,
            stop=[stop] if isinstance(stop, str) else list(stop or []),
            stop_token_ids=list(stop_token_ids or []),
            seed=seed,
        ).validate()
    except ValueError as e:
        raise BadRequest(f"{field_prefix}{e}") from None


def _from_sglang(sp: SamplingParamsBody) -> SamplingParams:
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise BadRequest("sampling_params: give seed or sampling_seed, not two different values")
    return _sampling_params(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        max_new_tokens=sp.max_new_tokens,
        stop=sp.stop,
        stop_token_ids=sp.stop_token_ids,
        seed=sp.seed if sp.seed is not None else sp.sampling_seed,
        field_prefix="sampling_params.",
    )


def _encode(tokenizer: Any, text: str) -> list[int]:
    if tokenizer is None:
        raise BadRequest("text: this engine has no tokenizer; send token ids")
    return list(tokenizer.encode(text, add_special_tokens=False))


def _decode_one(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "function-after", "function-plain"}


def _format_validation_error(exc: RequestValidationError) -> str:
    """One "field.path: message" per bad field, without pydantic's union-branch tags."""
    errors: list[tuple[tuple[str, ...], str]] = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"body: invalid JSON ({err.get('ctx', {}).get('error', err.get('msg'))})"
        loc = tuple(
            str(x)
            for x in err.get("loc", ())
            if x != "body" and not (isinstance(x, str) and (x[:1].isupper() or "[" in x or x in _TYPE_TAGS))
        )
        errors.append((loc, err.get("msg", "invalid")))
    # A union reports one error per branch: keep the most specific one(s) for each field.
    kept: dict[tuple[str, ...], str] = {}
    for loc, msg in errors:
        if not any(len(o) > len(loc) and o[: len(loc)] == loc for o, _ in errors):
            kept.setdefault(loc, msg)
    return "; ".join(f"{'.'.join(loc) or 'body'}: {msg}" for loc, msg in kept.items())


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class _Generator:
    """Submits requests to the engine and waits for them, aborting them if the client goes away."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def run(
        self, request: Request, prompts: Sequence[list[int]], params: Sequence[SamplingParams], rids: Sequence[str]
    ) -> list[Any]:
        # Submit all at once: the engine thread takes every queued request in one go between steps.
        adds = [self.engine.add_request(p, sp, rid) for p, sp, rid in zip(prompts, params, rids, strict=True)]
        added = await asyncio.gather(*adds, return_exceptions=True)
        failed = [a for a in added if isinstance(a, BaseException)]
        if failed:
            for a in added:
                if isinstance(a, asyncio.Future):
                    a.cancel()  # aborts it in the engine
            if isinstance(failed[0], ValueError):
                raise BadRequest(str(failed[0]))
            raise failed[0]
        gathered = asyncio.gather(*added)
        while True:
            done, _ = await asyncio.wait({gathered}, timeout=DISCONNECT_POLL_S)
            if done:
                return gathered.result()
            if await request.is_disconnected():
                await asyncio.gather(*(self.engine.abort(rid) for rid in rids))
                return await gathered


def _room_left(engine: AsyncEngine, prompt: list[int]) -> int:
    """Room left for new tokens after `prompt`; BadRequest when there is none."""
    room = engine.max_model_len - len(prompt)
    if room < 1:
        raise BadRequest(f"prompt is {len(prompt)} tokens; the context is {engine.max_model_len} tokens")
    return room


# ---------------------------------------------------------------------- app
def build_app(engine: AsyncEngine, model_name: str) -> FastAPI:
    """The FastAPI app serving `engine` under the name `model_name`."""
    app = FastAPI(title="tidal engine", docs_url=None, redoc_url=None)
    gen = _Generator(engine)
    tok = engine.tokenizer

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _format_validation_error(exc))

    @app.exception_handler(BadRequest)
    async def _on_bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(Exception)
    async def _on_error(_: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------ SGLang native
    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return JSONResponse({"status": "dead", "error": "the engine thread is not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {
            "model_path": model_name,
            "tokenizer_path": model_name,
            "is_generation": True,
            "max_model_len": engine.max_model_len,
            "weight_version": engine.weight_version,
            "dtype": str(engine.dtype).removeprefix("torch."),
        }

    @app.get("/get_weight_version")
    async def weight_version(checksum: bool = False) -> dict:
        out: dict[str, Any] = {"weight_version": engine.weight_version}
        if checksum:  # a CRC-32 of the loaded weights, for the trainer to check a transfer
            out["weight_checksum"] = await engine.weights_checksum()
        return out

    @app.post("/release_memory_occupation")
    async def release_memory() -> dict:
        try:
            await engine.sleep()
        except RuntimeError as e:
            raise BadRequest(str(e)) from None
        return {"success": True, "message": "KV cache and weights released"}

    @app.post("/resume_memory_occupation")
    async def resume_memory() -> dict:
        await engine.wake()
        return {"success": True, "message": "memory taken back; send weights before generating"}

    @app.get("/get_server_info")
    async def server_info() -> dict:
        return {"model_path": model_name, **(await engine.get_stats())}

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request) -> Any:
        if body.stream:
            raise BadRequest("stream: streaming is not supported")
        if (body.input_ids is None) == (body.text is None):
            raise BadRequest("input_ids: give exactly one of input_ids and text")
        if body.text is not None:
            batched = isinstance(body.text, list)
            texts = body.text if isinstance(body.text, list) else [body.text]
            prompts = [_encode(tok, t) for t in texts]
        else:
            ids = body.input_ids or []
            batched = bool(ids) and isinstance(ids[0], list)
            prompts = [list(p) for p in ids] if batched else [list(ids)]  # type: ignore[arg-type]
        if not prompts or any(not p for p in prompts):
            raise BadRequest("input_ids: empty prompt")
        n = len(prompts)
        sps = body.sampling_params
        if isinstance(sps, list):
            if len(sps) != n:
                raise BadRequest(f"sampling_params: {len(sps)} given for {n} prompts")
            params = [_from_sglang(sp) for sp in sps]
        else:
            params = [_from_sglang(sps)] * n
        if body.rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif isinstance(body.rid, list) != batched or (batched and len(body.rid) != n):
            raise BadRequest(f"rid: give one rid per prompt ({n}) as {'a list' if batched else 'a string'}")
        else:
            rids = list(body.rid) if isinstance(body.rid, list) else [body.rid]
        outs = await gen.run(request, prompts, params, rids)
        results = [_sglang_result(o, body.return_logprob) for o in outs]
        return results if batched else results[0]

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        ok = await engine.flush_cache()
        msg = "Cache flushed." if ok else "Cache not flushed: requests are still running."
        return JSONResponse({"success": ok, "message": msg}, status_code=200 if ok else 400)

    @app.post("/abort_request")
    async def abort_request(body: AbortBody) -> dict:
        if body.abort_all:
            outs = await engine.abort(None)
        elif body.rid is not None:
            outs = await engine.abort(body.rid)
        else:
            raise BadRequest("rid: give a rid or abort_all: true")
        return {"success": True, "aborted": [o.request_id for o in outs]}

    @app.post("/pause_generation")
    async def pause_generation(body: PauseBody | None = None) -> dict:
        mode = body.mode if body is not None else "in_place"
        if mode == "abort":
            await engine.abort(None)
        await engine.pause()
        return {"success": True, "message": f"paused ({mode})"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict:
        await engine.resume()
        return {"success": True, "message": "resumed"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: DiskWeightsBody) -> JSONResponse:
        version = _version(body.weight_version)
        if body.abort_all_requests:
            await engine.abort(None)
        try:
            await engine.update_weights_from_disk(body.model_path, version, flush_cache=body.flush_cache)
        except (OSError, KeyError, ValueError, RuntimeError) as e:
            msg = f"model_path: failed to load {body.model_path}: {type(e).__name__}: {e}"
            return JSONResponse({"success": False, "message": msg, "error": msg}, status_code=400)
        msg = f"loaded {body.model_path}; weight version {engine.weight_version}"
        return JSONResponse({"success": True, "message": msg, "weight_version": engine.weight_version})

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: TensorWeightsBody) -> JSONResponse:
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
                await engine.update_weights_from_tensors(named, version, flush_cache=body.flush_cache)
        except (KeyError, ValueError, RuntimeError) as e:
            msg = f"tensors: {type(e).__name__}: {e}"
            return JSONResponse({"success": False, "message": msg, "error": msg}, status_code=400)
        what = "staged" if body.stage else "updated"
        msg = f"{what} {len(named)} tensors; weight version {engine.weight_version}"
        return JSONResponse({"success": True, "message": msg, "weight_version": engine.weight_version})

    # ------------------------------------------------------------ OpenAI
    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "tidal"}
        return {"object": "list", "data": [{**card, "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> dict:
        _check_openai(body)
        if body.echo:
            raise BadRequest("echo: not supported")
        if body.logprobs is not None and body.logprobs < 0:
            raise BadRequest(f"logprobs must be >= 0, got {body.logprobs}")
        p = body.prompt
        if isinstance(p, str):
            prompts = [_encode(tok, p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [_encode(tok, x) for x in p]  # type: ignore[arg-type]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]  # type: ignore[union-attr]
        else:
            prompts = [list(p)]  # type: ignore[arg-type]
        if any(not x for x in prompts):
            raise BadRequest("prompt: empty prompt")
        outs, params = await _openai_generate(request, body, prompts, body.max_tokens, "max_tokens")
        choices = []
        for i, o in enumerate(outs):
            lp = None
            if body.logprobs is not None:
                tokens = [_decode_one(tok, t) for t in o.token_ids]
                offsets, pos = [], 0
                for t in tokens:
                    offsets.append(pos)
                    pos += len(t)
                lp = {
                    "tokens": tokens,
                    "token_logprobs": list(o.log_probs),
                    "top_logprobs": None,
                    "text_offset": offsets,
                }
            choices.append({"index": i, "text": o.text, "logprobs": lp, "finish_reason": o.finish_reason})
        return _openai_response("cmpl", "text_completion", model_name, choices, prompts, outs)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> dict:
        _check_openai(body)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        if tok is None:
            raise BadRequest("messages: this engine has no tokenizer to apply a chat template")
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:
            raise BadRequest(f"messages: the chat template failed: {type(e).__name__}: {e}") from None
        prompt = _encode(tok, text)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        outs, _ = await _openai_generate(request, body, [prompt], max_tokens, field)
        choices = []
        for i, o in enumerate(outs):
            lp = None
            if body.logprobs:
                content = []
                for t, v in zip(o.token_ids, o.log_probs, strict=True):
                    s = _decode_one(tok, t)
                    content.append({"token": s, "logprob": v, "bytes": list(s.encode()), "top_logprobs": []})
                lp = {"content": content}
            message = {"role": "assistant", "content": o.text}
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": o.finish_reason})
        return _openai_response("chatcmpl", "chat.completion", model_name, choices, [prompt], outs)

    def _check_openai(body: _OpenAIBody) -> None:
        if body.stream:
            raise BadRequest("stream: streaming is not supported")
        if body.n < 1:
            raise BadRequest(f"n must be >= 1, got {body.n}")

    async def _openai_generate(
        request: Request, body: _OpenAIBody, prompts: list[list[int]], max_tokens: int | None, field: str
    ) -> tuple[list[Any], list[SamplingParams]]:
        """n samples per prompt (sample j of a seeded request uses seed + j); prompt-major order."""
        all_prompts, params = [], []
        for prompt in prompts:
            room = _room_left(engine, prompt)
            if max_tokens is not None and max_tokens < 1:
                raise BadRequest(f"{field} must be >= 1, got {max_tokens}")
            for j in range(body.n):
                params.append(
                    _sampling_params(
                        temperature=body.temperature,
                        top_p=body.top_p,
                        top_k=body.top_k,
                        min_p=body.min_p,
                        max_new_tokens=max_tokens if max_tokens is not None else room,
                        stop=body.stop,
                        stop_token_ids=body.stop_token_ids,
                        seed=None if body.seed is None else body.seed + j,
                    )
                )
                all_prompts.append(prompt)
        rids = [uuid.uuid4().hex for _ in all_prompts]
        return await gen.run(request, all_prompts, params, rids), params

    return app


def _sglang_result(out: Any, return_logprob: bool) -> dict:
    meta: dict[str, Any] = {
        "id": out.request_id,
        "finish_reason": {"type": out.finish_reason},
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.token_ids),
        "cached_tokens": out.cached_tokens,
        "weight_version": out.weight_version,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.log_probs, out.token_ids, strict=True)]
    return {"text": out.text, "output_ids": list(out.token_ids), "meta_info": meta}


def _openai_response(
    prefix: str, obj: str, model: str, choices: list[dict], prompts: list[list[int]], outs: list[Any]
) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(o.token_ids) for o in outs)
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


# ---------------------------------------------------------------------- running it
class BackgroundServer:
    """Serve an app with uvicorn on a thread (for tests and in-process use).

    `port=0` picks a free port; the socket is bound before the thread starts, so `url` is valid
    at once and the server accepts connections as soon as `start()` returns."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _default_core(model_dir: str, **engine_kwargs: Any) -> Any:
    """tidal's LLMEngine with the model folder's tokenizer (imported here: the server module does
    not need torch models to be importable)."""
    from transformers import AutoTokenizer

    from tidal.engine.llm_engine import LLMEngine

    return LLMEngine(model_dir, AutoTokenizer.from_pretrained(model_dir), **engine_kwargs)


def serve(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    core: Any = None,
    core_factory: Callable[..., Any] | None = None,
    model_name: str | None = None,
    log_level: str = "info",
    **engine_kwargs: Any,
) -> None:
    """Load a core engine for `model_dir` and serve it until interrupted.

    The core is `core` if given, else `core_factory(model_dir, **engine_kwargs)`, by default
    `LLMEngine(model_dir, AutoTokenizer.from_pretrained(model_dir), **engine_kwargs)`."""
    import uvicorn

    if core is None:
        core = (core_factory or _default_core)(str(model_dir), **engine_kwargs)
    engine = AsyncEngine(core)
    try:
        uvicorn.run(build_app(engine, model_name or str(model_dir)), host=host, port=port, log_level=log_level)
    finally:
        engine.close()
