"""The agent door: an unmodified agent program, written against the `openai` package, samples
through tidal's engine during rollout and its calls become token-exact training samples.

`rollout.generate: agent` runs `agent.fn`, an `async def agent(client, prompt, label)`, once
per sample. `client` is an `openai.AsyncOpenAI` whose base URL is the sample's own **session** on
the door, an OpenAI-compatible HTTP server on 127.0.0.1 (`http://127.0.0.1:PORT/s/<token>/v1`,
the token is also the API key). The agent returns the trajectory's reward (a number or a dict)
or None, and then `reward.fn` scores the samples. An agent that runs another program hands
it `client.base_url` and `client.api_key`; that program must finish before the agent returns.
`agent.command` instead runs a program of its own once per sample, the session in its
environment (`tidal.rollout.program`).

The door speaks Anthropic's Messages API too (`/s/<token>/v1/messages`: an
`anthropic.AsyncAnthropic(base_url=<the session URL without /v1>, api_key=<the token>)`); a
request there is translated to the chat it stands for (`tidal.chat.anthropic.translate`) and is
then a chat call like any other, so one conversation makes the same samples through either API.
OpenAI's Responses API likewise (`/s/<token>/v1/responses`, `client.responses.create`, what the
OpenAI Agents SDK calls by default; `tidal.chat.responses.translate`), with `previous_response_id`
naming an earlier response of the same session.

Every chat call of a session is rendered exactly as `tidal serve` renders it (the shared
functions of `tidal.chat.openai`), sampled by the engine with the rollout's sampling (the
request's temperature, top_p and penalties are ignored: the trainer needs the behaviour
distribution; call k's seed is `turn_seed(sample seed, k)`, as in the tool loop) and recorded:
prompt ids, sampled ids, log-probs, weight version, finish reason. `align` is the rule that turns the calls into
samples (docs/agents.md, "The agent door").

A call with `stream: true` is sampled and recorded exactly as one without, and its answer then sent
as the server-sent events `tidal serve` sends (`tidal.chat.openai.chat_events`,
`tidal.chat.anthropic.message_events`, `tidal.chat.responses.response_events`), one token's text
per event: the stream starts once the answer is whole (the rollout's engine returns whole
answers), not token by token as it is sampled.

A client that goes away is noticed (`while_connected`, polled every `DISCONNECT_POLL_S`): while its
answer is being sampled, the call is cancelled, which aborts the engine request, and nothing of it
joins the sample; once its stream has started, the answer is recorded already and only the sending
stops. Either way the call's entry in `metadata["agent_calls"]` says `"client_gone": True`, and every
sample the trajectory returns counts such calls in `metadata["agent_client_gone"]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tidal.chat.anthropic import MessagesBody, assistant_chat_message, message, message_events, translate
from tidal.chat.errors import ApiError, BadRequest
from tidal.chat.openai import (
    ChatAnswer,
    ChatBody,
    Outputs,
    chat_events,
    chat_max_tokens,
    check_chat,
    models_list,
    stops_of,
    uses_tools,
)
from tidal.chat.render import render_chat, render_prompt
from tidal.chat.responses import ResponseAnswer, ResponsesBody, ResponseStore, input_items, items_chat, response_events
from tidal.chat.responses import translate as translate_items
from tidal.contracts import GenerationOutput, SamplingParams
from tidal.rollout.generate import GenerateContext, finish, keep_routing, load_async_fn, turn_seed
from tidal.types import Sample, Status

if TYPE_CHECKING:
    import openai

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5  # how often a call being sampled checks that its client is still there


class AgentFn(Protocol):
    """An agent of your own, named by `agent.fn` with `rollout.generate: agent`:

        async def agent(client: openai.AsyncOpenAI, prompt: str | list[dict], label: Any)
            -> float | dict | None

    It must be `async def` (checked before the model loads) and runs once per sample.

        client   an `openai.AsyncOpenAI` whose base URL is this sample's own session on the agent
                 door (`client.base_url`, `client.api_key`); every chat call through it samples
                 from the policy and is recorded token for token. Any `model` name is accepted.
        prompt   the row's `data.input_key` field as the file has it: a string, or a list of chat
                 messages (`{"role": ..., "content": ...}`) to send as they are
        label    the row's `data.label_key` field (None if absent)

    It returns the trajectory's reward (a number, or a dict holding `reward.key`), or None to have
    `reward.fn` score each sample. The samples it makes keep `metadata["agent_calls"]`, one entry
    per call (see docs/agents.md, "The agent door"). An exception, or an agent that never calls
    the model, fails its sample.
    """

    async def __call__(
        self, client: openai.AsyncOpenAI, prompt: str | list[dict], label: Any, /
    ) -> float | dict | None: ...


MODEL_NAME = "tidal-policy"  # what /v1/models lists; a request's `model` is not checked


# ---------------------------------------------------------------------------- the rule
@dataclass(frozen=True)
class Alignment:
    """How a call's prompt joins the sample so far.

    case     "extend": the prompt starts with the sample's tokens; "realign": it starts with
             their text, tokenised differently over a short tail; "new": neither
    keep     how many of the sample's tokens the engine sees again (all of them, or 0 for "new")
    env_ids  the prompt's new part, appended as environment tokens ("new": the whole prompt)
    """

    case: str
    keep: int
    env_ids: list[int]


def with_image_urls(messages: list[dict], images: list) -> list[dict]:
    """A vision-language prompt's messages for an agent: each `{"type": "image"}` part (the data
    path keeps no pixels there) as OpenAI's `image_url` part with the image's file as a data: URI,
    in order, which the door reads back into the same images."""
    pending = iter(images)
    out = []
    for m in messages:
        if isinstance(m.get("content"), list):
            parts = [
                {"type": "image_url", "image_url": {"url": next(pending).data_uri()}} if p.get("type") == "image" else p
                for p in m["content"]
            ]
            m = {**m, "content": parts}
        out.append(m)
    return out


def align(seen: list[int], prompt: list[int], decode: Any, max_drift: int) -> Alignment:
    """The rule joining a call's `prompt` ids to `seen` (the sample's tokens: the engine's last
    input + what it sampled). `decode(ids)` is the tokenizer's decoding with special tokens kept.

    extend   prompt[:len(seen)] == seen
    realign  after their common prefix, seen's tail (at most `max_drift` tokens) decodes to the
             same text as the next j <= max_drift prompt tokens (the chat template re-rendered the
             history and the tokenizer split the same text differently): the engine gets seen +
             the rest of the prompt, so the model is conditioned on exactly what it sampled
    new      anything else: a new sample whose prompt is `prompt`
    """
    n = len(seen)
    if prompt[:n] == seen:
        return Alignment("extend", n, prompt[n:])
    common = 0
    for a, b in zip(seen, prompt, strict=False):
        if a != b:
            break
        common += 1
    if n - common <= max_drift:
        text = decode(seen)
        for j in range(0, min(max_drift, len(prompt) - common) + 1):
            if decode(prompt[: common + j]) == text:
                return Alignment("realign", n, prompt[common + j :])
    return Alignment("new", 0, list(prompt))


def _same_answer(sent: dict, returned: dict) -> bool:
    """Whether an assistant message sent back is the one returned: same content and tool calls
    (ids, names, argument strings), no other fields."""
    if set(sent) - {"role", "content", "tool_calls"}:
        return False
    same_content = (sent.get("content") or None) == (returned.get("content") or None)
    return same_content and sent.get("tool_calls") == returned.get("tool_calls")


async def replay(out: GenerationOutput) -> Outputs:
    """A whole engine output as the stream the engine would have produced: its tokens one at a
    time, then the output itself (what the stream builders of `tidal serve` take)."""
    for t, lp in zip(out.token_ids, out.log_probs, strict=True):
        yield 0, [t], [lp], [], None
    yield 0, [], [], [], out


def event_stream(events: AsyncIterator[str], record: dict) -> StreamingResponse:
    """A streamed answer's server-sent events. Its answer is sampled and recorded already (its call's
    `record`): a client that goes away meanwhile only stops the sending (no engine request is left
    running), and the record says so."""

    async def sent() -> AsyncIterator[str]:
        done = False
        try:
            async for event in events:
                yield event
            done = True
        finally:
            if not done:
                record["client_gone"] = True

    return StreamingResponse(sent(), media_type="text/event-stream")


class ClientGone(ApiError):
    """The client closed its connection before its answer was sampled (answered to nobody)."""

    def __init__(self) -> None:
        super().__init__("the client closed the connection before the answer was sampled", 499, "client_closed")


async def while_connected(request: Request, call: Awaitable[Any]) -> Any:
    """`call`'s result, or ClientGone once the client of `request` has gone away: the call is then
    cancelled, which aborts its engine request (`Session._call` marks the call)."""
    task = asyncio.ensure_future(call)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone()


# ---------------------------------------------------------------------------- a session
class Session:
    """One trajectory on the door: its calls, one at a time, and the samples they grow."""

    def __init__(self, ctx: GenerateContext, sample: Sample, sampling: SamplingParams) -> None:
        self.ctx, self.sampling = ctx, sampling
        self.token = secrets.token_hex(16)
        self.samples: list[Sample] = [sample]  # the first: the dataset prompt, nothing sampled yet
        self.calls = 0
        self.record: dict = {}  # the entry of the latest call in its sample's metadata["agent_calls"]
        self.used = 0  # response tokens (sampled + environment) over every sample of the trajectory
        self.budget = ctx.rollout.response_budget
        self.budget_refused = False
        self.answers: list[tuple[dict, str]] = []  # (an assistant message the door returned, the text sampled)
        self.stored = ResponseStore()  # the session's `/v1/responses` answers, for previous_response_id
        self.lock = asyncio.Lock()  # an agent's parallel calls are served one at a time
        tok = ctx.tokenizer
        self.decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
        engine = getattr(ctx.engine, "engine", ctx.engine)
        self.max_model_len: int | None = getattr(engine, "max_model_len", None)

    def trained(self) -> list[Sample]:
        """The samples holding sampled tokens."""
        return [s for s in self.samples if any(v >= 0 for v in s.token_versions)]

    def as_sampled(self, message: dict) -> dict:
        """An assistant message this session returned, sent back unchanged, as the text the model
        sampled: its tool calls were parsed out of that text and would otherwise be re-serialised
        by the template (other JSON spacing, text around the calls), a history the model never saw."""
        if message.get("role") != "assistant":
            return message
        for answer, text in self.answers:
            if _same_answer(message, answer):
                return {"role": "assistant", "content": text}
        return message

    async def chat(self, body: ChatBody) -> dict | StreamingResponse:
        """OpenAI's `/v1/chat/completions`: one answer, sampled and recorded, whole or streamed."""
        body.warn_unknown("agent door /v1/chat/completions")
        check_chat(body)
        if body.n != 1:
            raise BadRequest(f"n: the agent door samples one answer per call, got {body.n}")
        if body.top_logprobs:
            raise BadRequest("top_logprobs: the agent door returns the sampled tokens' log-probs only")
        max_tokens, field = chat_max_tokens(body)
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"{field}: must be >= 1, got {max_tokens}")
        raw = [self.as_sampled(m.model_dump(exclude_none=True)) for m in body.messages]
        prompt, images = await render_chat(self.ctx.tokenizer, raw, body.tools, body.tool_choice, None, self.ctx.images)
        stops = [*self.sampling.stop, *stops_of(body)]
        model = body.model or MODEL_NAME
        async with self.lock:
            out, engine_ids = await self._call(prompt, max_tokens, stops, body.stop_token_ids or [], images)
            cid = f"chatcmpl-{self.token[:8]}-{self.calls}"
            answer = ChatAnswer(self.ctx.tokenizer, model, stops, uses_tools(body), body.logprobs, 0, cid)
            message, _ = answer.message_of(0, out)
            self.answers.append((message, out.text))
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return event_stream(chat_events(answer, replay(out), 1, [engine_ids], include), self.record)
        return answer.whole([out], [engine_ids])

    async def messages(self, body: MessagesBody) -> dict | StreamingResponse:
        """Anthropic's `/v1/messages`: translated to the chat the OpenAI route renders, then sampled
        and recorded as a chat call is (the same rule, the same prompt ids for one conversation),
        answered whole or streamed."""
        body.warn_unknown("agent door /v1/messages")
        chat, tools = translate(body)
        raw = [self.as_sampled(m) for m in chat]
        prompt, images = await render_chat(self.ctx.tokenizer, raw, tools, None, None, self.ctx.images)
        requested = list(body.stop_sequences or [])
        stops = [*self.sampling.stop, *requested]
        use_tools, model = tools is not None, body.model or MODEL_NAME
        async with self.lock:
            out, engine_ids = await self._call(prompt, body.max_tokens, stops, [], images)
            answer = message(out, stops, requested, use_tools, model, len(engine_ids))
            # kept as the chat message its blocks translate to, so that sent back it is known
            self.answers.append((assistant_chat_message(answer["content"]), out.text))
        if body.stream:
            tok = self.ctx.tokenizer
            return event_stream(
                message_events(replay(out), tok, stops, use_tools, model, len(engine_ids), lambda _: answer),
                self.record,
            )
        return answer

    async def responses(self, body: ResponsesBody) -> dict | StreamingResponse:
        """OpenAI's `/v1/responses`: its items translated to the chat the OpenAI route renders, then
        sampled and recorded as a chat call is; with `store` (default true) the response is kept
        for `previous_response_id` within this session. Answered whole or streamed."""
        body.warn_unknown("agent door /v1/responses")
        if body.top_logprobs:
            raise BadRequest("top_logprobs: the agent door returns the sampled tokens' log-probs only")
        history = self.stored.history(body.previous_response_id)
        chat, tools = translate_items(body, history)
        raw = [self.as_sampled(m) for m in chat]
        prompt = await render_prompt(self.ctx.tokenizer, raw, tools, None)
        stops = list(self.sampling.stop)
        async with self.lock:
            out, engine_ids = await self._call(prompt, body.max_output_tokens, stops, [])
            model = body.model or MODEL_NAME
            answer = ResponseAnswer(self.ctx.tokenizer, body, model, stops, tools is not None, len(engine_ids))
            whole = answer.whole(out)
            # kept as the chat message its items translate to, so that sent back it is known
            (said,) = items_chat(whole["output"])
            self.answers.append((said, out.text))
            if body.store is not False:
                self.stored.put(whole["id"], [*history, *input_items(body), *whole["output"]])
        if body.stream:
            return event_stream(response_events(answer, replay(out), lambda _: whole), self.record)
        return whole

    async def _call(
        self,
        prompt: list[int],
        max_tokens: int | None,
        stops: list[str],
        stop_token_ids: list[int],
        images: list | None = None,
    ) -> tuple[Any, list[int]]:
        """Sample an answer to `prompt` and record it on the session's samples; (the engine's
        output, the ids the engine was given). `images`: the conversation's, in order (a
        vision-language model's; the sample keeps them for the trainer)."""
        sample = self.samples[-1]
        # before anything is sampled there is nothing to realign: the dataset prompt is extended or replaced
        drift = self.ctx.agent.max_drift_tokens if self.trained() else 0
        fit = align(sample.tokens, prompt, self.decode, drift)
        engine_ids = sample.tokens[: fit.keep] + fit.env_ids
        left = self.budget - self.used - (len(fit.env_ids) if fit.case != "new" else 0)
        if left < 1:
            self.budget_refused = True
            raise BadRequest(
                f"max_tokens: this trajectory's response budget (rollout.response_budget = {self.budget} tokens, "
                "sampled and environment tokens together) is spent"
            )
        room = left if self.max_model_len is None else min(left, self.max_model_len - len(engine_ids))
        if room < 1:
            raise BadRequest(f"messages: the prompt is {len(engine_ids)} tokens; the context is {self.max_model_len}")
        sp = dataclasses.replace(
            self.sampling,
            max_new_tokens=min(max_tokens, room) if max_tokens is not None else room,
            seed=turn_seed(self.sampling.seed, self.calls),
            stop=stops,
            stop_token_ids=[*self.sampling.stop_token_ids, *stop_token_ids],
        )
        self.calls += 1
        try:
            if self.ctx.images is None:  # a text-only model
                out = await self.ctx.generate(engine_ids, sp)
            else:  # the conversation's images, none where it sent none (not the dataset prompt's)
                out = await self.ctx.generate(engine_ids, sp, images or [])
        except asyncio.CancelledError:
            # the client went away (`while_connected`): the agent saw nothing, so nothing joins the sample
            gone = {"case": fit.case, "at": len(sample.tokens), "sampled": 0, "finish_reason": "abort"}
            sample.metadata.setdefault("agent_calls", []).append({**gone, "client_gone": True})
            raise
        if fit.case == "new":
            first = self.samples[0]
            sample = Sample(
                tokens=list(prompt),
                prompt=self.decode(prompt),
                label=first.label,
                group_index=first.group_index,
                index=first.index,
                metadata={**first.metadata, "agent_calls": []},
            )
            self.samples.append(sample)
        else:
            sample.append_env(fit.env_ids, self.decode(fit.env_ids))
            self.used += len(fit.env_ids)
        sample.images = list(images or [])  # the whole conversation's: its prompt holds their placeholders
        at = len(sample.tokens)
        sample.append_policy(out.token_ids, out.log_probs, out.weight_version, out.text)
        keep_routing(sample, out)
        self.used += len(out.token_ids)
        finish(sample, out.finish_reason)
        record = {"case": fit.case, "at": at, "sampled": len(out.token_ids), "finish_reason": out.finish_reason}
        sample.metadata.setdefault("agent_calls", []).append(record)
        self.record = record
        return out, engine_ids


# ---------------------------------------------------------------------------- the door
class AgentDoor:
    """The HTTP server of one rollout's sessions, on 127.0.0.1 in the rollout's event loop."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.users = 0
        self.url = ""
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._sock: socket.socket | None = None
        self._started: asyncio.Future | None = None
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        from tidal.chat.http_errors import add_error_handlers

        app = FastAPI(title="tidal agent door", docs_url=None, redoc_url=None, openapi_url=None)
        add_error_handlers(app)

        @app.get("/s/{token}/v1/models")
        async def models(token: str, request: Request) -> dict:
            return models_list(MODEL_NAME, self.session(token, request).max_model_len)

        @app.post("/s/{token}/v1/chat/completions")
        async def chat(token: str, body: ChatBody, request: Request) -> Any:
            return await while_connected(request, self.session(token, request).chat(body))

        @app.post("/s/{token}/v1/messages")
        async def messages(token: str, body: MessagesBody, request: Request) -> Any:
            return await while_connected(request, self.session(token, request).messages(body))

        @app.post("/s/{token}/v1/responses")
        async def responses(token: str, body: ResponsesBody, request: Request) -> Any:
            return await while_connected(request, self.session(token, request).responses(body))

        return app

    def session(self, token: str, request: Request) -> Session:
        """The session of a URL, if the request carries its token as the API key."""
        session = self.sessions.get(token)
        if session is None:
            raise ApiError(f"session: no open session {token[:8]}... on this door", 404, "not_found_error")
        given = request.headers.get("authorization", "")
        given = given[7:] if given.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise ApiError("authorization: the session's token is its API key", 401, "authentication_error")
        return session

    async def start(self) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            def capture_signals(self):  # the rollout's process keeps its own signal handlers
                return contextlib.nullcontext()

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self._sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError(f"agent door on {self.url} did not start")
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):  # a failed start was already raised to the door's users
                await self._task
        if self._sock is not None:
            self._sock.close()
        self._server = self._task = self._sock = None

    def base_url(self, session: Session) -> str:
        return f"{self.url}/s/{session.token}/v1"


async def _acquire_door(extra: dict) -> AgentDoor:
    """The running event loop's door (one per rollout: `RolloutManager.generate` runs each step in
    a fresh loop), started by its first user."""
    doors: dict = extra.setdefault("agent_doors", {})
    loop = asyncio.get_running_loop()
    entry = doors.get(loop)
    if entry is None:
        door = AgentDoor()
        entry = doors[loop] = (door, loop.create_task(door.start()))
    door, starting = entry
    door.users += 1
    try:
        await asyncio.shield(starting)
    except BaseException:
        await _release_door(extra, door)
        raise
    return door


async def _release_door(extra: dict, door: AgentDoor) -> None:
    """The last user of a door closes it: no port or task outlives the rollout."""
    door.users -= 1
    if door.users == 0:
        extra.get("agent_doors", {}).pop(asyncio.get_running_loop(), None)
        await door.close()


def load_agent(name: str) -> AgentFn:
    """The `AgentFn` at `name` (dotted path or `file.py:fn`); ValueError naming agent.fn and the
    signature when it cannot be loaded or is not a coroutine function."""
    return load_async_fn(name, "agent.fn", "async def agent(client, prompt, label)")


async def agent_generate(ctx: GenerateContext, sample: Sample, sampling: SamplingParams) -> list[Sample]:
    """Run `agent.fn` (or the program of `agent.command`) on one prompt through its own session on
    the door; the samples its calls became (`agent.samples` picks which), with the agent's reward
    if it gave one."""
    import openai

    cfg = ctx.agent
    who = "agent.command" if cfg.command else "agent.fn"
    agents: dict = ctx.extra.setdefault("agent_fns", {})
    if cfg.fn and cfg.fn not in agents:
        agents[cfg.fn] = load_agent(cfg.fn)
    agent = agents.get(cfg.fn)
    door = await _acquire_door(ctx.extra)
    session = Session(ctx, sample, sampling)
    door.sessions[session.token] = session
    client = openai.AsyncOpenAI(
        base_url=door.base_url(session), api_key=session.token, max_retries=0, timeout=cfg.request_timeout
    )
    prompt = ctx.record.prompt if ctx.record is not None else sample.prompt
    if ctx.record is not None and ctx.record.images:  # the agent sends the pictures back as OpenAI parts
        prompt = with_image_urls(prompt, ctx.record.images)
    try:
        try:
            if cfg.command:  # an agent program (tidal.rollout.program): its output goes to reward.fn
                from tidal.rollout.program import run_program

                reward = await run_program(cfg, session, door.base_url(session), prompt)
            else:
                reward = await agent(client, prompt, sample.label)
        except Exception as e:
            if not session.budget_refused or not session.trained():
                raise
            # the agent stopped on the spent budget: what it sampled is kept, scored by reward.fn
            log.info("sample %d: agent stopped after the response budget was spent: %r", sample.index, e)
            session.samples[-1].status = Status.TRUNCATED
            reward = None
    finally:
        door.sessions.pop(session.token, None)
        await client.close()
        await _release_door(ctx.extra, door)
    if reward is not None and not isinstance(reward, int | float | dict):
        raise TypeError(f"{who} returned {type(reward).__name__}; expected a number, a dict or None")
    samples = session.trained()
    if not samples:
        raise RuntimeError(f"{who} made no call to the model: nothing to train on")
    gone = sum(c.get("client_gone", False) for s in session.samples for c in s.metadata.get("agent_calls", []))
    if cfg.samples == "last":
        samples = samples[-1:]
    elif cfg.samples == "first":
        samples = samples[:1]
    for s in samples:
        if gone:
            s.metadata["agent_client_gone"] = gone
        s.reward = float(reward) if isinstance(reward, int | float) else reward
        if reward is not None:  # reward.fn then leaves it as it is; the report names who scored
            s.metadata["reward_from"] = "agent.fn"
    return samples
