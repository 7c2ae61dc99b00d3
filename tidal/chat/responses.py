"""OpenAI's Responses API as chat: a request's items translated into the chat messages and tools
that the chat route renders (`translate`), so every API goes through one renderer
(`tidal.chat.render.render_prompt`) and one conversation is the same prompt whichever API it came
through; the engine's answer as a `response` object (`ResponseAnswer.whole`) or its stream of
events (`response_events`), shared by `tidal serve` and the agent door.

- `instructions` becomes the first, system, message (those of a previous response are not carried
  over, as OpenAI does);
- `input` is a string (one user message) or items: messages (role user, system, developer (a
  system message: chat templates know no other name for it) or assistant; content a string or
  `input_text`/`output_text` parts: images, files and audio are refused), `function_call` items
  (an assistant message's `tool_calls`; calls that follow an assistant message, or each other,
  join that one message, which is how an answer with text and calls comes back as items) and
  `function_call_output` items (tool messages). `reasoning` items are refused: this server never
  returns one, and their content (encrypted, or a summary of text the model never sampled) cannot
  be rendered as what the model saw;
- `previous_response_id` prepends the stored items (input and output) of that response;
- `tools` are function tools (`{"type": "function", "name", "description", "parameters",
  "strict"}`; `strict` is not enforced: there is no constrained decoding, as `tool_choice` may only
  be auto or none).

The answer's output is a `message` item with one `output_text` part (its log-probs when `include`
asks for "message.output_text.logprobs") and/or `function_call` items (the `<tool_call>` blocks
the model wrote, parsed as the chat route parses them); an answer cut by its token limit is
`status: "incomplete"` with `incomplete_details.reason` "max_output_tokens".
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.chat.anthropic import block_text, chat_function
from tidal.chat.body import Body
from tidal.chat.errors import BadRequest
from tidal.chat.openai import Outputs, chat_logprobs, check_tool_choice, text_of
from tidal.chat.text import TextStream
from tidal.chat.tools import call_arguments, parse_tool_calls

RESPONSES_ROUTE = "/v1/responses"
LOGPROBS = "message.output_text.logprobs"  # the one `include` value this server can honour
TEXT_PARTS = ("input_text", "output_text")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponsesBody(Body):
    """`POST /v1/responses`: what the `openai` package and the OpenAI Agents SDK send (`seed` and
    `top_k` are tidal's, as on the other routes); unknown fields are ignored with a warning."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    user: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None


# ---------------------------------------------------------------------------- checks
def check_responses(body: ResponsesBody) -> None:
    """BadRequest for fields this server cannot honour, naming the field."""
    fmt = ((body.text or {}).get("format") or {}).get("type", "text")
    if fmt != "text":
        raise BadRequest(
            f"text.format: type {fmt!r} is not supported (no constrained decoding); use 'text' and validate the "
            "answer yourself"
        )
    for value in body.include or []:
        if value != LOGPROBS:
            raise BadRequest(f"include: {value!r} is not supported; this server can include {LOGPROBS!r} only")
    if body.top_logprobs is not None and (LOGPROBS not in (body.include or []) or not 0 <= body.top_logprobs <= 20):
        raise BadRequest(f"top_logprobs: needs include [{LOGPROBS!r}] and a value in [0, 20]")
    if body.truncation not in (None, "disabled"):
        raise BadRequest(
            f"truncation: {body.truncation!r} is not supported (nothing is dropped from a conversation to fit the "
            "context); use 'disabled'"
        )
    if body.reasoning and any(v is not None for v in body.reasoning.values()):
        raise BadRequest("reasoning: not supported (the model's reasoning cannot be configured); leave it out")
    if body.background:
        raise BadRequest("background: not supported; a response is answered on its request")
    if body.conversation is not None:
        raise BadRequest("conversation: not supported; chain responses with previous_response_id")
    if body.prompt is not None:
        raise BadRequest("prompt: stored prompt templates are not supported; send instructions and input")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise BadRequest(f"max_output_tokens: must be >= 1, got {body.max_output_tokens}")
    check_tool_choice(chat_tool_choice(body.tool_choice))


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    """A Responses `tool_choice` in the chat route's shape (a named function: `{"type":
    "function", "name"}` there, `{"type": "function", "function": {"name"}}` here)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


# ---------------------------------------------------------------------------- request → chat
def input_items(body: ResponsesBody) -> list[dict]:
    """The request's input as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def part_text(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as one string."""
    return block_text(content, where, TEXT_PARTS, "part")


def function_call(item: dict, where: str) -> dict:
    """A `function_call` item as a chat tool call (its `call_id` as the call's id)."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise BadRequest(f"{where}.{key}: must be a string")
    try:
        call_arguments(item["arguments"], f"{where}.arguments")
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def items_chat(items: list[dict], where: str = "input") -> list[dict]:
    """Items as chat messages (the module docstring says how); BadRequest naming the item."""
    out: list[dict] = []
    calls_may_join = False  # whether out[-1] is an assistant message a function_call joins
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{at}: must be an item object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise BadRequest(f"{at}.role: must be user, assistant, system or developer, got {item.get('role')!r}")
            out.append({"role": role, "content": part_text(item.get("content"), f"{at}.content")})
            calls_may_join = role == "assistant"
        elif kind == "function_call":
            call = function_call(item, at)
            if calls_may_join:
                last = out[-1]
                last["tool_calls"] = [*last.get("tool_calls", []), call]
                last["content"] = last["content"] or None  # as an answer with calls only has it
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls_may_join = True
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{at}.call_id: must be a string")
            text = part_text(item.get("output"), f"{at}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
            calls_may_join = False
        elif kind == "reasoning":
            raise BadRequest(
                f"{at}.type: reasoning items are not supported: this server returns none, and their content "
                "cannot be rendered as text the model saw"
            )
        else:
            raise BadRequest(f"{at}.type: items are message, function_call or function_call_output, got {kind!r}")
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools as the chat route's functions (None when there are none)."""
    return [function_tool(tool, i) for i, tool in enumerate(tools)] if tools else None


def function_tool(tool: dict, i: int) -> dict:
    """Tool `i`, a function tool of the Responses API, as a chat function."""
    if tool.get("type") != "function":
        raise BadRequest(f"tools[{i}].type: only function tools are supported, got {tool.get('type')!r}")
    parameters = tool.get("parameters")
    if parameters is None:  # a function of no arguments may leave it out
        parameters = {"type": "object"}
    return chat_function(tool, i, parameters if isinstance(parameters, dict) else None, "parameters")


def translate(body: ResponsesBody, history: list[dict]) -> tuple[list[dict], list[dict] | None]:
    """(chat messages, chat tools) of a Responses request whose previous response's items are
    `history`; tools are None when `tool_choice` is "none" (nothing is offered, nothing parsed)."""
    check_responses(body)
    items = input_items(body)
    if not items and not history:
        raise BadRequest("input: at least one item is needed")
    out = [{"role": "system", "content": body.instructions}] if body.instructions else []
    out += items_chat(history, "previous_response_id") + items_chat(items)
    tools = chat_tools(body.tools)
    return out, (tools if body.tool_choice != "none" else None)


# ---------------------------------------------------------------------------- stored responses
class ResponseStore:
    """The items (input and output) of recent responses, for `previous_response_id`: the newest
    `max_responses` and at most `max_chars` characters of items in all, oldest dropped first (a
    server's memory must not grow with its traffic)."""

    def __init__(self, max_responses: int = 1024, max_chars: int = 64 * 2**20) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self.items: OrderedDict[str, tuple[list[dict], int]] = OrderedDict()
        self.chars = 0

    def history(self, rid: str | None) -> list[dict]:
        """The items of response `rid` ([] for None); BadRequest naming an id not kept."""
        if rid is None:
            return []
        if rid not in self.items:
            raise BadRequest(
                f"previous_response_id: no stored response {rid!r} (responses are kept in memory, the latest "
                f"{self.max_responses}, and only with store: true)"
            )
        self.items.move_to_end(rid)
        return self.items[rid][0]

    def put(self, rid: str, items: list[dict]) -> None:
        """Keep `items` as response `rid`'s, dropping the oldest beyond the limits."""
        size = len(json.dumps(items, ensure_ascii=False))
        self.items[rid] = (items, size)
        self.chars += size
        while self.items and (len(self.items) > self.max_responses or self.chars > self.max_chars):
            _, (_, dropped) = self.items.popitem(last=False)
            self.chars -= dropped


# ---------------------------------------------------------------------------- the answer
def usage(input_tokens: int, output_tokens: int) -> dict:
    """The Responses API's usage (nothing cached, no reasoning tokens)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass
class ResponseAnswer:
    """The answer shape of one `/v1/responses` request: its id, what it echoes of the request,
    its stop strings, whether tool calls are parsed out and which log-probs it asked for. The
    output items are made once (`output`), so a streamed answer carries the ids of the whole one."""

    tok: Any
    body: ResponsesBody
    model: str
    stops: list[str]
    use_tools: bool
    input_tokens: int
    rid: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: new_id("msg"))
    made: list[dict] | None = None

    @property
    def logprobs(self) -> bool:
        return LOGPROBS in (self.body.include or [])

    def obj(self, status: str, output: list[dict], out: Any = None) -> dict:
        """The `response` object: the request echoed, `output` and (once done) its usage."""
        b = self.body
        incomplete = status == "incomplete"
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls if b.parallel_tool_calls is not None else True,
            "previous_response_id": b.previous_response_id,
            "reasoning": b.reasoning,
            "store": b.store if b.store is not None else True,
            "temperature": b.temperature if b.temperature is not None else 1.0,
            "text": b.text or {"format": {"type": "text"}},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [],
            "top_logprobs": b.top_logprobs,
            "top_p": b.top_p if b.top_p is not None else 1.0,
            "truncation": b.truncation or "disabled",
            "usage": usage(self.input_tokens, len(out.token_ids)) if out is not None else None,
            "user": b.user,
            "metadata": b.metadata or {},
        }

    def head(self) -> dict:
        """The response as the stream starts: in progress, nothing generated yet."""
        return self.obj("in_progress", [])

    def token_logprobs(self, ids: list[int], lps: list[float], tops: list) -> list[dict]:
        """`output_text.logprobs` entries of these tokens ([] unless `include` asks for them)."""
        if not self.logprobs:
            return []
        return chat_logprobs(self.tok, ids, lps, tops, self.body.top_logprobs or 0)["content"]

    def text_part(self, text: str, logprobs: list[dict]) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def message_item(self, status: str, content: list[dict]) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def output(self, out: Any) -> list[dict]:
        """The output items of engine output `out`: its text as a message, and a `function_call`
        item for each `<tool_call>` it wrote when tools were offered (the text then holds what is
        around them, and no message item is made when nothing is)."""
        if self.made is None:
            text = text_of(out, self.stops)
            calls = []
            if self.use_tools:
                rest, found, _ = parse_tool_calls(text)
                if found:
                    text = rest
                    for c in found:
                        arguments = json.dumps(c.arguments, ensure_ascii=False)
                        calls.append(
                            {
                                "type": "function_call",
                                "id": new_id("fc"),
                                "call_id": new_id("call"),
                                "name": c.name,
                                "arguments": arguments,
                                "status": "completed",
                            }
                        )
            lps = self.token_logprobs(out.token_ids, out.log_probs, getattr(out, "top_logprobs", None) or [])
            message = [self.message_item("completed", [self.text_part(text, lps)])] if text or not calls else []
            self.made = message + calls
        return self.made

    def whole(self, out: Any) -> dict:
        """The answer of engine output `out`, done."""
        status = "incomplete" if out.finish_reason == "length" else "completed"
        return self.obj(status, self.output(out), out)


# ---------------------------------------------------------------------------- the stream
class Events:
    """Server-sent events as the Responses API sends them: the type on the `event:` line too, and
    each numbered in order (`sequence_number`)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **data: Any) -> str:
        e = {"type": kind, "sequence_number": self.n, **data}
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n"


def item_events(event: Events, index: int, item: dict) -> list[str]:
    """A whole output item as its events: added, its content (text in one delta, or the call's
    arguments), done."""
    where = {"item_id": item["id"], "output_index": index}
    if item["type"] == "function_call":
        return [
            event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            event("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]),
            event("response.output_item.done", output_index=index, item=item),
        ]
    (part,) = item["content"]
    return [
        event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []}),
        event("response.content_part.added", **where, content_index=0, part={**part, "text": "", "logprobs": []}),
        event("response.output_text.delta", **where, content_index=0, delta=part["text"], logprobs=part["logprobs"]),
        *text_done(event, index, item),
    ]


def text_done(event: Events, index: int, item: dict) -> list[str]:
    """The events closing a message item whose text was sent."""
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    (part,) = item["content"]
    return [
        event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
        event("response.content_part.done", **where, part=part),
        event("response.output_item.done", output_index=index, item=item),
    ]


async def response_events(
    answer: ResponseAnswer, outputs: Outputs, whole_of: Callable[[Any], dict]
) -> AsyncIterator[str]:
    """The answer as the Responses API's events: `response.created`, `response.in_progress`, then
    its text as it comes (with tools, its items once the answer is whole, since a call is only
    known once its text is), then `response.completed` or `response.incomplete`. `outputs` is the
    engine's output as it comes (one sample); `whole_of(final output)` is the whole response
    (`tidal serve` stores it for `previous_response_id`; the agent door passes the one it recorded)."""
    event = Events()
    yield event("response.created", response=answer.head())
    yield event("response.in_progress", response=answer.head())
    where = {"item_id": answer.message_id, "output_index": 0, "content_index": 0}
    if not answer.use_tools:  # the text streams as it comes
        yield event("response.output_item.added", output_index=0, item=answer.message_item("in_progress", []))
        yield event("response.content_part.added", **where, part=answer.text_part("", []))
    text = TextStream(answer.tok, stops=answer.stops)
    async for _, ids, lps, tops, out in outputs:
        if out is None:
            if answer.use_tools:
                continue
            delta, logprobs = text.add(ids), answer.token_logprobs(ids, lps, tops)
            if delta or logprobs:  # a token's text may wait for the next (UTF-8, a stop string)
                yield event("response.output_text.delta", **where, delta=delta, logprobs=logprobs)
            continue
        whole = whole_of(out)
        if answer.use_tools:
            for k, item in enumerate(whole["output"]):
                for e in item_events(event, k, item):
                    yield e
        else:
            if tail := text.add([], final=True):
                yield event("response.output_text.delta", **where, delta=tail, logprobs=[])
            for e in text_done(event, 0, whole["output"][0]):
                yield e
        yield event(f"response.{whole['status']}", response=whole)
