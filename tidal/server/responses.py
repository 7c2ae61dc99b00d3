"""OpenAI's Responses API: `POST /v1/responses`.

A request's items are translated into the chat messages and tools that the chat route renders
(`tidal.chat.responses.translate`, which says how), so every API goes through one renderer
(`tidal.chat.render.render_prompt`) and one conversation is the same prompt whichever API it came
through. The answer is a `response` object whose output is a `message` item and/or
`function_call` items (`tidal.chat.responses.ResponseAnswer`); streamed, it is the Responses
events (`response.created` ... `response.completed`), the items sent once whole when tools are
offered, since a call is only known once its text is. `previous_response_id` continues a stored
response: with `store` (default true) a response's items (input and output) are kept in memory,
the latest `ServerConfig.max_stored_responses` up to `max_stored_response_chars` characters.
Sampling takes `temperature`, `top_p`, `max_output_tokens` (and tidal's `top_k` and `seed`);
what cannot be honoured (structured output, `tool_choice` "required", reasoning settings, images)
is refused with a 400 naming the field; unknown fields are ignored with a logged warning.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request

from tidal.chat.render import render_prompt
from tidal.chat.responses import RESPONSES_ROUTE as ROUTE
from tidal.chat.responses import ResponseAnswer, ResponsesBody, input_items, response_events, translate
from tidal.server.common import EventStream, check_budget, room_left, sampling_params
from tidal.server.state import State

routes = APIRouter()


@routes.post(ROUTE)
async def responses(body: ResponsesBody, request: Request, s: State) -> Any:
    """OpenAI's `/v1/responses`: the request's items as chat, rendered, answered once, whole or streamed."""
    body.warn_unknown(ROUTE)
    history = s.stored.history(body.previous_response_id)
    chat, tools = translate(body, history)
    prompt = await render_prompt(s.tok, chat, tools, None, s.texts)
    room = room_left(s.engine, prompt, "input")
    params = sampling_params(
        vocab_size=s.engine.vocab_size,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k,
        max_new_tokens=room if body.max_output_tokens is None else min(body.max_output_tokens, room),
        seed=body.seed,
        top_logprobs=body.top_logprobs or 0,
    )
    check_budget(s.cfg, [prompt], [params])
    answer = ResponseAnswer(s.tok, body, s.model_name, [], tools is not None, len(prompt))
    items = [*history, *input_items(body)]

    def whole(out: Any) -> dict:
        response = answer.whole(out)
        if body.store is not False:
            s.stored.put(response["id"], [*items, *response["output"]])
        return response

    rids = [uuid.uuid4().hex]
    if not body.stream:
        (out,) = await s.runner.run(request, [prompt], [params], rids)
        return whole(out)
    stream = await s.runner.stream([prompt], [params], rids)  # refused requests are answered as errors
    return EventStream(response_events(answer, stream, whole), s.engine, rids)
