"""Anthropic's Messages API: `POST /v1/messages`.

A request is translated into the chat messages and tools that OpenAI's chat route renders
(`tidal.chat.anthropic.translate`, which says how), so both APIs go through one renderer
(`tidal.chat.render.render_prompt`) and one conversation is the same prompt whichever API it came
through. The answer is a message whose content is a text block and/or `tool_use` blocks
(`tidal.chat.anthropic.message`). Streaming follows Anthropic's events (`message_start`,
`content_block_start`/`_delta`/`_stop`, `message_delta`, `message_stop`); when tools are offered
the answer is sent once whole, since a call is only known once its text is. Errors have
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`
(`tidal.chat.http_errors.anthropic_error_response`; the app's handlers use it on this route).
`metadata` is ignored, and so are unknown fields (with a logged warning).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from tidal.chat.anthropic import MESSAGES_ROUTE as ROUTE
from tidal.chat.anthropic import MessagesBody, message, translate
from tidal.chat.render import render_prompt
from tidal.server.common import EventStream, Stream, TextStream, check_budget, room_left, sampling_params
from tidal.server.state import Served, State


def event(kind: str, data: dict) -> str:
    """One server-sent event as Anthropic sends it: its type named on the `event:` line too."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def block_events(index: int, block: dict) -> list[str]:
    """A whole content block as start, one delta and stop."""
    if block["type"] == "tool_use":
        start = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    else:
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    return [
        event("content_block_start", {"index": index, "content_block": start}),
        event("content_block_delta", {"index": index, "delta": delta}),
        event("content_block_stop", {"index": index}),
    ]


def message_head(model: str, input_tokens: int) -> dict:
    """`message_start`'s message: nothing generated yet."""
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }


def text_delta(text: str) -> str:
    """More text of the answer's one text block."""
    return event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})


routes = APIRouter()


@routes.post(ROUTE)
async def messages(body: MessagesBody, request: Request, s: State) -> Any:
    """Anthropic's `/v1/messages`: the request as chat, rendered, answered once, whole or streamed."""
    body.warn_unknown(ROUTE)
    chat, tools = translate(body)
    prompt = await render_prompt(s.tok, chat, tools, None, s.texts)
    stops = list(body.stop_sequences or [])
    params = sampling_params(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        max_new_tokens=min(body.max_tokens, room_left(s.engine, prompt, "messages")),
        stop=stops,
    )
    check_budget(s.cfg, [prompt], [params])
    use_tools = tools is not None
    rids = [uuid.uuid4().hex]
    if not body.stream:
        (out,) = await s.runner.run(request, [prompt], [params], rids)
        return message(out, stops, stops, use_tools, s.model_name, len(prompt))
    stream = await s.runner.stream([prompt], [params], rids)  # refused requests are answered as errors
    return EventStream(message_events(s, prompt, stream, stops, use_tools, rids), s.engine, rids)


async def message_events(
    s: Served, prompt: list[int], stream: Stream, stops: list[str], use_tools: bool, rids: list[str]
) -> AsyncIterator[str]:
    """The answer as Anthropic's events: text as it comes, or with tools the blocks once whole."""
    yield event("message_start", {"message": message_head(s.model_name, len(prompt))})
    text = TextStream(s.tok, stops=stops)
    if not use_tools:  # text streams as it comes; with tools, the blocks once the answer is whole
        yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    async for _, ids, _, _, out in stream:
        if out is None:
            if not use_tools and (delta := text.add(ids)):
                yield text_delta(delta)
            continue
        whole = message(out, stops, stops, use_tools, s.model_name, len(prompt))
        for e in closing_events(whole, out, text, use_tools):
            yield e
    yield event("message_stop", {})


def closing_events(whole: dict, out: Any, stream: TextStream, use_tools: bool) -> list[str]:
    """The events that end the answer `whole` (engine output `out`): its blocks (with tools) or
    the text held back, then `message_delta` with the stop reason and the tokens generated."""
    events: list[str] = []
    if use_tools:
        for k, block in enumerate(whole["content"]):
            events += block_events(k, block)
    else:
        if tail := stream.add([], final=True):
            events.append(text_delta(tail))
        events.append(event("content_block_stop", {"index": 0}))
    stop = {"stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]}
    events.append(event("message_delta", {"delta": stop, "usage": {"output_tokens": len(out.token_ids)}}))
    return events
