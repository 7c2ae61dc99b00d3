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

import uuid
from typing import Any

from fastapi import APIRouter, Request

from tidal.chat.anthropic import MESSAGES_ROUTE as ROUTE
from tidal.chat.anthropic import MessagesBody, message, message_events, translate
from tidal.chat.render import render_chat
from tidal.server.common import EventStream, check_budget, room_left, sampling_params
from tidal.server.state import State

routes = APIRouter()


@routes.post(ROUTE)
async def messages(body: MessagesBody, request: Request, s: State) -> Any:
    """Anthropic's `/v1/messages`: the request as chat, rendered, answered once, whole or streamed."""
    body.warn_unknown(ROUTE)
    chat, tools = translate(body)
    prompt, images = await render_chat(s.tok, chat, tools, None, s.texts, s.images)
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
        (out,) = await s.runner.run(request, [prompt], [params], rids, images)
        return message(out, stops, stops, use_tools, s.model_name, len(prompt))
    stream = await s.runner.stream([prompt], [params], rids, images)  # refused requests are answered as errors

    def whole(out: Any) -> dict:
        return message(out, stops, stops, use_tools, s.model_name, len(prompt))

    events = message_events(stream, s.tok, stops, use_tools, s.model_name, len(prompt), whole)
    return EventStream(events, s.engine, rids)
