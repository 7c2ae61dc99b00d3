"""Two real servers (tiny model engines) behind the router: one shut down or gone silent during a
rollout, and every sample still comes back exactly once, exactly as a healthy run samples it."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from conftest import run_batch, shared_loop
from test_served_engine import Served, make_model

from tidal.adapters.client import EngineClient, EngineError, HttpEngine
from tidal.contracts import SamplingParams
from tidal.roles import ServerEngines
from tidal.sync.remote import HttpSync

PROMPTS = [[5, 9, 33, 70]] * 4 + [[12, 40, 41, 42]] * 4 + [[100, 7]] * 4
PARAMS = [SamplingParams(temperature=1.0, max_new_tokens=12, seed=1000 + i) for i in range(len(PROMPTS))]


class Weights:
    """The one trainer method a weight push calls."""

    def __init__(self, model) -> None:
        self.model = model

    def named_weights(self, dtype=None):
        return iter(self.model.state_dict().items())


@pytest.fixture
def two():
    made = [Served(make_model()) for _ in range(2)]
    yield made
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def reference():
    """The samples of a run on one healthy server."""
    s = Served(make_model())
    try:
        return [o.token_ids for o in run_batch(HttpEngine([s.url], timeout=60), PROMPTS, PARAMS)]
    finally:
        s.close()


def run(engine: HttpEngine, coro_fn, *args):
    """`await coro_fn(*args)` on the tests' rollout loop."""

    async def call():
        return await coro_fn(*args)

    return shared_loop().run(call(), 120)


def _rollout_while(engine: HttpEngine, stuck: int, fail) -> list:
    """Roll out on the tests' event loop; once server `stuck` (paused) holds requests, call `fail()`."""

    async def rollout():
        groups = [i // 4 for i in range(len(PROMPTS))]
        return await asyncio.gather(
            *(engine.generate(p, sp, group=g) for p, sp, g in zip(PROMPTS, PARAMS, groups, strict=True))
        )

    fut = shared_loop().submit(rollout())
    deadline = time.monotonic() + 60
    while engine.router.in_flight[stuck] == 0:
        assert time.monotonic() < deadline and not fut.done(), fut
        time.sleep(0.01)
    fail()
    return fut.result(120)


def test_a_server_shut_down_mid_rollout_has_its_requests_sent_to_the_other(two, reference):
    engine = HttpEngine([s.url for s in two], timeout=60)
    run(engine, engine.router.clients[1].pause)  # its requests wait there...
    held = []

    def shut_down() -> None:
        held.append(engine.router.in_flight[1])
        two[1].server.server.force_exit = True  # ...until it goes away with them
        two[1].server.stop()

    outs = _rollout_while(engine, 1, shut_down)
    assert len(outs) == len(PROMPTS)
    assert [o.token_ids for o in outs] == reference  # each sample once, the one it would have been
    assert list(engine.router.down) == [1] and engine.router.resent >= held[0] >= 1
    assert engine.router.in_flight == [0, 0]
    # the dead server is out of service: later requests and controls go to the live one only
    assert run(engine, engine.get_weight_versions) == [0]
    assert 1 in run(engine, engine.check_health)
    # the weight push goes to the server in service (not ours to restart: it stays out until it
    # answers /health again)
    engines = ServerEngines(engine, shared_loop())
    clients = [EngineClient(s.url, 30) for s in two]
    sync = HttpSync(Weights(make_model(seed=1)), clients, 30, engines=engines, loop=engines.loop)
    sync.push(3)
    assert run(engine, engine.get_weight_versions) == [3] and engines.live_urls() == [two[0].url]
    assert engine.weight_version == 3


def test_a_server_that_dies_after_its_rollout_is_left_out_of_the_next_push(two, reference):
    """The server goes away after its last request (the router never saw it fail): the push's
    health check takes it out of service and the push goes to the live one (a remote server is not
    ours to restart), instead of failing on it and ending the run. With none left, the push says so."""
    from tidal.sync.base import SyncError

    engine = HttpEngine([s.url for s in two], timeout=60)
    outs = run_batch(engine, PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == reference and engine.router.down == {}
    two[1].server.server.force_exit = True
    two[1].server.stop()
    engines = ServerEngines(engine, shared_loop())
    clients = [EngineClient(s.url, 30) for s in two]
    sync = HttpSync(Weights(make_model(seed=1)), clients, 30, engines=engines, loop=engines.loop)
    sync.push(3)
    assert engines.live_urls() == [two[0].url] and list(engine.router.down) == [1]
    assert run(engine, engine.get_weight_versions) == [3]
    assert {o.weight_version for o in run_batch(engine, PROMPTS, PARAMS)} == {3}
    two[0].server.server.force_exit = True
    two[0].server.stop()
    with pytest.raises(SyncError, match=r"over http: no engine to push to: .*/health: cannot connect"):
        sync.push(4)


def test_a_silent_server_is_a_bounded_wait(two, reference):
    engine = HttpEngine([s.url for s in two], timeout=60)  # the live server's requests: room for load
    engine.router.clients[1].timeout = 2.0  # the silent one's
    run(engine, engine.router.clients[1].pause)  # paused for good: it never answers
    t0 = time.monotonic()
    outs = _rollout_while(engine, 1, lambda: None)
    assert 2.0 <= time.monotonic() - t0 < 30
    assert [o.token_ids for o in outs] == reference
    assert engine.router.down[1] == f"{two[1].url}/generate: timed out after 2 s"


def test_no_live_server_left_names_every_one(two):
    engine = HttpEngine([s.url for s in two], timeout=60)
    for s in two:
        s.server.stop()
    with pytest.raises(EngineError) as err:
        run_batch(engine, PROMPTS[:2], PARAMS[:2])
    msg = str(err.value)
    assert msg.startswith("engines: no live engine left (2 of 2 down): ")
    for s in two:
        assert f"{s.url}/generate: cannot connect" in msg


def test_control_calls_wait_the_control_timeout_not_the_request_timeout():
    """A server that accepts connections and never answers (a silent engine): health and pause
    give up after the control timeout, naming the URL and the endpoint waited on."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshakes; nobody reads the requests
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        engine = HttpEngine([url], timeout=600)
        engine.router.clients[0].control_timeout = 0.5
        for call, endpoint in ((engine.health, "health"), (engine.pause, "pause_generation")):
            t0 = time.monotonic()
            with pytest.raises(EngineError, match=rf"^{url}/{endpoint}: timed out after 0.5 s$"):
                run(engine, call)
            assert time.monotonic() - t0 < 60  # generous for a loaded machine, far below the 600 s request timeout
        assert run(engine, engine.check_health) == {0: f"{url}/health: timed out after 0.5 s"}
