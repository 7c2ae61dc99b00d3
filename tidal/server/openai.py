"""OpenAI's API: `/v1/models`, `/v1/completions` and `/v1/chat/completions`.

Both generation routes take `n`, `stop`, `seed` (sample j of a seeded request uses seed + j),
`max_tokens`, `temperature`, `top_p` (and tidal's `top_k`, `min_p`), `presence_penalty`,
`frequency_penalty`, `logit_bias` (applied to the logits before sampling), `logprobs` (chat:
`logprobs` + `top_logprobs`; completions: `logprobs` = number of alternatives) and
`stream` (server-sent events; `stream_options.include_usage` adds a last chunk with the usage).
Chat content may be a string or text parts. `tools` are rendered through the chat template (or,
for a template without tool support, spelled out in the system message: `tidal.chat.tools`),
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

from tidal.adapters.async_engine import AsyncEngine
from tidal.chat.errors import BadRequest
from tidal.chat.openai import (
    ChatBody,
    OpenAIBody,
    assistant_message,
    chat_logprobs,
    chat_max_tokens,
    chat_prompt,
    check_chat,
    models_list,
    stops_of,
    text_of,
    token_piece,
    usage,
    uses_tools,
)
from tidal.server.common import (
    EventStream,
    Runner,
    Texts,
    TextStream,
    check_budget,
    room_left,
    sampling_params,
)
from tidal.server.options import ServerConfig


class CompletionBody(OpenAIBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


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
