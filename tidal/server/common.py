"""What every route family shares: limits, tokenising off the event loop within them, and running
(or streaming) requests on the engine. Errors and their shapes, request bodies and the chat
formats are `tidal.chat`'s (the agent door answers with them too).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tidal.adapters.async_engine import AsyncEngine
from tidal.chat.errors import ApiError, BadRequest, Busy, Unavailable
from tidal.chat.text import check_text
from tidal.contracts import EngineUnavailable, SamplingParams
from tidal.hardware import libc_function
from tidal.server.options import ServerConfig

DISCONNECT_POLL_S = 1.0

# What a client of this server does about each state in which the engine cannot serve
# (`EngineUnavailable.state`): the core's own message speaks of its methods, not of routes.
ENGINE_ADVICE = {
    "asleep": "the engine is asleep (its memory is released): POST /resume_memory_occupation first, then send weights",
    "no_weights": (
        "the engine holds no weights (it was woken and none were sent since): send weights first "
        "(POST /update_weights_from_tensor, /update_weights_from_disk or /update_weights_from_distributed)"
    ),
    "closed": "the engine is closed: this server cannot serve any more; restart it",
}


def unavailable(e: EngineUnavailable) -> Unavailable:
    """The 503 answering an engine that cannot serve now, saying what brings it back."""
    return Unavailable(ENGINE_ADVICE.get(e.state, str(e)))


def longest_token_bytes(tokenizer: Any) -> int | None:
    """The most bytes any one token of `tokenizer`'s vocabulary (added tokens included) spells:
    the UTF-8 size of its longest vocabulary string, which is never less than the text the token
    stands for (byte-level BPE writes a byte as one or two bytes; SentencePiece's `▁` and `<0x..>`
    are longer than the byte they stand for). None when the tokenizer does not list its vocabulary."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # not a transformers tokenizer: no size check, the in-flight budget still holds
        return None
    return max((len(str(t).encode("utf-8", "surrogatepass")) for t in vocab), default=None)


def _release_freed_memory() -> None:
    """Hand the heap memory freed since to the OS (glibc's `malloc_trim`; elsewhere nothing).
    A tokenizer's scratch for a big text, 150-250 bytes a byte of text, otherwise stays with the
    process after the request (the probe saw 3.8 GB kept after six refused requests)."""
    malloc_trim = libc_function("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)


TRIM_AFTER_BYTES = 1 << 20  # texts this large leave enough scratch behind to be worth a trim


class Texts:
    """Tokenises request texts on worker threads (so a huge text never blocks the event loop and
    `/health`) within two limits, both judged before any encoding is built (an encoding takes
    150-250 bytes of memory per byte of text, so an 8 MB body would take 1-2 GB):

    - size: no token spells more than `token_bytes` bytes (`longest_token_bytes`), so a text of
      more than `token_bytes × (max_model_len - 1)` bytes has more tokens than a prompt may, and
      texts of more than `token_bytes × max_request_tokens` bytes in all more than a request may:
      both are refused (400) unread.
    - in flight: at most `max_tokenising_bytes` of text is tokenised at once, server-wide; a
      request that would go over is refused (503, with Retry-After) rather than queued, so bodies
      waiting to be tokenised do not pile up either.
    """

    def __init__(self, tokenizer: Any, max_model_len: int, cfg: ServerConfig) -> None:
        self.tokenizer, self.max_model_len, self.cfg = tokenizer, max_model_len, cfg
        self.token_bytes = longest_token_bytes(tokenizer) if tokenizer is not None else None
        self.in_flight = 0  # bytes being tokenised; touched only on the event loop

    async def encode(self, texts: Sequence[str], field: str) -> list[list[int]]:
        """Token ids of `texts` (no special tokens added)."""
        if self.tokenizer is None:
            raise BadRequest(f"{field}: this engine has no tokenizer; send token ids")
        names = [field if len(texts) == 1 else f"{field}[{i}]" for i in range(len(texts))]
        sizes = [check_text(t, name) for t, name in zip(texts, names, strict=True)]
        self._check_sizes(sizes, names, field)
        total = sum(sizes)
        self._reserve(total, field)
        loop = asyncio.get_running_loop()

        def encode_all() -> list[list[int]]:
            try:
                return [list(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]
            finally:
                # Freed when the tokenising ends, not when its awaiter does: a request cancelled
                # meanwhile leaves its thread working, and holding the memory, to the end.
                if total >= TRIM_AFTER_BYTES:
                    _release_freed_memory()
                with contextlib.suppress(RuntimeError):  # the loop closed (the server stopped)
                    loop.call_soon_threadsafe(self._release, total)

        return await asyncio.to_thread(encode_all)

    def _check_sizes(self, sizes: list[int], names: list[str], field: str) -> None:
        if self.token_bytes is None:
            return
        per_prompt = self.token_bytes * (self.max_model_len - 1)
        for size, name in zip(sizes, names, strict=True):
            if size > per_prompt:
                raise BadRequest(
                    f"{name}: {size} bytes; a prompt here is at most {self.max_model_len - 1} tokens (the context "
                    f"less one new token) and no token of this model spells more than {self.token_bytes} bytes, so "
                    f"a text of at most {per_prompt} bytes"
                )
        per_request = self.token_bytes * self.cfg.max_request_tokens
        if sum(sizes) > per_request:
            raise BadRequest(
                f"{field}: {sum(sizes)} bytes in all; this server takes at most {self.cfg.max_request_tokens} tokens "
                f"per request and no token of this model spells more than {self.token_bytes} bytes, so texts of at "
                f"most {per_request} bytes"
            )

    def _reserve(self, size: int, field: str) -> None:
        budget = self.cfg.max_tokenising_bytes
        if size > budget:
            raise ApiError(f"{field}: {size} bytes; this server tokenises at most {budget} bytes at once", 413)
        if self.in_flight + size > budget:
            raise Busy(
                f"{field}: {size} bytes to tokenise, but {self.in_flight} of this server's {budget} bytes for "
                "tokenising at once are in use; retry shortly"
            )
        self.in_flight += size

    def _release(self, size: int) -> None:
        self.in_flight -= size


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


def check_token_id(token: int, vocab_size: int | None, field: str) -> None:
    """BadRequest naming `field` unless `token` is an id of the model's vocabulary (when known): an
    id the model has no logit for can never be sampled, so a stop or a bias on it does nothing."""
    if vocab_size is not None and not 0 <= token < vocab_size:
        raise BadRequest(
            f"{field}: token id {token} is outside the vocabulary; this model's ids are 0 to {vocab_size - 1}"
        )


def sampling_params(field_prefix: str = "", vocab_size: int | None = None, **kw: Any) -> SamplingParams:
    """A validated SamplingParams; a bad value raises BadRequest naming the field (a stop token id
    outside the model's `vocab_size` too, when it is known)."""
    for token in kw.get("stop_token_ids") or []:
        check_token_id(token, vocab_size, f"{field_prefix}stop_token_ids")
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


class Runner:
    """Submits requests to the engine and waits for them (or streams them), aborting them if the
    client goes away."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def _add(self, prompts, params, rids, on_tokens=None, images=None) -> list[asyncio.Future]:
        # Submit all at once: the engine thread takes every queued request in one go between steps.
        adds = [
            self.engine.add_request(p, sp, rid, on_tokens[i] if on_tokens else None, images=images)
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
        self,
        request: Request,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        rids: Sequence[str],
        images: list | None = None,
    ) -> list[Any]:
        """The engine's outputs of the requests, aborted if the client goes away meanwhile.
        `images`: of every prompt (the samples of one chat with images)."""
        gathered = asyncio.gather(*(await self._add(prompts, params, rids, images=images)))
        while True:
            done, _ = await asyncio.wait({gathered}, timeout=DISCONNECT_POLL_S)
            if done:
                return gathered.result()
            if await request.is_disconnected():
                await asyncio.gather(*(self.engine.abort(rid) for rid in rids))
                return await gathered

    async def stream(
        self,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        rids: Sequence[str],
        images: list | None = None,
    ) -> Stream:
        """Submit the requests of a streamed answer and return their `Stream`. A request the
        engine refuses (a bad prompt, an engine asleep) raises here, before the response starts,
        so it is answered as an error: once a stream's 200 is sent, an error can only cut it off."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def feeder(i: int):
            return lambda ids, lps, tops: loop.call_soon_threadsafe(queue.put_nowait, (i, ids, lps, tops, None))

        futures = await self._add(prompts, params, rids, [feeder(i) for i in range(len(prompts))], images)
        for i, fut in enumerate(futures):
            fut.add_done_callback(lambda f, i=i: queue.put_nowait((i, [], [], [], f)))
        return Stream(self.engine, rids, queue, len(futures))


class Stream:
    """The submitted requests of one streamed answer. Iterating it yields (index, new token ids,
    their log-probs, their top alternatives, final output or None) as the engine produces them;
    closing the iterator (the client went away) aborts the requests that are still running."""

    def __init__(self, engine: AsyncEngine, rids: Sequence[str], queue: asyncio.Queue, count: int) -> None:
        self.engine, self.rids, self.queue, self.count = engine, list(rids), queue, count

    async def __aiter__(self) -> AsyncIterator[tuple[int, list[int], list[float], list, Any]]:
        left = self.count
        try:
            while left:
                i, ids, lps, tops, fut = await self.queue.get()
                if fut is None:
                    yield i, ids, lps, tops, None
                    continue
                left -= 1
                yield i, [], [], [], fut.result()
        finally:
            if left:
                # Not awaited: when the client goes away this generator is cancelled, and an await
                # in a cancelled task is itself cancelled before the abort reaches the engine.
                self.engine.abort_nowait(self.rids)


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
