"""What every route family shares: limits, errors in one shape, request bodies that warn about
unknown fields, tokenising off the event loop, and running (or streaming) requests on the engine.

Every error, whatever the route, is

    {"error": {"message": "<field>: <what is wrong>", "type": "...", "param": "<field>" | null, "code": <status>}}

(OpenAI's shape, which OpenAI clients turn into exceptions carrying the message).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from tidal.config import ServerConfig
from tidal.engine.async_engine import AsyncEngine
from tidal.engine.sampling import SamplingParams

log = logging.getLogger("tidal.server")

DISCONNECT_POLL_S = 1.0


class ApiError(Exception):
    """An error answered as `{"error": {...}}` with HTTP `status`."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind = status, kind
        self.param = param if param is not None else (message.split(":", 1)[0] if ":" in message else None)


class BadRequest(ApiError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, 400, "invalid_request_error", param)


def error_response(
    status: int, message: str, kind: str | None = None, param: str | None = None, extra: dict | None = None
) -> JSONResponse:
    """The one error shape; `extra` adds top-level fields a route family's clients read (SGLang's
    weight routes: `success`, `message`)."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}, **(extra or {})}
    return JSONResponse(body, status_code=status)


_warned: set[tuple[str, str]] = set()


class Body(BaseModel):
    """A request body: wrong types are errors; unknown fields are ignored with a logged warning
    (once per route and field), as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="allow", strict=True)

    def warn_unknown(self, route: str) -> None:
        for name in self.model_extra or {}:
            if (route, name) not in _warned:
                _warned.add((route, name))
                log.warning("%s: ignoring unknown field %r", route, name)


def check_text(text: str, field: str) -> None:
    """BadRequest unless `text` is valid Unicode (a lone surrogate cannot be tokenised)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(
            f"{field}: invalid character at position {e.start} (a lone surrogate); send valid UTF-8"
        ) from None


async def encode(tokenizer: Any, texts: Sequence[str], field: str) -> list[list[int]]:
    """Token ids of `texts` (no special tokens added), tokenised on a worker thread so a huge text
    never blocks the event loop (and `/health`)."""
    if tokenizer is None:
        raise BadRequest(f"{field}: this engine has no tokenizer; send token ids")
    for i, t in enumerate(texts):
        check_text(t, field if len(texts) == 1 else f"{field}[{i}]")
    return await asyncio.to_thread(lambda: [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts])


def check_budget(cfg: ServerConfig, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> None:
    """BadRequest when a request asks for more than the limits allow (see `ServerConfig`)."""
    if len(params) > cfg.max_batch * cfg.max_n:
        raise BadRequest(f"request: {len(params)} sequences; at most {cfg.max_batch * cfg.max_n}")
    total = sum(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params, strict=True))
    if total > cfg.max_request_tokens:
        raise BadRequest(
            f"request: {total} tokens in all (prompts + max new tokens of every sample); this server takes at "
            f"most {cfg.max_request_tokens} per request"
        )


def room_left(engine: AsyncEngine, prompt: list[int], field: str = "prompt") -> int:
    """Room left for new tokens after `prompt`; BadRequest when there is none."""
    room = engine.max_model_len - len(prompt)
    if room < 1:
        raise BadRequest(f"{field}: the prompt is {len(prompt)} tokens; the context is {engine.max_model_len} tokens")
    return room


def sampling_params(field_prefix: str = "", **kw: Any) -> SamplingParams:
    """A validated SamplingParams; a bad value raises BadRequest naming the field."""
    if kw.get("top_k", 0) < -1:
        raise BadRequest(f"{field_prefix}top_k: must be -1 or 0 (off) or >= 1, got {kw['top_k']}")
    kw["top_k"] = max(kw.get("top_k", 0), 0)
    stop = kw.get("stop")
    kw["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
    kw["stop_token_ids"] = list(kw.get("stop_token_ids") or [])
    try:
        return SamplingParams(**kw).validate()
    except ValueError as e:
        raise BadRequest(f"{field_prefix}{e}") from None


def trim_stop(text: str, stops: Sequence[str]) -> str:
    """`text` cut before the first stop string it contains (the engine keeps the tokens)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


class TextStream:
    """Incremental detokenisation: the text each new batch of tokens adds. A trailing partial
    UTF-8 character is held back until the tokens that complete it arrive, and so is any tail
    that may be the start of a stop string (a stop string itself is never sent)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stops: Sequence[str] = ()) -> None:
        self.tokenizer, self.skip, self.stops = tokenizer, skip_special_tokens, list(stops)
        self.ids: list[int] = []
        self.sent = 0

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip) if self.tokenizer else ""
        if self.stops:
            cut = trim_stop(text, self.stops)
            if len(cut) < len(text):
                text, final = cut, True
            elif not final:
                text = text[: max(len(text) - (max(len(s) for s in self.stops) - 1), self.sent)]
        if not final and text.endswith("\ufffd"):
            text = text[:-1]
        delta, self.sent = text[self.sent :], max(len(text), self.sent)
        return delta


class Runner:
    """Submits requests to the engine and waits for them (or streams them), aborting them if the
    client goes away."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def _add(self, prompts, params, rids, on_tokens=None) -> list[asyncio.Future]:
        # Submit all at once: the engine thread takes every queued request in one go between steps.
        adds = [
            self.engine.add_request(p, sp, rid, on_tokens[i] if on_tokens else None)
            for i, (p, sp, rid) in enumerate(zip(prompts, params, rids, strict=True))
        ]
        added = await asyncio.gather(*adds, return_exceptions=True)
        failed = [a for a in added if isinstance(a, BaseException)]
        if failed:
            for a in added:
                if isinstance(a, asyncio.Future):
                    a.cancel()  # aborts it in the engine
            if isinstance(failed[0], ValueError):
                raise BadRequest(str(failed[0]))
            raise failed[0]
        return list(added)

    async def run(
        self, request: Request, prompts: Sequence[list[int]], params: Sequence[SamplingParams], rids: Sequence[str]
    ) -> list[Any]:
        gathered = asyncio.gather(*(await self._add(prompts, params, rids)))
        while True:
            done, _ = await asyncio.wait({gathered}, timeout=DISCONNECT_POLL_S)
            if done:
                return gathered.result()
            if await request.is_disconnected():
                await asyncio.gather(*(self.engine.abort(rid) for rid in rids))
                return await gathered

    async def stream(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams], rids: Sequence[str]
    ) -> AsyncIterator[tuple[int, list[int], list[float], list, Any]]:
        """Yield (index, new token ids, their log-probs, their top alternatives, final output or
        None) as the engine produces them. Closing the iterator (the client went away) aborts the
        requests that are still running."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def feeder(i: int):
            return lambda ids, lps, tops: loop.call_soon_threadsafe(queue.put_nowait, (i, ids, lps, tops, None))

        futures = await self._add(prompts, params, rids, [feeder(i) for i in range(len(prompts))])
        for i, fut in enumerate(futures):
            fut.add_done_callback(lambda f, i=i: queue.put_nowait((i, [], [], [], f)))
        left = len(futures)
        try:
            while left:
                i, ids, lps, tops, fut = await queue.get()
                if fut is None:
                    yield i, ids, lps, tops, None
                    continue
                left -= 1
                yield i, [], [], [], fut.result()
        finally:
            if left:
                # Not awaited: when the client goes away this generator is cancelled, and an await
                # in a cancelled task is itself cancelled before the abort reaches the engine.
                self.engine.abort_nowait(rids)


class EventStream(StreamingResponse):
    """Server-sent events of the engine requests `rids`. However the response ends (the client
    went away, the server stops), the requests still running are aborted as it ends, whatever
    state its generator was left in (suspended at a `yield`, it would only be closed when
    garbage-collected)."""

    def __init__(self, events: AsyncIterator[str], engine: AsyncEngine, rids: Sequence[str]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.engine, self.rids = engine, list(rids)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine.abort_nowait(self.rids)  # no-op for the finished ones
