"""OpenAI's chat shapes: the request bodies, the checks a chat request gets, its prompt, and the
answer as an assistant message with its log-probs and usage, whole or as the chunks of a stream
(`tidal serve`'s `/v1/chat/completions` and the agent door's answer with these, so they agree).

Log-probs are those of the tempered distribution each token was drawn from; the alternatives are
the most likely tokens of softmax(logits / temperature).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from tidal.chat.body import Body
from tidal.chat.errors import BadRequest
from tidal.chat.render import TextEncoder, render_prompt
from tidal.chat.text import TextStream, trim_stop
from tidal.chat.tools import parse_tool_calls


class StreamOptions(Body):
    include_usage: bool = False


class OpenAIBody(Body):
    """What both generation routes (completions and chat) take."""

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


def token_piece(tok: Any, t: int) -> str:
    """Token `t` as text (its id as text when there is no tokenizer)."""
    return tok.decode([t]) if tok is not None else str(t)


def usage(prompts: list[list[int]], outs: list) -> dict:
    """Each distinct prompt counted once (as OpenAI does with n > 1), every sample's tokens."""
    p, c = sum(len(x) for x in prompts), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def stops_of(body: OpenAIBody) -> list[str]:
    """The request's stop strings as a list."""
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
    check_tool_choice(body.tool_choice)


def check_tool_choice(choice: str | dict | None) -> None:
    """BadRequest for a `tool_choice` other than auto or none: "required" and a named function ask
    for a call, which nothing here can force (there is no constrained decoding), so the answer
    could come back with no call; Anthropic's route refuses its `any` and `tool` the same way."""
    if choice in (None, "none", "auto"):
        return
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    got = f"the function {name!r}" if isinstance(name, str) else repr(choice)
    raise BadRequest(
        "tool_choice: only 'auto' and 'none' are supported (nothing can force a call: there is no constrained "
        f"decoding), got {got}"
    )


def chat_max_tokens(body: ChatBody) -> tuple[int | None, str]:
    """(the requested answer length or None, the field that set it)."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


async def chat_prompt(
    tok: Any, body: ChatBody, raw: list[dict] | None = None, texts: TextEncoder | None = None
) -> list[int]:
    """The prompt ids of a chat request: its messages (`raw`: them as dicts, when the caller
    rewrote them) and tools through the tokenizer's chat template, with the generation prompt,
    tokenised as one text (within `texts`' limits when given: `tidal serve`'s)."""
    raw = raw if raw is not None else [m.model_dump(exclude_none=True) for m in body.messages]
    return await render_prompt(tok, raw, body.tools, body.tool_choice, texts)


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
    """Whether the answer is parsed for tool calls: tools offered and not turned off."""
    return bool(body.tools) and body.tool_choice != "none"


def models_list(model_name: str, max_model_len: int | None) -> dict:
    """`/v1/models`' answer: the one model served."""
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "tidal"}
    return {"object": "list", "data": [{**card, "max_model_len": max_model_len}]}


# ---------------------------------------------------------------------------- the stream
def sse(obj: dict) -> str:
    """One server-sent event of OpenAI's streams."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# What a streamed answer is made of, as the engine produces it: (sample index, new token ids, their
# log-probs, their top alternatives, None) for each step, then (index, [], [], [], final output).
Outputs = AsyncIterable[tuple[int, list[int], list[float], list, Any]]


@dataclass
class ChatAnswer:
    """The answer shape of one `/v1/chat/completions` request: its id and time, the model, its
    stop strings, whether tool calls are parsed out and which log-probs it asked for."""

    tok: Any
    model: str
    stops: list[str]
    use_tools: bool
    logprobs: bool
    top: int
    cid: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    made: dict[int, tuple[dict, str]] = field(default_factory=dict)  # messages made so far, by sample index

    def obj(self, kind: str, choices: list[dict], **extra: Any) -> dict:
        """An answer (`kind` "chat.completion") or a chunk of one with these choices."""
        head = {"id": self.cid, "object": kind, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}

    def chunk(self, choices: list[dict], **extra: Any) -> str:
        """A chunk of the stream, as its event."""
        return sse(self.obj("chat.completion.chunk", choices, **extra))

    def logprobs_of(self, ids: list[int], lps: list[float], tops: list) -> dict | None:
        """OpenAI's chat `logprobs` of these tokens, if the request asked for them."""
        return chat_logprobs(self.tok, ids, lps, tops, self.top) if self.logprobs else None

    def out_logprobs(self, out: Any) -> dict | None:
        """The `logprobs` of a whole sample (a rollout engine's `GenerationOutput` has no alternatives)."""
        return self.logprobs_of(out.token_ids, out.log_probs, getattr(out, "top_logprobs", None) or [])

    def message_of(self, i: int, out: Any) -> tuple[dict, str]:
        """(sample `i` as an assistant message, its finish reason), made once: its tool calls get
        fresh ids when made, and an answer streamed must carry the ids of the one recorded (the
        agent door records the message before it streams it)."""
        if i not in self.made:
            self.made[i] = assistant_message(text_of(out, self.stops), self.use_tools, out.finish_reason)
        return self.made[i]

    def whole(self, outs: list, prompts: list[list[int]]) -> dict:
        """The answer of a request that does not stream; `prompts` are its distinct prompts."""
        choices = []
        for i, o in enumerate(outs):
            message, reason = self.message_of(i, o)
            choices.append({"index": i, "message": message, "logprobs": self.out_logprobs(o), "finish_reason": reason})
        return self.obj("chat.completion", choices, usage=usage(prompts, outs))

    def text_chunk(self, i: int, text: str, ids: list[int], lps: list[float], tops: list) -> str:
        """Sample `i`'s new text (and its tokens' log-probs) as a chunk."""
        delta = {"content": text}
        return self.chunk(
            [{"index": i, "delta": delta, "logprobs": self.logprobs_of(ids, lps, tops), "finish_reason": None}]
        )

    def last_chunk(self, i: int, out: Any, stream: TextStream) -> str:
        """Sample `i`'s last chunk: with tools the whole message (its calls are known only now),
        else the text held back so far, with the finish reason."""
        if self.use_tools:
            message, reason = self.message_of(i, out)
            delta = {k: v for k, v in message.items() if k != "role"}  # the made message stays as it is
            if "tool_calls" in delta:
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(delta["tool_calls"])]
            return self.chunk(
                [{"index": i, "delta": delta, "logprobs": self.out_logprobs(out), "finish_reason": reason}]
            )
        tail = stream.add([], final=True)
        delta = {"content": tail} if tail else {}
        return self.chunk([{"index": i, "delta": delta, "finish_reason": out.finish_reason}])


async def chat_events(
    answer: ChatAnswer, outputs: Outputs, count: int, prompts: list[list[int]], include_usage: bool
) -> AsyncIterator[str]:
    """A chat answer's stream of `count` samples: each sample's role, its text as it comes (with
    tools, the message once whole), its finish reason, the usage (of the distinct `prompts`) if
    asked for, then `data: [DONE]`."""
    streams = [TextStream(answer.tok, stops=answer.stops) for _ in range(count)]
    for i in range(count):
        yield answer.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
    outs = []
    async for i, ids, lps, tops, out in outputs:
        if out is None:
            if not answer.use_tools:  # the calls are parsed once the answer is whole
                yield answer.text_chunk(i, streams[i].add(ids), ids, lps, tops)
            continue
        outs.append(out)
        yield answer.last_chunk(i, out, streams[i])
    if include_usage:
        yield answer.chunk([], usage=usage(prompts, outs))
    yield "data: [DONE]\n\n"
