"""OpenAI's API: `/v1/models`, `/v1/completions` and `/v1/chat/completions`.

Both generation routes take `n`, `stop`, `seed` (sample j of a seeded request uses seed + j),
`max_tokens`, `temperature`, `top_p` (and tidal's `top_k`, `min_p`), `presence_penalty`,
`frequency_penalty`, `logit_bias` (applied to the logits before sampling), `logprobs` (chat:
`logprobs` + `top_logprobs`; completions: `logprobs` = number of alternatives) and
`stream` (server-sent events; `stream_options.include_usage` adds a last chunk with the usage).
Chat content may be a string or text parts. `tools` are rendered through the chat template (or,
for a template without tool support, spelled out in the system message: `tidal.server.tools`),
and `<tool_call>` blocks in the answer come back as `message.tool_calls` with `finish_reason:
"tool_calls"`. `response_format` other than `{"type": "text"}` is refused (no constrained
decoding). Unknown fields are ignored with a logged warning.

Log-probs are those of the tempered distribution each token was drawn from; the alternatives are
the most likely tokens of softmax(logits / temperature) (the same distribution with top-p, top-k
and min-p off, their defaults).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from tidal.adapters.async_engine import AsyncEngine
from tidal.server.common import (
    BadRequest,
    Body,
    EventStream,
    Runner,
    Texts,
    TextStream,
    check_budget,
    encode,
    room_left,
    sampling_params,
    trim_stop,
)
from tidal.server.options import ServerConfig
from tidal.server.tools import parse_tool_calls, render_messages, template_takes_tools


class StreamOptions(Body):
    include_usage: bool = False


class OpenAIBody(Body):
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
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionBody(OpenAIBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(OpenAIBody):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


def _logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float]:
    """`logit_bias` with int keys; BadRequest for a key that is not a token id of the model (a
    bias on no token would silently do nothing)."""
    out = {}
    for k, v in (bias or {}).items():
        try:
            token = int(k)
            out[token] = float(v)
        except ValueError:
            raise BadRequest(f"logit_bias: keys must be token ids, got {k!r}") from None
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise BadRequest(
                f"logit_bias: token id {k} is outside the vocabulary; this model's ids are 0 to {vocab_size - 1}"
            )
    return out


def token_piece(tok: Any, t: int) -> str:
    return tok.decode([t]) if tok is not None else str(t)


def usage(prompts: list[list[int]], outs: list) -> dict:
    """Each distinct prompt counted once (as OpenAI does with n > 1), every sample's tokens."""
    p, c = sum(len(x) for x in prompts), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def stops_of(body: OpenAIBody) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def text_of(out: Any, stops: list[str]) -> str:
    """The answer's text: the engine's decoding (special tokens skipped), cut before a stop string."""
    return trim_stop(out.text, stops) if out.finish_reason == "stop" and stops else out.text


def check_chat(body: ChatBody) -> None:
    """BadRequest for chat fields this server cannot honour (the rest is the body's own validation)."""
    fmt = (body.response_format or {}).get("type", "text")
    if fmt != "text":
        raise BadRequest(
            f"response_format: type {fmt!r} is not supported (no constrained decoding); use 'text' and "
            "validate the answer yourself"
        )
    top = body.top_logprobs or 0
    if body.top_logprobs is not None and (not body.logprobs or not 0 <= top <= 20):
        raise BadRequest("top_logprobs: needs logprobs: true and a value in [0, 20]")
    if body.tool_choice not in (None, "none", "auto", "required") and not isinstance(body.tool_choice, dict):
        raise BadRequest(f"tool_choice: none, auto, required or a function, got {body.tool_choice!r}")


def chat_max_tokens(body: ChatBody) -> tuple[int | None, str]:
    """(the requested answer length or None, the field that set it)."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


async def chat_prompt(tok: Any, body: ChatBody, raw: list[dict] | None = None, texts: Texts | None = None) -> list[int]:
    """The prompt ids of a chat request: its messages (`raw`: them as dicts, when the caller
    rewrote them) and tools through the tokenizer's chat template, with the generation prompt,
    tokenised as one text (within `texts`' limits when given: `tidal serve`'s)."""
    raw = raw if raw is not None else [m.model_dump(exclude_none=True) for m in body.messages]
    return await render_prompt(tok, raw, body.tools, body.tool_choice, texts)


async def render_prompt(
    tok: Any, raw: list[dict], tools: list[dict] | None, tool_choice: Any, texts: Texts | None = None
) -> list[int]:
    """The prompt ids of chat messages (OpenAI's form, as dicts) and tools: what every chat route
    (OpenAI's, Anthropic's, the agent door's) renders, so one conversation is one prompt whichever
    API it came through."""
    if tok is None:
        raise BadRequest("messages: this engine has no tokenizer to apply a chat template")
    try:
        messages, tools = render_messages(raw, tools, tool_choice, template_takes_tools(tok))
    except ValueError as e:
        raise BadRequest(str(e)) from None
    try:
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:
        raise BadRequest(f"messages: the chat template failed: {type(e).__name__}: {e}") from None
    if texts is not None:  # `tidal serve`'s limits on text to tokenise
        return (await texts.encode([text], "messages"))[0]
    return (await encode(tok, [text], "messages"))[0]


def chat_logprobs(tok: Any, ids: list[int], lps: list[float], tops: list, top: int) -> dict:
    """OpenAI's chat `logprobs`: one entry per token, with `top` alternatives each."""

    def entry(t: int, v: float) -> dict:
        s = token_piece(tok, t)
        return {"token": s, "logprob": v, "bytes": list(s.encode())}

    content = []
    for k, (t, v) in enumerate(zip(ids, lps, strict=True)):
        alts = [entry(a, lv) for a, lv in tops[k]] if top else []
        content.append({**entry(t, v), "top_logprobs": alts})
    return {"content": content}


def assistant_message(text: str, use_tools: bool, finish_reason: str) -> tuple[dict, str]:
    """(the answer as an assistant message, its finish reason): `<tool_call>` blocks become
    `tool_calls` (finish reason "tool_calls") when the request offered tools."""
    if use_tools:
        content, calls, _ = parse_tool_calls(text)
        if calls:
            message = {"role": "assistant", "content": content or None}
            return {**message, "tool_calls": [c.to_openai() for c in calls]}, "tool_calls"
    return {"role": "assistant", "content": text}, finish_reason


def uses_tools(body: ChatBody) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


def models_list(model_name: str, max_model_len: int | None) -> dict:
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "tidal"}
    return {"object": "list", "data": [{**card, "max_model_len": max_model_len}]}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def router(engine: AsyncEngine, model_name: str, cfg: ServerConfig, texts: Texts | None = None) -> APIRouter:
    """OpenAI's routes over `engine`; `texts` tokenises (shared with the other routes, so its
    limit on text being tokenised at once holds server-wide)."""
    api = APIRouter()
    runner = Runner(engine)
    texts = texts or Texts(engine.tokenizer, engine.max_model_len, cfg)
    tok = engine.tokenizer

    def piece(t: int) -> str:
        return token_piece(tok, t)

    def checked(body: OpenAIBody, route: str) -> None:
        body.warn_unknown(route)
        if body.n < 1 or body.n > cfg.max_n:
            raise BadRequest(f"n: must be between 1 and {cfg.max_n} on this server, got {body.n}")

    def params_for(body: OpenAIBody, prompts, max_tokens, field, top: int):
        """n samples per prompt, prompt-major order."""
        bias = _logit_bias(body.logit_bias, engine.vocab_size)
        all_prompts, params = [], []
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"{field}: must be >= 1, got {max_tokens}")
        for prompt in prompts:
            room = room_left(engine, prompt)
            for j in range(body.n):
                params.append(
                    sampling_params(
                        temperature=body.temperature,
                        top_p=body.top_p,
                        top_k=body.top_k,
                        min_p=body.min_p,
                        max_new_tokens=min(max_tokens, room) if max_tokens is not None else room,
                        stop=body.stop,
                        stop_token_ids=body.stop_token_ids,
                        seed=None if body.seed is None else body.seed + j,
                        presence_penalty=body.presence_penalty,
                        frequency_penalty=body.frequency_penalty,
                        logit_bias=bias,
                        top_logprobs=top,
                    )
                )
                all_prompts.append(prompt)
        check_budget(cfg, all_prompts, params)
        return all_prompts, params

    @api.get("/v1/models")
    async def models() -> dict:
        return models_list(model_name, engine.max_model_len)

    # ------------------------------------------------------------ completions
    @api.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Any:
        checked(body, "/v1/completions")
        if body.echo:
            raise BadRequest("echo: not supported (the engine does not score prompts)")
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise BadRequest(f"logprobs: must be in [0, 20], got {body.logprobs}")
        p = body.prompt
        if isinstance(p, str):
            prompts = await texts.encode([p], "prompt")
        elif p and all(isinstance(x, str) for x in p):
            prompts = await texts.encode(p, "prompt")  # type: ignore[arg-type]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]  # type: ignore[union-attr]
        else:
            prompts = [list(p)]  # type: ignore[arg-type]
        if any(not x for x in prompts):
            raise BadRequest("prompt: empty prompt")
        if len(prompts) > cfg.max_batch:
            raise BadRequest(f"prompt: {len(prompts)} prompts; at most {cfg.max_batch} per request")
        all_prompts, params = params_for(body, prompts, body.max_tokens, "max_tokens", body.logprobs or 0)
        stops = stops_of(body)
        rids = [uuid.uuid4().hex for _ in all_prompts]
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs_of(ids, lps, tops, offset0: int) -> dict | None:
            if body.logprobs is None:
                return None
            tokens = [piece(t) for t in ids]
            offsets, pos = [], offset0
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            alts = [{piece(t): v for t, v in a} for a in tops] if body.logprobs else None
            return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": alts, "text_offset": offsets}

        def obj(choices: list[dict], **extra) -> dict:
            head = {"id": cid, "object": "text_completion", "created": created, "model": model_name}
            return {**head, "choices": choices, **extra}

        def choice(i: int, text: str, lp: dict | None, reason: str | None) -> dict:
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}

        if body.stream:

            async def events():
                streams = [TextStream(tok, stops=stops) for _ in all_prompts]
                outs = []
                async for i, ids, lps, tops, out in runner.stream(all_prompts, params, rids):
                    if out is None:
                        at = streams[i].sent
                        yield sse(obj([choice(i, streams[i].add(ids), logprobs_of(ids, lps, tops, at), None)]))
                        continue
                    outs.append(out)
                    yield sse(obj([choice(i, streams[i].add([], final=True), None, out.finish_reason)]))
                if body.stream_options and body.stream_options.include_usage:
                    yield sse(obj([], usage=usage(prompts, outs)))
                yield "data: [DONE]\n\n"

            return EventStream(events(), engine, rids)
        outs = await runner.run(request, all_prompts, params, rids)
        choices = [
            choice(
                i, text_of(o, stops), logprobs_of(o.token_ids, o.log_probs, o.top_logprobs or [], 0), o.finish_reason
            )
            for i, o in enumerate(outs)
        ]
        return obj(choices, usage=usage(prompts, outs))

    # ------------------------------------------------------------ chat
    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Any:
        checked(body, "/v1/chat/completions")
        check_chat(body)
        top = body.top_logprobs or 0
        prompt = await chat_prompt(tok, body, texts=texts)
        prompts, params = params_for(body, [prompt], *chat_max_tokens(body), top)
        stops = stops_of(body)
        use_tools = uses_tools(body)
        rids = [uuid.uuid4().hex for _ in prompts]
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs_of(ids, lps, tops) -> dict | None:
            return chat_logprobs(tok, ids, lps, tops, top) if body.logprobs else None

        def message_of(out) -> tuple[dict, str]:
            return assistant_message(text_of(out, stops), use_tools, out.finish_reason)

        def obj(kind: str, choices: list[dict], **extra) -> dict:
            head = {"id": cid, "object": kind, "created": created, "model": model_name}
            return {**head, "choices": choices, **extra}

        def chunk(choices: list[dict], **extra) -> str:
            return sse(obj("chat.completion.chunk", choices, **extra))

        def out_logprobs(o) -> dict | None:
            return logprobs_of(o.token_ids, o.log_probs, o.top_logprobs or [])

        if body.stream:

            async def events():
                streams = [TextStream(tok, stops=stops) for _ in prompts]
                for i in range(len(prompts)):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
                outs = []
                async for i, ids, lps, tops, out in runner.stream(prompts, params, rids):
                    if out is None:
                        if use_tools:  # the calls are parsed once the answer is whole
                            continue
                        delta = {"content": streams[i].add(ids)}
                        yield chunk(
                            [
                                {
                                    "index": i,
                                    "delta": delta,
                                    "logprobs": logprobs_of(ids, lps, tops),
                                    "finish_reason": None,
                                }
                            ]
                        )
                        continue
                    outs.append(out)
                    if use_tools:
                        message, reason = message_of(out)
                        message.pop("role")
                        if "tool_calls" in message:
                            message["tool_calls"] = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
                        yield chunk(
                            [{"index": i, "delta": message, "logprobs": out_logprobs(out), "finish_reason": reason}]
                        )
                    else:
                        tail = streams[i].add([], final=True)
                        delta = {"content": tail} if tail else {}
                        yield chunk([{"index": i, "delta": delta, "finish_reason": out.finish_reason}])
                if body.stream_options and body.stream_options.include_usage:
                    yield chunk([], usage=usage([prompt], outs))
                yield "data: [DONE]\n\n"

            return EventStream(events(), engine, rids)
        outs = await runner.run(request, prompts, params, rids)
        choices = []
        for i, o in enumerate(outs):
            message, reason = message_of(o)
            choices.append({"index": i, "message": message, "logprobs": out_logprobs(o), "finish_reason": reason})
        return obj("chat.completion", choices, usage=usage([prompt], outs))

    return api
