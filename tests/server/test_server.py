"""AsyncEngine and the HTTP server, driven by a scripted fake core engine.

The fake core is step-based like `LLMEngine`: each step() appends one token to every request.
Token k of a request is `expected_tokens(prompt, n)[k]`, its log-prob `-(k + 1) / 10`.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Awaitable

import httpx
import pytest
import torch
from fake_core import FakeCore, expected_logprobs, expected_tokens

from tidal.adapters.async_engine import AsyncEngine, EngineClosed
from tidal.adapters.client import WEIGHTS_CONTENT_TYPE, encode_tensors
from tidal.contracts import SamplingParams
from tidal.server.app import build_app


# ---------------------------------------------------------------------- helpers
def with_app(core: FakeCore, fn, model_name: str = "fake-model") -> None:
    """Run `await fn(http_client, engine)` against the app in a fresh event loop."""

    async def main() -> None:
        engine = AsyncEngine(core)
        try:
            transport = httpx.ASGITransport(app=build_app(engine, model_name), raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
                await fn(http, engine)
        finally:
            engine.close()

    asyncio.run(main())


async def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


# ---------------------------------------------------------------------- AsyncEngine
def test_async_engine_generates_on_one_background_thread(tokenizer):
    core = FakeCore(tokenizer)

    async def main() -> None:
        engine = AsyncEngine(core)
        try:
            outs = await asyncio.gather(*(engine.generate([1, i], greedy(3 + i), request_id=f"r{i}") for i in range(4)))
            assert engine.load() == 0
            assert engine.stats()["running"] == 0
        finally:
            engine.close()
        for i, o in enumerate(outs):
            assert o.request_id == f"r{i}"
            assert o.token_ids == expected_tokens([1, i], 3 + i)
            assert o.log_probs == expected_logprobs(3 + i)
            assert o.finish_reason == "length"
        # steps batch the requests: the longest (6 tokens) bounds the step count
        assert core.step_calls == 6

    asyncio.run(main())
    assert len(core.threads) == 1 and threading.get_ident() not in core.threads


def test_async_engine_add_errors_propagate_and_duplicate_ids_are_refused(tokenizer):
    core = FakeCore(tokenizer, max_model_len=8)

    async def main() -> None:
        engine = AsyncEngine(core)
        try:
            with pytest.raises(ValueError, match="prompt is 9 tokens; max_model_len is 8"):
                await engine.generate(list(range(9)), greedy(2))
            await engine.pause()
            first = await engine.add_request([1], greedy(2), "same")
            with pytest.raises(ValueError, match="'same' is already in use"):
                await engine.add_request([1], greedy(2), "same")
            await engine.resume()
            assert (await first).token_ids == expected_tokens([1], 2)
        finally:
            engine.close()

    asyncio.run(main())


def test_async_engine_step_error_fails_waiters_and_keeps_serving(tokenizer):
    core = FakeCore(tokenizer)

    async def main() -> None:
        engine = AsyncEngine(core)
        try:
            core.fail_next_step = True
            with pytest.raises(RuntimeError, match="boom"):
                await asyncio.wait_for(engine.generate([1, 2], greedy(4)), 10)
            assert core.reqs == {}  # cleared from the core
            out = await asyncio.wait_for(engine.generate([1, 2], greedy(4)), 10)
            assert out.token_ids == expected_tokens([1, 2], 4)
        finally:
            engine.close()

    asyncio.run(main())


def test_async_engine_weight_update_between_steps_in_flight_request_continues(tokenizer):
    core = FakeCore(tokenizer, max_model_len=10_000, step_delay=0.002)

    async def main() -> None:
        engine = AsyncEngine(core)
        try:
            fut = await engine.add_request([4], greedy(60), "r")
            await wait_until(lambda: core.reqs and len(core.reqs["r"]["tokens"]) >= 3)
            w = torch.arange(6.0).reshape(2, 3)
            await engine.update_weights_from_tensors([("w", w)], version=3)
            assert engine.weight_version == 3
            out = await fut
        finally:
            engine.close()
        assert out.finish_reason == "length" and out.token_ids == expected_tokens([4], 60)
        assert out.weight_version == 3
        ((named, version),) = core.received
        assert version == 3 and torch.equal(named["w"], w)
        assert core.flushes == 1

    asyncio.run(main())


def test_async_engine_cancel_aborts_and_close_fails_pending(tokenizer):
    core = FakeCore(tokenizer, max_model_len=10_000, step_delay=0.002)

    async def main() -> None:
        engine = AsyncEngine(core)
        task = asyncio.ensure_future(engine.generate([1], greedy(9_000), request_id="c"))
        await wait_until(lambda: "c" in core.reqs)
        task.cancel()
        await wait_until(lambda: "c" not in core.reqs)  # aborted in the core
        assert engine.load() == 0
        await engine.pause()
        fut = await engine.add_request([1], greedy(5), "p")
        engine.close()
        with pytest.raises(EngineClosed):
            await fut
        with pytest.raises(EngineClosed):
            await engine.flush_cache()

    asyncio.run(main())


# ---------------------------------------------------------------------- /generate
def test_generate_single_with_logprobs_and_cached_tokens(tokenizer):
    core = FakeCore(tokenizer)

    async def fn(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True, "rid": "a"}
        r = await http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        toks = expected_tokens([5, 6, 7], 4)
        assert out["output_ids"] == toks
        assert out["text"] == tokenizer.decode(toks)
        meta = out["meta_info"]
        assert meta["id"] == "a"
        assert meta["finish_reason"] == {"type": "length"}
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 4, 0)
        assert meta["weight_version"] == 0
        assert meta["output_token_logprobs"] == [
            [lp, t, None] for lp, t in zip(expected_logprobs(4), toks, strict=True)
        ]
        # the same prompt again hits the fake's prefix cache; no logprobs asked for this time
        body.pop("return_logprob")
        again = (await http.post("/generate", json=body)).json()
        assert again["meta_info"]["cached_tokens"] == 2
        assert "output_token_logprobs" not in again["meta_info"]
        # SGLang's sampling param names reach the core as SamplingParams
        sp = {"temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.1, "sampling_seed": 7, "stop": "x"}
        r = await http.post("/generate", json={"input_ids": [1], "sampling_params": sp, "rid": "b"})
        assert r.status_code == 200, r.text
        got = core.params["b"]
        assert (got.temperature, got.top_p, got.top_k, got.min_p, got.seed, got.stop) == (0.5, 0.9, 0, 0.1, 7, ["x"])
        assert got.max_new_tokens == 128

    with_app(core, fn)


def test_generate_batched_text_and_stop_reasons(tokenizer):
    core = FakeCore(tokenizer)

    async def fn(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
        stop_tok = expected_tokens([9, 9], 3)[2]
        body = {
            "input_ids": [[9, 9], [1, 2, 3]],
            "sampling_params": [{"max_new_tokens": 10, "stop_token_ids": [stop_tok]}, {"max_new_tokens": 2}],
            "return_logprob": True,
            "rid": ["x", "y"],
        }
        r = await http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        a, b = r.json()
        assert a["output_ids"] == expected_tokens([9, 9], 3) and a["meta_info"]["finish_reason"]["type"] == "stop"
        assert b["output_ids"] == expected_tokens([1, 2, 3], 2) and b["meta_info"]["finish_reason"]["type"] == "length"
        assert [len(o["meta_info"]["output_token_logprobs"]) for o in (a, b)] == [3, 2]
        assert [o["meta_info"]["id"] for o in (a, b)] == ["x", "y"]
        # text input is tokenized without special tokens; one sampling_params dict applies to all
        r = await http.post("/generate", json={"text": ["hi", "abc"], "sampling_params": {"max_new_tokens": 2}})
        hi, abc = r.json()
        assert hi["meta_info"]["prompt_tokens"] == 2 and abc["meta_info"]["prompt_tokens"] == 3
        ids = tokenizer.encode("abc", add_special_tokens=False)
        assert abc["output_ids"] == expected_tokens(ids, 2)

    with_app(core, fn)


# ---------------------------------------------------------------------- OpenAI
def test_openai_completions_shapes_usage_and_seeds(tokenizer):
    core = FakeCore(tokenizer)

    async def fn(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
        body = {"model": "fake-model", "prompt": "hello", "max_tokens": 3, "n": 2, "seed": 11, "logprobs": 1}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "text_completion" and out["model"] == "fake-model" and out["id"].startswith("cmpl-")
        assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
        ids = tokenizer.encode("hello", add_special_tokens=False)
        toks = expected_tokens(ids, 3)
        assert [c["index"] for c in out["choices"]] == [0, 1]
        for c in out["choices"]:
            assert c["text"] == tokenizer.decode(toks) and c["finish_reason"] == "length"
            assert c["logprobs"]["token_logprobs"] == expected_logprobs(3)
            assert c["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in toks]
            assert c["logprobs"]["text_offset"] == [0, 1, 2]
        assert sorted(p.seed for p in core.params.values()) == [11, 12]
        # token-id prompts, two of them, no logprobs
        r = await http.post("/v1/completions", json={"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 2})
        out = r.json()
        assert [c["logprobs"] for c in out["choices"]] == [None, None]
        assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
        assert out["choices"][1]["text"] == tokenizer.decode(expected_tokens([3, 4, 5], 2))

    with_app(core, fn)


def test_openai_chat_completions_template_usage_and_default_length(tokenizer):
    core = FakeCore(tokenizer, max_model_len=64)

    async def fn(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
        messages = [{"role": "user", "content": "2+2?"}]
        r = await http.post("/v1/chat/completions", json={"messages": messages, "logprobs": True})
        assert r.status_code == 200, r.text
        out = r.json()
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        (rid,) = core.prompts
        assert core.prompts[rid] == prompt
        room = 64 - len(prompt)  # no max_tokens: the rest of the context
        assert core.params[rid].max_new_tokens == room
        assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
        (choice,) = out["choices"]
        toks = expected_tokens(prompt, room)
        assert choice["message"] == {"role": "assistant", "content": tokenizer.decode(toks)}
        assert choice["finish_reason"] == "length"
        assert [c["logprob"] for c in choice["logprobs"]["content"]] == expected_logprobs(room)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": room, "total_tokens": len(prompt) + room}
        assert out["usage"] == usage
        body = {"messages": messages, "max_completion_tokens": 2, "n": 3, "temperature": 0.7}
        out = (await http.post("/v1/chat/completions", json=body)).json()
        assert len(out["choices"]) == 3 and out["usage"]["completion_tokens"] == 6
        assert out["usage"]["prompt_tokens"] == len(prompt) and out["choices"][0]["logprobs"] is None

    with_app(core, fn)


def test_info_endpoints(tokenizer):
    core = FakeCore(tokenizer)

    async def fn(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
        assert (await http.get("/health")).status_code == 200
        info = (await http.get("/get_model_info")).json()
        assert info["model_path"] == "/models/m" and info["max_model_len"] == 64
        assert (await http.get("/get_weight_version")).json() == {"weight_version": 0}
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["/models/m"]
        assert (await http.get("/get_server_info")).json()["running"] == 0
        r = await http.post("/flush_cache")
        assert r.status_code == 200 and r.json()["success"] is True
        engine.close()
        assert (await http.get("/health")).status_code == 503
        r = await http.post("/generate", json={"input_ids": [1]})
        closed = "the engine is closed: this server cannot serve any more; restart it"
        assert r.status_code == 503 and r.json()["error"] == {
            "message": closed,
            "type": "engine_unavailable",
            "param": None,
            "code": 503,
        }

    with_app(core, fn, model_name="/models/m")


# ---------------------------------------------------------------------- bad requests
BAD = [
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens must be an int >= 1"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens must be an int >= 1"),
    ("/generate", {"input_ids": list(range(70))}, "prompt is 70 tokens; max_model_len is 64"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature: Input"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p must be in (0, 1]"),
    ("/generate", {"input_ids": [1], "sampling_params": {"seed": 2**64}}, "seed must be in [0, 2**64)"),
    ("/generate", {"input_ids": ["a"]}, "input_ids.0: Input should be a valid integer"),
    ("/generate", {"input_ids": [1], "return_logprob": "yes"}, "return_logprob: Input should be a valid boolean"),
    ("/generate", {"sampling_params": {}}, "input_ids: give exactly one of input_ids and text"),
    ("/generate", {"input_ids": [[1], [2]], "rid": "one"}, "rid: give one rid per prompt (2)"),
    ("/generate", {"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len: only -1"),
    ("/generate", b'{"text": "a\\ud800b"}', "text: invalid character at position 1 (a lone surrogate)"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens: must be >= 1"),
    ("/v1/completions", {"prompt": list(range(70))}, "prompt is 70 tokens; the context is 64 tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo: not supported"),
    ("/v1/chat/completions", {"model": "m"}, "messages: Field required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n: must be between 1 and 16"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 100000}, "n: must be between 1"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
        "response_format: type 'json_object' is not supported",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0]: part type 'image_url' is not supported",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}, "logit_bias"),
    ("/abort_request", {}, "rid: give a rid or abort_all"),
    ("/update_weights_from_tensor", {"tensors": "not base64!"}, "tensors: not a base64 safetensors blob"),
    ("/update_weights_from_tensor", {"tensors": "AAAA", "weight_version": "seven"}, "weight_version: must be an int"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}, "serialized_named_tensors: SGLang's format"),
    ("/pause_generation", {"mode": "sideways"}, "mode: Input should be"),
]


def test_bad_requests_get_400_naming_the_field_and_the_server_keeps_serving(tokenizer):
    core = FakeCore(tokenizer)

    async def fn(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
        for path, body, message in BAD:
            if isinstance(body, bytes):  # JSON escapes only: a lone surrogate cannot be sent as UTF-8
                r = await http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = await http.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            error = r.json()["error"]
            assert message in error["message"], (path, body, r.json())
            assert error["type"] == "invalid_request_error" and error["code"] == 400
        r = await http.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
        r = await http.get("/no_such_route")
        assert r.status_code == 404 and r.json()["error"]["message"] == "GET /no_such_route: no such route"
        assert engine.load() == 0 and core.reqs == {}
        r = await http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and r.json()["output_ids"] == expected_tokens([1, 2], 2)

    with_app(core, fn)


def test_batch_with_one_bad_prompt_adds_nothing(tokenizer):
    core = FakeCore(tokenizer)

    async def fn(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
        await http.post("/pause_generation")
        r = await http.post("/generate", json={"input_ids": [[1, 2], list(range(80))]})
        assert r.status_code == 400 and "prompt is 80 tokens" in r.json()["error"]["message"]
        await wait_until(lambda: not core.reqs)  # the good one was aborted again
        await http.post("/continue_generation")

    with_app(core, fn)


def test_step_failure_is_a_500_and_the_next_request_works(tokenizer):
    core = FakeCore(tokenizer)

    async def fn(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
        core.fail_next_step = True
        r = await http.post("/generate", json={"input_ids": [1]})
        boom = {"message": "RuntimeError: boom", "type": "server_error", "param": None, "code": 500}
        assert r.status_code == 500 and r.json() == {"error": boom}
        r = await http.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200 and r.json()["output_ids"] == expected_tokens([1], 3)

    with_app(core, fn)


# ---------------------------------------------------------------------- control
def test_abort_returns_partial_tokens(tokenizer):
    core = FakeCore(tokenizer, max_model_len=100_000, step_delay=0.002)

    async def fn(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
        body = {"input_ids": [3, 1], "sampling_params": {"max_new_tokens": 90_000}, "return_logprob": True}
        long = asyncio.ensure_future(http.post("/generate", json={**body, "rid": "long"}))
        other = asyncio.ensure_future(http.post("/generate", json={**body, "rid": "other"}))
        await wait_until(lambda: "long" in core.reqs and len(core.reqs["long"]["tokens"]) >= 5)
        r = await http.post("/abort_request", json={"rid": "long"})
        assert r.json() == {"success": True, "aborted": ["long"]}
        out = (await long).json()
        n = out["meta_info"]["completion_tokens"]
        assert n >= 5 and out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["output_ids"] == expected_tokens([3, 1], n)
        assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == expected_logprobs(n)
        assert "other" in core.reqs  # untouched
        r = await http.post("/abort_request", json={"abort_all": True})
        assert r.json()["aborted"] == ["other"]
        assert (await other).json()["meta_info"]["finish_reason"]["type"] == "abort"

    with_app(core, fn)


def test_pause_holds_requests_until_continue(tokenizer):
    core = FakeCore(tokenizer)

    async def fn(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
        before = core.step_calls
        task = asyncio.ensure_future(
            http.post("/generate", json={"input_ids": [2], "sampling_params": {"max_new_tokens": 5}, "rid": "p"})
        )
        await wait_until(lambda: "p" in core.reqs)
        await asyncio.sleep(0.3)
        assert core.step_calls == before and core.reqs["p"]["tokens"] == [] and not task.done()
        assert (await http.get("/get_server_info")).json()["paused"] is True
        assert (await http.post("/continue_generation")).status_code == 200
        out = (await task).json()
        assert out["output_ids"] == expected_tokens([2], 5) and out["meta_info"]["finish_reason"]["type"] == "length"
        assert core.step_calls == before + 5

    with_app(core, fn)


def post_weights(http: httpx.AsyncClient, form: str, blob: bytes, **options) -> Awaitable[httpx.Response]:
    """One `/update_weights_from_tensor` call in `form`: `raw` (the blob as the body, the options
    in the query string, as tidal's trainer sends it) or `json` (base64 in `tensors`)."""
    if form == "json":
        return http.post("/update_weights_from_tensor", json={"tensors": base64.b64encode(blob).decode(), **options})
    query = {k: "null" if v is None else str(v).lower() for k, v in options.items() if v is not None}
    headers = {"content-type": WEIGHTS_CONTENT_TYPE}
    return http.post("/update_weights_from_tensor", content=blob, params=query, headers=headers)


@pytest.mark.parametrize("form", ["raw", "json"])
def test_update_weights_from_tensor_round_trip(tokenizer, form):
    core = FakeCore(tokenizer)
    tensors = {"a.weight": torch.randn(3, 4), "b.bias": torch.arange(5).to(torch.bfloat16), "c": torch.tensor([7])}

    async def fn(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
        (blob,) = encode_tensors(tensors.items())
        r = await post_weights(http, form, blob, weight_version=5)
        assert r.status_code == 200 and r.json()["success"] is True and r.json()["weight_version"] == 5
        ((named, version),) = core.received
        assert version == 5 and named.keys() == tensors.keys()
        for k, t in tensors.items():
            assert named[k].dtype == t.dtype and torch.equal(named[k], t)
        assert core.flushes == 1
        assert (await http.get("/get_weight_version")).json() == {"weight_version": 5}
        out = (await http.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})).json()
        assert out["meta_info"]["weight_version"] == 5
        # a chunk without a version keeps the current one (passed explicitly), and need not flush
        r = await post_weights(http, form, blob, weight_version=None, flush_cache=False)
        assert r.json()["weight_version"] == 5
        assert core.received[-1][1] == 5 and core.flushes == 1

    with_app(core, fn)


def test_a_raw_weight_chunk_with_a_bad_option_or_body_is_refused_naming_it(tokenizer):
    """The raw form's options come from the query string: one that is not what its field takes,
    a blob given twice, or a body that is no safetensors blob is a 400 naming the field, and
    nothing reaches the engine."""
    core = FakeCore(tokenizer)
    (blob,) = encode_tensors([("a.weight", torch.ones(2))])

    async def fn(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
        cases = [
            ({"weight_version": "seven"}, blob, "weight_version: must be an int >= 0, got 'seven'"),
            ({"weight_version": "-1"}, blob, "weight_version: must be an int >= 0, got -1"),
            ({"stage": "maybe"}, blob, "stage: Input should be a valid boolean"),
            ({"tensors": "AAAA"}, blob, "tensors: give the blob as the body or as a JSON body's `tensors`, not both"),
            ({}, b"not safetensors", "tensors: not a safetensors blob (application/octet-stream) ("),
        ]
        for query, body, message in cases:
            headers = {"content-type": WEIGHTS_CONTENT_TYPE}
            r = await http.post("/update_weights_from_tensor", content=body, params=query, headers=headers)
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), (query, r.text)
        assert core.received == []
        r = await post_weights(http, "raw", blob, weight_version=1, stage=False)
        assert r.status_code == 200 and core.received[-1][1] == 1

    with_app(core, fn)


def test_update_weights_from_disk(tokenizer, tmp_path):
    core = FakeCore(tokenizer)

    async def fn(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
        r = await http.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": 2})
        assert r.status_code == 200 and r.json()["success"] is True
        assert core.disk_loads == [(str(tmp_path), 2)]
        assert (await http.get("/get_weight_version")).json() == {"weight_version": 2}
        r = await http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
        assert r.status_code == 400 and r.json()["success"] is False and "nope" in r.json()["message"]
        assert (await http.get("/get_weight_version")).json() == {"weight_version": 2}

    with_app(core, fn)


def test_url_of_names_the_bound_port_and_brackets_ipv6():
    """`tidal serve --port 0` prints this URL: the port the OS chose, an IPv6 host in brackets."""
    import socket

    from tidal.server.app import LISTENING, listening_url, url_of

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert url_of(s) == f"http://127.0.0.1:{s.getsockname()[1]}" and s.getsockname()[1] > 0
        # what a caller reads back from the server's output, logs before and after it
        output = f"INFO loading\n{LISTENING}{url_of(s)}\nINFO started\n"
        assert listening_url(output) == url_of(s) and listening_url("INFO loading\n") is None
    if not socket.has_ipv6:
        return
    with socket.socket(socket.AF_INET6) as s:
        try:
            s.bind(("::1", 0))
        except OSError:  # no IPv6 loopback on this machine
            return
        assert url_of(s) == f"http://[::1]:{s.getsockname()[1]}"
