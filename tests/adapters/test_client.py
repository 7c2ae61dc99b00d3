"""EngineClient, Router and HttpEngine against real uvicorn servers (on free local ports) that
serve the scripted fake core of test_server.py."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch
from fake_core import FakeCore, expected_logprobs, expected_tokens

from tidal.adapters.async_engine import AsyncEngine
from tidal.adapters.client import EngineClient, EngineError, HttpEngine, Router
from tidal.contracts import SamplingParams
from tidal.server.app import BackgroundServer, build_app


class Served:
    """A fake core behind AsyncEngine behind a uvicorn server on a free port."""

    def __init__(self, tokenizer, **core_kw) -> None:
        self.core = FakeCore(tokenizer, **core_kw)
        self.engine = AsyncEngine(self.core)
        self.server = BackgroundServer(build_app(self.engine, "fake")).start()
        self.url = self.server.url

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


@pytest.fixture
def servers(tokenizer):
    made = [Served(tokenizer, max_model_len=10_000, step_delay=0.001) for _ in range(2)]
    yield made
    for s in made:
        s.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


async def await_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def sp(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, **kw)


# ---------------------------------------------------------------------- EngineClient
def test_client_generate_and_control_round_trip(servers):
    srv = servers[0]

    async def main() -> None:
        c = EngineClient(srv.url, timeout=30)
        try:
            assert await c.health() is True
            out = await c.generate([5, 6], sp(4, temperature=0.5, top_k=0, seed=9, stop_token_ids=[999]))
            assert out.token_ids == expected_tokens([5, 6], 4)
            assert out.log_probs == expected_logprobs(4)
            assert out.finish_reason == "length" and out.weight_version == 0
            assert out.text == srv.core.tokenizer.decode(out.token_ids)
            (params,) = srv.core.params.values()
            assert (params.temperature, params.top_k, params.seed, params.stop_token_ids) == (0.5, 0, 9, [999])
            assert await c.flush_cache() is True
            await c.pause()
            task = asyncio.ensure_future(c.generate([1], sp(3)))
            await await_until(lambda: len(srv.core.reqs) == 1)
            assert await c.flush_cache() is False  # the fake refuses while a request is in flight
            await c.resume()
            assert (await task).token_ids == expected_tokens([1], 3)
            tensors = {f"layer{i}.w": torch.full((64,), float(i)) for i in range(3)}
            await c.update_weights_from_tensors(tensors.items(), version=7, chunk_bytes=300)
            # 256 bytes per tensor, 300 per chunk: three requests; the first two are staged (no
            # version), the last loads everything as version 7
            assert [v for _, v in srv.core.received] == [None, None, 7]
            got = {k: t for named, _ in srv.core.received for k, t in named.items()}
            assert all(torch.equal(got[k], t) for k, t in tensors.items())
            assert await c.get_weight_version() == 7
            assert srv.core.flushes == 3  # the two explicit calls + one after the last chunk
        finally:
            await c.aclose()

    asyncio.run(main())


def test_client_errors_name_the_url_and_endpoint(servers):
    srv = servers[0]
    dead = f"http://127.0.0.1:{free_port()}"

    async def main() -> None:
        c = EngineClient(dead, timeout=5)
        with pytest.raises(EngineError, match=rf"^{dead}/generate: cannot connect") as e:
            await c.generate([1], sp(2))
        assert e.value.url == f"{dead}/generate"
        with pytest.raises(EngineError, match=rf"^{dead}/health: cannot connect"):
            await c.health()

        c = EngineClient(srv.url, timeout=30)
        await c.pause()
        # A paused server never answers, so only the client's deadline ends this request; the calls
        # that must succeed keep a timeout a loaded machine cannot miss.
        short = EngineClient(srv.url, timeout=2)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=rf"^{srv.url}/generate: timed out after 2 s$"):
            await short.generate([1], sp(2))
        assert time.monotonic() - t0 < 30  # generous: it did not wait for the server, whatever the load
        await short.aclose()
        # the server noticed the client leave and aborted its request
        await await_until(lambda: not srv.core.reqs, timeout=30)
        await c.resume()
        with pytest.raises(EngineError, match=rf"^{srv.url}/generate: HTTP 400: .*max_new_tokens") as e:
            await c._request("POST", "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}})
        assert e.value.status == 400
        with pytest.raises(EngineError, match=rf"^{srv.url}/update_weights_from_disk: HTTP 400: .*nope"):
            await c.update_weights_from_disk("/nope", 3)
        await c.aclose()

    asyncio.run(main())


# ---------------------------------------------------------------------- Router
def test_router_picks_the_least_loaded_server(servers):
    async def main() -> None:
        router = Router([EngineClient(s.url, timeout=30) for s in servers])
        await router.clients[0].pause()
        try:
            a = asyncio.ensure_future(router.generate([1], sp(2)))  # -> 0 (tie), stuck there
            await await_until(lambda: router.in_flight == [1, 0])
            assert (await router.generate([2], sp(2))).token_ids == expected_tokens([2], 2)  # -> 1
            assert router.in_flight == [1, 0]
            b = asyncio.ensure_future(router.generate([3], sp(2)))  # -> 1, the less loaded
            c = asyncio.ensure_future(router.generate([4], sp(2)))  # [1, 1]: tie -> 0
            await await_until(lambda: router.in_flight in ([2, 1], [2, 0]))
            await b
            await router.clients[0].resume()
            await asyncio.gather(a, c)
            assert router.in_flight == [0, 0]
            assert sorted(servers[0].core.prompts.values()) == [[1], [4]]
            assert sorted(servers[1].core.prompts.values()) == [[2], [3]]
        finally:
            await router.aclose()

    asyncio.run(main())


def test_router_keeps_a_group_on_one_server_until_it_completes(servers):
    async def main() -> None:
        router = Router([EngineClient(s.url, timeout=30) for s in servers])
        await router.broadcast("pause")
        try:
            g1 = asyncio.ensure_future(router.generate([7], sp(2), group="g"))  # -> 0
            await await_until(lambda: router.in_flight == [1, 0])
            g2 = asyncio.ensure_future(router.generate([7], sp(2), group="g"))  # -> 0 although 1 is idle
            await await_until(lambda: router.in_flight == [2, 0])
            h1 = asyncio.ensure_future(router.generate([8], sp(2), group="h"))  # -> 1
            await await_until(lambda: router.in_flight == [2, 1])
            g3 = asyncio.ensure_future(router.generate([7], sp(2), group="g"))  # -> 0 again
            await await_until(lambda: router.in_flight == [3, 1])
            await router.broadcast("resume")
            outs = await asyncio.gather(g1, g2, g3, h1)
            assert [o.token_ids for o in outs] == [expected_tokens([7], 2)] * 3 + [expected_tokens([8], 2)]
            assert router.in_flight == [0, 0] and router._groups == {}
            # the group is done: its next request is placed afresh (tie -> 0), then [1, 0] -> 1
            assert router.acquire("g") == 0 and router.acquire("g2") == 1
            assert sorted(servers[0].core.prompts.values()) == [[7], [7], [7]]
            assert list(servers[1].core.prompts.values()) == [[8]]
        finally:
            await router.aclose()

    asyncio.run(main())


# ---------------------------------------------------------------------- HttpEngine
def test_http_engine_meets_the_engine_contract(servers):
    from tidal.contracts import Engine

    engine = HttpEngine([s.url for s in servers], timeout=30)
    assert isinstance(engine, Engine)
    prompts = [[1, 2], [1, 2], [1, 2], [3], [3], [4, 5, 6]]
    params = [sp(3 + i, seed=i) for i in range(len(prompts))]
    groups = ["a", "a", "a", "b", "b", "c"]

    async def main() -> None:
        try:
            outs = await asyncio.gather(
                *(engine.generate(p, s, group=g) for p, s, g in zip(prompts, params, groups, strict=True))
            )
            for p, s, o in zip(prompts, params, outs, strict=True):
                assert o.token_ids == expected_tokens(p, s.max_new_tokens) and o.finish_reason == "length"
                assert o.log_probs == expected_logprobs(s.max_new_tokens) and o.weight_version == 0
            # each group went to one server, and the requests carried their own seeds
            for p in ([1, 2], [3]):
                homes = [i for i, s in enumerate(servers) if p in s.core.prompts.values()]
                assert len(homes) == 1, (p, homes)
            assert sum(len(s.core.prompts) for s in servers) == len(prompts)
            seeds = sorted(p.seed for s in servers for p in s.core.params.values())
            assert seeds == list(range(len(prompts)))

            # control calls reach every server
            await engine.pause()
            assert all(s.engine.paused for s in servers)
            stuck = asyncio.ensure_future(engine.generate([7, 7], sp(5), request_id="r-stuck"))
            await await_until(lambda: any("r-stuck" in s.core.reqs for s in servers))
            await engine.abort()  # every request in flight, on every server
            out = await stuck
            assert out.finish_reason == "abort" and out.token_ids == []
            await engine.resume()
            assert not any(s.engine.paused for s in servers)
            assert await engine.health() and await engine.flush_cache()
            assert await engine.get_weight_versions() == [0, 0]
            for s in servers:
                s.core.weight_version = 5
            assert (await engine.generate([9], sp(1))).weight_version == 5
            assert engine.weight_version == 5  # the newest a server reported

            # cancelling a call aborts its request on the server
            task = asyncio.ensure_future(engine.generate([8, 8], sp(10_000), request_id="r-cancel"))
            await await_until(lambda: any("r-cancel" in s.core.reqs for s in servers))
            task.cancel()
            await await_until(lambda: not any("r-cancel" in s.core.reqs for s in servers))
        finally:
            await engine.aclose()

    asyncio.run(main())


def test_a_weight_push_bigger_than_the_request_body_limit_goes_in_chunks(servers):
    """A 40 MiB tensor (over the 8 MiB limit for requests, and over a 32 MiB chunk) reaches tidal
    serve: the weight route has a limit of its own, and the tensor goes in two pieces that keep
    each chunk at 32 MiB of tensors (this fake core records the pieces; tidal's engines put them
    together, tests/sync/test_http_pieces.py)."""
    from tidal.aio import LoopThread
    from tidal.sync.remote import HttpSync

    big = torch.arange(10 * 2**20, dtype=torch.float32)  # 40 MiB

    class Trainer:
        def named_weights(self, dtype=None):
            return iter([("big", big), ("small", torch.ones(3))])

    with LoopThread() as loop:
        sync = HttpSync(Trainer(), [EngineClient(servers[0].url, 60)], 60, check=False, loop=loop)
        metrics = sync.push(4)
    received = servers[0].core.received
    assert [v for _, v in received] == [None, 4]  # two chunks: the first staged, the last loads as version 4
    first, last = received[0][0], received[1][0]
    # elements [0, 8 Mi) of the 10 Mi-element tensor in the first chunk, the rest beside `small`
    assert sorted(first) == ["big@0/10485760"] and sorted(last) == ["big@8388608/10485760", "small"]
    assert torch.equal(torch.cat([first["big@0/10485760"], last["big@8388608/10485760"]]), big)
    assert torch.equal(last["small"], torch.ones(3))
    assert metrics["sync/bytes"] == float(big.numel() * 4 + 12)


def test_a_tensor_larger_than_a_chunk_is_encoded_in_pieces_of_at_most_a_chunk():
    """Every chunk holds at most `chunk_bytes` of tensors: a larger tensor goes in runs of its
    flattened elements named NAME@OFFSET/SHAPE (a chunk size that is no multiple of the element
    size, a strided tensor and bfloat16 included), and the runs put end to end are the tensor."""
    from tidal.adapters.client import body_bytes, decode_tensors, encode_tensors

    big = torch.randn(7, 30).t()  # 30 x 7, strided: 840 bytes
    half = torch.randn(100, dtype=torch.bfloat16)  # 200 bytes
    named = [("a.small", torch.ones(2)), ("b.big", big), ("c.half", half)]
    chunks = [decode_tensors(blob) for blob in encode_tensors(named, chunk_bytes=250)]
    for chunk in chunks:
        assert sum(t.numel() * t.element_size() for _, t in chunk) <= 250
    keys = [k for chunk in chunks for k, _ in chunk]
    # 250 // 4 = 62 floats a piece; bfloat16's 200 bytes fit one chunk whole
    assert keys == ["a.small", *(f"b.big@{i}/30x7" for i in range(0, 210, 62)), "c.half"]
    got = dict(kv for chunk in chunks for kv in chunk)
    pieces = torch.cat([got[f"b.big@{i}/30x7"] for i in range(0, 210, 62)])
    assert torch.equal(pieces.view(30, 7), big) and torch.equal(got["c.half"], half)
    for blob in encode_tensors(named, chunk_bytes=250):  # the body is the blob: 250 bytes and a header
        assert len(blob) < 250 + 400 and body_bytes(blob) == len(blob)


def test_a_weight_chunks_options_go_in_the_query_as_the_server_reads_them():
    """A staged chunk names no version; the last names it and the flags; the rare flags only when set."""
    from tidal.adapters.client import weights_query

    assert weights_query(None, False, True) == {"flush_cache": "false", "stage": "true"}
    assert weights_query(7, True, False) == {"weight_version": "7", "flush_cache": "true", "stage": "false"}
    assert weights_query(0, True, False, partial=True, allow_older=True) == {
        "weight_version": "0",
        "flush_cache": "true",
        "stage": "false",
        "partial": "true",
        "allow_older": "true",
    }
