"""OpenAI's API: `/v1/models`, `/v1/completions` and `/v1/chat/completions`.

Both generation routes take `n`, `stop`, `seed` (sample j of a seeded request uses seed + j),
`max_tokens`, `temperature`, `top_p` (and tidal's `top_k`, `min_p`), `presence_penalty`,
`frequency_penalty`, `logit_bias` (applied to the logits before sampling), `logprobs` (chat:
`logprobs` + `top_logprobs`; completions: `logprobs` = number of alternatives) and
`stream` (server-sent events; `stream_options.include_usage` adds a last chunk with the usage).
Chat content may be a string or text parts. `tools` are rendered through the chat template (or,
for a template without tool support, spelled out in the system message: `tidal.chat.tools`),
and `<tool_call>` blocks in the answer come back as `message.tool_calls` with `finish_reason:
"tool_calls"`; `tool_choice` may be auto or none (none renders no tools): "required" and a named
function, which nothing can force without constrained decoding, are refused (400), as the
Anthropic route refuses `any` and `tool`. `response_format` other than `{"type": "text"}` is
refused (no constrained decoding). Unknown fields are ignored with a logged warning.

Log-probs are those of the tempered distribution each token was drawn from; the alternatives are
the most likely tokens of softmax(logits / temperature) (the same distribution with top-p, top-k
and min-p off, their defaults).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from tidal.chat.errors import BadRequest
from tidal.chat.openai import (
    ChatAnswer,
    ChatBody,
    OpenAIBody,
    chat_events,
    chat_max_tokens,
    check_chat,
    models_list,
    sse,
    stops_of,
    text_of,
    token_piece,
    usage,
    uses_tools,
)
from tidal.chat.render import render_chat
from tidal.chat.text import TextStream
from tidal.contracts import SamplingParams
from tidal.server.common import (
    EventStream,
    Stream,
    check_budget,
    check_token_id,
    room_left,
    sampling_params,
)
from tidal.server.options import ServerConfig
from tidal.server.state import Served, State


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
        check_token_id(token, vocab_size, "logit_bias")
    return out


def check_n(body: OpenAIBody, cfg: ServerConfig, route: str) -> None:
    """Warn about the body's unknown fields; BadRequest for an `n` beyond the server's limit."""
    body.warn_unknown(route)
    if body.n < 1 or body.n > cfg.max_n:
        raise BadRequest(f"n: must be between 1 and {cfg.max_n} on this server, got {body.n}")


@dataclass
class Samples:
    """What one request asks the engine for: its distinct prompts (usage counts each once), every
    sample's prompt, parameters and rid (n samples per prompt, prompt-major), its stop strings."""

    prompts: list[list[int]]
    all_prompts: list[list[int]]
    params: list[SamplingParams]
    rids: list[str]
    stops: list[str]


def samples_for(
    s: Served, body: OpenAIBody, prompts: list[list[int]], max_tokens: int | None, field_name: str, top: int
) -> Samples:
    """n samples per prompt, prompt-major order, each at most `max_tokens` (set by `field_name`) long
    and never past the context."""
    bias = _logit_bias(body.logit_bias, s.engine.vocab_size)
    all_prompts, params = [], []
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"{field_name}: must be >= 1, got {max_tokens}")
    for prompt in prompts:
        room = room_left(s.engine, prompt)
        for j in range(body.n):
            params.append(
                sampling_params(
                    vocab_size=s.engine.vocab_size,
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
    check_budget(s.cfg, all_prompts, params)
    return Samples(prompts, all_prompts, params, [uuid.uuid4().hex for _ in all_prompts], stops_of(body))


routes = APIRouter()


@routes.get("/v1/models")
async def models(s: State) -> dict:
    """The one model served."""
    return models_list(s.model_name, s.engine.max_model_len)


# ---------------------------------------------------------------------------- completions
@dataclass
class Completion:
    """The answer shape of one `/v1/completions` request: its id and time, the model, and how many
    log-prob alternatives it asked for (None: no log-probs)."""

    tok: Any
    model: str
    logprobs: int | None
    cid: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def obj(self, choices: list[dict], **extra: Any) -> dict:
        """The answer (or a chunk of its stream) with these choices."""
        head = {"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}

    @staticmethod
    def choice(i: int, text: str, lp: dict | None, reason: str | None) -> dict:
        """Sample `i`'s choice (or its stream's next piece)."""
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}

    def logprobs_of(self, ids: list[int], lps: list[float], tops: list, offset0: int) -> dict | None:
        """The completions API's `logprobs` of tokens whose text starts at `offset0`."""
        if self.logprobs is None:
            return None
        tokens = [token_piece(self.tok, t) for t in ids]
        offsets, pos = [], offset0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        alts = [{token_piece(self.tok, t): v for t, v in a} for a in tops] if self.logprobs else None
        return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": alts, "text_offset": offsets}

    def whole(self, outs: list, job: Samples) -> dict:
        """The answer of a request that does not stream."""
        choices = [
            self.choice(
                i,
                text_of(o, job.stops),
                self.logprobs_of(o.token_ids, o.log_probs, o.top_logprobs or [], 0),
                o.finish_reason,
            )
            for i, o in enumerate(outs)
        ]
        return self.obj(choices, usage=usage(job.prompts, outs))


async def completion_prompts(s: Served, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """The prompt ids of `/v1/completions`' `prompt`: a text, texts, token ids or lists of them."""
    if isinstance(prompt, str):
        prompts = await s.texts.encode([prompt], "prompt")
    elif prompt and all(isinstance(x, str) for x in prompt):
        prompts = await s.texts.encode(prompt, "prompt")  # type: ignore[arg-type]
    elif prompt and all(isinstance(x, list) for x in prompt):
        prompts = [list(x) for x in prompt]  # type: ignore[union-attr]
    else:
        prompts = [list(prompt)]  # type: ignore[arg-type]
    if any(not x for x in prompts):
        raise BadRequest("prompt: empty prompt")
    if len(prompts) > s.cfg.max_batch:
        raise BadRequest(f"prompt: {len(prompts)} prompts; at most {s.cfg.max_batch} per request")
    return prompts


@routes.post("/v1/completions")
async def completions(body: CompletionBody, request: Request, s: State) -> Any:
    """OpenAI's `/v1/completions`: n samples of each prompt, whole or streamed."""
    check_n(body, s.cfg, "/v1/completions")
    if body.echo:
        raise BadRequest("echo: not supported (the engine does not score prompts)")
    if body.logprobs is not None and not 0 <= body.logprobs <= 20:
        raise BadRequest(f"logprobs: must be in [0, 20], got {body.logprobs}")
    prompts = await completion_prompts(s, body.prompt)
    job = samples_for(s, body, prompts, body.max_tokens, "max_tokens", body.logprobs or 0)
    answer = Completion(s.tok, s.model_name, body.logprobs)
    if body.stream:
        stream = await s.runner.stream(job.all_prompts, job.params, job.rids)  # refusals are answered as errors
        return EventStream(completion_events(s, body, answer, job, stream), s.engine, job.rids)
    outs = await s.runner.run(request, job.all_prompts, job.params, job.rids)
    return answer.whole(outs, job)


async def completion_events(
    s: Served, body: CompletionBody, answer: Completion, job: Samples, stream: Stream
) -> AsyncIterator[str]:
    """A completion's stream: each sample's new text as it comes, its finish reason, the usage if
    asked for, then `data: [DONE]`."""
    streams = [TextStream(s.tok, stops=job.stops) for _ in job.all_prompts]
    outs = []
    async for i, ids, lps, tops, out in stream:
        if out is None:
            at = streams[i].sent
            yield sse(answer.obj([answer.choice(i, streams[i].add(ids), answer.logprobs_of(ids, lps, tops, at), None)]))
            continue
        outs.append(out)
        yield sse(answer.obj([answer.choice(i, streams[i].add([], final=True), None, out.finish_reason)]))
    if body.stream_options and body.stream_options.include_usage:
        yield sse(answer.obj([], usage=usage(job.prompts, outs)))
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------- chat
@routes.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, request: Request, s: State) -> Any:
    """OpenAI's `/v1/chat/completions`: n answers to the chat, whole or streamed, tool calls parsed."""
    check_n(body, s.cfg, "/v1/chat/completions")
    check_chat(body)
    top = body.top_logprobs or 0
    raw = [m.model_dump(exclude_none=True) for m in body.messages]
    prompt, images = await render_chat(s.tok, raw, body.tools, body.tool_choice, s.texts, s.images)
    job = samples_for(s, body, [prompt], *chat_max_tokens(body), top)
    answer = ChatAnswer(s.tok, s.model_name, job.stops, uses_tools(body), body.logprobs, top)
    if body.stream:  # refusals are answered as errors
        stream = await s.runner.stream(job.all_prompts, job.params, job.rids, images)
        include = bool(body.stream_options and body.stream_options.include_usage)
        events = chat_events(answer, stream, len(job.all_prompts), job.prompts, include)
        return EventStream(events, s.engine, job.rids)
    outs = await s.runner.run(request, job.all_prompts, job.params, job.rids, images)
    return answer.whole(outs, job.prompts)
