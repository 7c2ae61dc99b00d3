"""Anthropic's Messages API: `POST /v1/messages`.

A request is translated into the chat messages and tools that OpenAI's chat route renders
(`translate`), so both APIs go through one renderer (`tidal.server.openai.render_prompt`) and one
conversation is the same prompt whichever API it came through:

- `system` (a string or text blocks) becomes the first, system, message;
- content is a string or blocks: `text` blocks are joined; an assistant's `tool_use` blocks become
  `tool_calls` (their `input` as JSON arguments); a user's `tool_result` blocks become tool-role
  messages (content a string or text blocks; `is_error: true` prefixes it with "Error: ", the only
  way the model can tell), in the order the blocks come;
- `tools` ({name, description, input_schema}) become functions; `tool_choice` may only be auto
  (nothing forces a call: there is no constrained decoding).

The answer is a message whose content is a text block and/or `tool_use` blocks (the `<tool_call>`
blocks the model wrote, parsed as the OpenAI route parses them) with `stop_reason` end_turn,
max_tokens, stop_sequence (and the matched `stop_sequence`) or tool_use. Streaming follows
Anthropic's events (`message_start`, `content_block_start`/`_delta`/`_stop`, `message_delta`,
`message_stop`); when tools are offered the answer is sent once whole, since a call is only known
once its text is. Errors have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`
(`error_response`; the app's handlers use it on this route). `metadata` is ignored, and so are
unknown fields (with a logged warning).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import APIRouter, Request

from tidal.adapters.async_engine import AsyncEngine
from tidal.chat.anthropic import MESSAGES_ROUTE as ROUTE
from tidal.chat.anthropic import MessagesBody, message, translate
from tidal.chat.render import render_prompt
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


# ---------------------------------------------------------------------------- the route
def router(engine: AsyncEngine, model_name: str, cfg: ServerConfig, texts: Texts | None = None) -> APIRouter:
    """`POST /v1/messages` over `engine`; `texts` tokenises (shared with the other routes)."""
    api = APIRouter()
    runner = Runner(engine)
    texts = texts or Texts(engine.tokenizer, engine.max_model_len, cfg)
    tok = engine.tokenizer

    @api.post(ROUTE)
    async def messages(body: MessagesBody, request: Request) -> Any:
        body.warn_unknown(ROUTE)
        chat, tools = translate(body)
        prompt = await render_prompt(tok, chat, tools, None, texts)
        stops = list(body.stop_sequences or [])
        params = sampling_params(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_new_tokens=min(body.max_tokens, room_left(engine, prompt, "messages")),
            stop=stops,
        )
        check_budget(cfg, [prompt], [params])
        use_tools = tools is not None
        rids = [uuid.uuid4().hex]
        if not body.stream:
            (out,) = await runner.run(request, [prompt], [params], rids)
            return message(out, stops, stops, use_tools, model_name, len(prompt))

        async def events():
            head = message_head(model_name, len(prompt))
            yield event("message_start", {"message": head})
            stream = TextStream(tok, stops=stops)
            if not use_tools:  # text streams as it comes; with tools, the blocks once the answer is whole
                yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            async for _, ids, _, _, out in runner.stream([prompt], [params], rids):
                if out is None:
                    if not use_tools and (delta := stream.add(ids)):
                        yield text_delta(delta)
                    continue
                whole = message(out, stops, stops, use_tools, model_name, len(prompt))
                if use_tools:
                    for k, block in enumerate(whole["content"]):
                        for e in block_events(k, block):
                            yield e
                else:
                    if tail := stream.add([], final=True):
                        yield text_delta(tail)
                    yield event("content_block_stop", {"index": 0})
                stop = {"stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]}
                yield event("message_delta", {"delta": stop, "usage": {"output_tokens": len(out.token_ids)}})
            yield event("message_stop", {})

        return EventStream(events(), engine, rids)

    return api


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
    return event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
