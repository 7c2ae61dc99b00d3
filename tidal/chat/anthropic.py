"""Anthropic's Messages API as chat: a request translated into the chat messages and tools that
OpenAI's chat route renders (`translate`), so both APIs go through one renderer
(`tidal.chat.render.render_prompt`) and one conversation is the same prompt whichever API it came
through, and the engine's answer as a Messages answer (`message`).

- `system` (a string or text blocks) becomes the first, system, message;
- content is a string or blocks: `text` blocks are joined; an assistant's `tool_use` blocks become
  `tool_calls` (their `input` as JSON arguments); a user's `tool_result` blocks become tool-role
  messages (content a string or text blocks; `is_error: true` prefixes it with "Error: ", the only
  way the model can tell), in the order the blocks come;
- `tools` ({name, description, input_schema}) become functions; `tool_choice` may only be auto
  (nothing forces a call: there is no constrained decoding).

The answer is a message whose content is a text block and/or `tool_use` blocks (the `<tool_call>`
blocks the model wrote, parsed as the OpenAI route parses them) with `stop_reason` end_turn,
max_tokens, stop_sequence (and the matched `stop_sequence`) or tool_use; streamed, it is
Anthropic's events (`message_events`: `message_start`, `content_block_start`/`_delta`/`_stop`,
`message_delta`, `message_stop`), shared by `tidal serve` and the agent door.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from tidal.chat.body import Body
from tidal.chat.errors import BadRequest
from tidal.chat.openai import Outputs, text_of
from tidal.chat.text import TextStream
from tidal.chat.tools import parse_tool_calls

MESSAGES_ROUTE = "/v1/messages"


def speaks_anthropic(path: str) -> bool:
    """Whether a request's path is Anthropic's route (on `tidal serve` or a door session)."""
    return path.endswith(MESSAGES_ROUTE)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]]


class MessagesBody(Body):
    model: str | None = None
    max_tokens: int
    messages: list[Message]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


# ---------------------------------------------------------------------------- request → chat
def block_text(content: Any, where: str, kinds: tuple[str, ...] = ("text",), noun: str = "block") -> str:
    """A string, or text blocks joined (of the `kinds` that hold text; the Responses API calls
    them parts, its `noun`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: must be a string or a list of text {noun}s")
    out = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in kinds or not isinstance(block.get("text"), str):
            if kinds == ("text",):
                raise BadRequest(
                    f"{where}[{j}]: expected a text block {{'type': 'text', 'text': ...}}, got type {kind!r}"
                )
            raise BadRequest(f"{where}[{j}].type: only text {noun}s ({', '.join(kinds)}) are supported, got {kind!r}")
        out.append(block["text"])
    return "".join(out)


def tool_call(block: dict, where: str) -> dict:
    """A `tool_use` block as an OpenAI tool call (the same dict whether it came in a request or
    went out in an answer, so the agent door knows its own answers sent back)."""
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise BadRequest(f"{where}: a tool_use block needs a string id and name")
    if not isinstance(block.get("input"), dict):
        raise BadRequest(f"{where}.input: must be an object")
    arguments = json.dumps(block["input"], ensure_ascii=False)
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}


def assistant_chat_message(blocks: list[dict], where: str = "content") -> dict:
    """An assistant's content blocks as one OpenAI chat message."""
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(block_text([block], where))
        elif kind == "tool_use":
            calls.append(tool_call(block, f"{where}[{j}]"))
        else:
            raise BadRequest(f"{where}[{j}].type: an assistant's blocks are text or tool_use, got {kind!r}")
    if calls:
        return {"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls}
    return {"role": "assistant", "content": "".join(texts)}


def user_chat_messages(blocks: list[dict], where: str) -> list[dict]:
    """A user's content blocks as chat messages: runs of text (and images) as user messages, each
    tool_result as a tool message, in their order. An image block (`source` of type base64) becomes
    OpenAI's image part with a data: URI."""
    out: list[dict] = []
    parts: list[dict] = []

    def flush() -> None:
        if any(p["type"] != "text" for p in parts):
            out.append({"role": "user", "content": list(parts)})
        else:
            out.append({"role": "user", "content": "".join(p["text"] for p in parts)})
        parts.clear()

    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": block_text([block], where)})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": image_uri(block, f"{where}[{j}]")}})
        elif kind == "tool_result":
            if parts:
                flush()
            if not isinstance(block.get("tool_use_id"), str):
                raise BadRequest(f"{where}[{j}].tool_use_id: must be a string")
            text = block_text(block.get("content", ""), f"{where}[{j}].content")
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise BadRequest(f"{where}[{j}].type: a user's blocks are text, image or tool_result, got {kind!r}")
    if parts or not out:
        flush()
    return out


def image_uri(block: dict, where: str) -> str:
    """An image block's picture as a data: URI (only base64 sources: nothing is fetched)."""
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        kind = source.get("type") if isinstance(source, dict) else None
        raise BadRequest(f"{where}.source: only base64 image sources are taken (nothing is fetched), got {kind!r}")
    if not isinstance(source.get("media_type"), str) or not isinstance(source.get("data"), str):
        raise BadRequest(f"{where}.source: needs a string media_type and data")
    return f"data:{source['media_type']};base64,{source['data']}"


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic's tools as OpenAI's functions."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise BadRequest(f"tools[{i}].type: {tool['type']!r} is a server tool; only custom tools are supported")
        schema = tool.get("input_schema")
        out.append(chat_function(tool, i, schema if isinstance(schema, dict) else None, "input_schema"))
    return out


def chat_function(tool: dict, i: int, schema: dict | None, schema_field: str) -> dict:
    """Tool `i` (its name, its description if any) with the JSON schema `schema` of its arguments
    as an OpenAI function; BadRequest naming the field (`schema_field`) that is not right."""
    if not isinstance(tool.get("name"), str):
        raise BadRequest(f"tools[{i}].name: must be a string")
    if schema is None:
        raise BadRequest(f"tools[{i}].{schema_field}: must be a JSON schema object")
    function = {"name": tool["name"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": {**function, "parameters": schema}}


def translate(body: MessagesBody) -> tuple[list[dict], list[dict] | None]:
    """(OpenAI chat messages, OpenAI tools) of a Messages request; BadRequest naming the field."""
    if body.tool_choice is not None and body.tool_choice.get("type") != "auto":
        raise BadRequest(
            f"tool_choice: only {{'type': 'auto'}} is supported (nothing can force or forbid a call: there is no "
            f"constrained decoding), got type {body.tool_choice.get('type')!r}"
        )
    if body.max_tokens < 1:
        raise BadRequest(f"max_tokens: must be >= 1, got {body.max_tokens}")
    if not body.messages:
        raise BadRequest("messages: at least one message is needed")
    out: list[dict] = []
    if body.system:
        out.append({"role": "system", "content": block_text(body.system, "system")})
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            out.append(assistant_chat_message(blocks, where))
        elif m.role == "user":
            out += user_chat_messages(blocks, where)
        else:
            raise BadRequest(f"messages[{i}].role: must be 'user' or 'assistant', got {m.role!r}")
    return out, chat_tools(body.tools)


# ---------------------------------------------------------------------------- answer → message
def matched_stop(text: str, stops: list[str]) -> str | None:
    """The stop string that ended `text` (the engine's text keeps it): the earliest found."""
    found = [(text.find(s), k) for k, s in enumerate(stops) if s and s in text]
    return stops[min(found)[1]] if found else None


def content_blocks(text: str, use_tools: bool) -> list[dict]:
    """The answer's content: its text, and `tool_use` blocks for the `<tool_call>`s it wrote when
    the request offered tools (the text block then holds what is around them, if anything)."""
    if use_tools:
        rest, calls, _ = parse_tool_calls(text)
        if calls:
            uses = [
                {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": c.name, "input": c.arguments}
                for c in calls
            ]
            return [{"type": "text", "text": rest}, *uses] if rest else uses
    return [{"type": "text", "text": text}]


def message(out: Any, stops: list[str], requested: list[str], use_tools: bool, model: str, input_tokens: int) -> dict:
    """The Messages answer of engine output `out`: `stops` are every stop string it ran with,
    `requested` the request's own `stop_sequences` (the only ones reported as matched)."""
    blocks = content_blocks(text_of(out, stops), use_tools)
    stop = matched_stop(out.text, stops) if out.finish_reason == "stop" else None
    if any(b["type"] == "tool_use" for b in blocks):
        reason, stop = "tool_use", None
    elif out.finish_reason == "length":
        reason = "max_tokens"
    elif stop is not None and stop in requested:
        reason = "stop_sequence"
    else:
        reason, stop = "end_turn", None
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": {"input_tokens": input_tokens, "output_tokens": len(out.token_ids)},
    }


# ---------------------------------------------------------------------------- the stream
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


async def message_events(
    outputs: Outputs,
    tok: Any,
    stops: list[str],
    use_tools: bool,
    model: str,
    input_tokens: int,
    whole_of: Callable[[Any], dict],
) -> AsyncIterator[str]:
    """The answer as Anthropic's events: text as it comes, or with tools the blocks once whole.
    `outputs` is the engine's output as it comes (one sample);
    `whole_of(final output)` is the answer as a whole message (`message`), whose blocks close the
    stream (the agent door passes the message it recorded, so the streamed tool ids are its ids)."""
    yield event("message_start", {"message": message_head(model, input_tokens)})
    text = TextStream(tok, stops=stops)
    if not use_tools:  # text streams as it comes; with tools, the blocks once the answer is whole
        yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    async for _, ids, _, _, out in outputs:
        if out is None:
            if not use_tools and (delta := text.add(ids)):
                yield text_delta(delta)
            continue
        whole = whole_of(out)
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
