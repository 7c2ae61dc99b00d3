"""SGLang's weight update by broadcast against `tidal serve` in-process: the trainer's side is
played here by hand (rank 0 of the group, posting SGLang's bodies while it broadcasts), so each
protocol step and each refusal is checked on its own. `tidal.sync.distributed` drives the same
routes in tests/sync/test_distributed_sync.py."""

from __future__ import annotations

import datetime
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from conftest import make_model, make_tokenizer

from tidal.adapters.async_engine import AsyncEngine
from tidal.engine.llm_engine import LLMEngine
from tidal.engine.weights import model_checksum, weights_checksum
from tidal.net import free_port, host_store
from tidal.server.app import BackgroundServer, build_app
from tidal.sync.group import WeightGroup, join_weight_group

_names = itertools.count()


def group_name() -> str:
    # torch's registry of group names is per process: every test forms a group of its own
    return f"test-group-{next(_names)}"


@pytest.fixture
def served():
    core = LLMEngine(make_model(), make_tokenizer(), dtype="float32", kv_cache_tokens=512)
    engine = AsyncEngine(core)
    server = BackgroundServer(build_app(engine, "tiny")).start()
    yield server, core
    server.stop()
    engine.close()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def form_group(url: str, name: str) -> WeightGroup:
    """Rank 0 here (serving the group's store, as `tidal.sync.distributed` does), the server rank 1:
    both sides must be joining at once."""
    store = host_store("127.0.0.1", 60)
    with ThreadPoolExecutor(1) as pool:
        body = dict(master_address="127.0.0.1", master_port=store.port, rank_offset=1, world_size=2, group_name=name)
        answer = pool.submit(post, url, "/init_weights_update_group", {**body, "backend": "gloo"})
        group = join_weight_group("127.0.0.1", store.port, 0, 2, name, "gloo", timeout=60, store=store)
        resp = answer.result()
    assert resp.status_code == 200, resp.text
    assert resp.json()["success"] is True
    return group


def send(url: str, group: WeightGroup, named: list[tuple[str, torch.Tensor]], **fields) -> httpx.Response:
    """Post SGLang's body for `named` and broadcast the tensors meanwhile, one per tensor."""
    body = {
        "names": [n for n, _ in named],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "group_name": group.name,
        **fields,
    }
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(post, url, "/update_weights_from_distributed", body)
        for _, t in named:
            group.broadcast(t.contiguous())
        return answer.result()


def test_group_is_formed_the_way_sglang_forms_it():
    """A rank that joins as SGLang's init_custom_process_group does (rendezvous, a PrefixStore
    named after the group, torch's group helper) meets tidal's rank 0, which serves the store
    (`host_store`): same store keys."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    name, store = group_name(), host_store("127.0.0.1", 60)
    port = store.port
    timeout = datetime.timedelta(seconds=60)
    got = {}

    def sglang_rank() -> None:
        store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
        store.set_timeout(timeout)
        pg, _ = _new_process_group_helper(
            world, rank, [], Backend("gloo"), PrefixStore(name, store), group_name=name, timeout=timeout
        )
        _world.pg_group_ranks[pg] = {i: i for i in range(world)}
        x = torch.empty(5)
        torch.distributed.broadcast(x, 0, group=pg)
        got["x"] = x
        torch.distributed.destroy_process_group(pg)

    thread = threading.Thread(target=sglang_rank)
    thread.start()
    group = join_weight_group("127.0.0.1", port, 0, 2, name, "gloo", timeout=60, store=store)
    group.broadcast(torch.arange(5.0))
    thread.join(60)
    group.close()
    assert torch.equal(got["x"], torch.arange(5.0))


def test_staged_buckets_load_all_at_once_with_the_version(served):
    server, core = served
    group = form_group(server.url, group_name())
    new = make_model(seed=7)
    named = [(n, p.detach()) for n, p in new.named_parameters()]
    first, rest = named[:3], named[3:]
    resp = send(server.url, group, first, stage=True)
    assert resp.status_code == 200, resp.text
    assert core.weight_version == 0  # staged: nothing loaded yet
    assert model_checksum(core.model) == model_checksum(make_model())
    resp = send(server.url, group, rest, weight_version="5")
    assert resp.status_code == 200, resp.text
    assert resp.json()["weight_version"] == 5
    info = httpx.get(server.url + "/get_weight_version?checksum=true").json()
    assert info == {"weight_version": 5, "weight_checksum": weights_checksum(named)}
    group.close()


def test_a_bad_shape_leaves_the_old_weights_and_version(served):
    server, core = served
    group = form_group(server.url, group_name())
    before = model_checksum(core.model)
    named = [(n, p.detach() + 1) for n, p in make_model().named_parameters()]
    name, good = named[1]
    bad = torch.zeros(good.shape[0] + 1, *good.shape[1:])
    resp = send(server.url, group, named[:1] + [(name, bad)] + named[2:], weight_version="3")
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert f"{name} has shape {tuple(bad.shape)}, the engine's is {tuple(good.shape)}" in message
    assert resp.json()["success"] is False
    assert core.weight_version == 0 and model_checksum(core.model) == before
    # the group is still in step: every announced tensor was received, so the next call works
    resp = send(server.url, group, named, weight_version="4")
    assert resp.status_code == 200, resp.text
    assert core.weight_version == 4 and model_checksum(core.model) == weights_checksum(named)
    group.close()


def test_a_weight_version_below_zero_or_older_is_refused_and_the_group_stays_in_step(served):
    """Issue 48 (3): `weight_version: "-1"` by broadcast was loaded (the engine then refused to
    generate), and a version older than the one held went through. Both are now refused once the
    tensors are received (so the group stays in step), naming the value and the version held, and
    nothing is loaded (the staged buckets neither); `allow_older: true` goes back on purpose."""
    server, core = served
    group = form_group(server.url, group_name())
    named = [(n, p.detach()) for n, p in make_model(seed=5).named_parameters()]
    assert send(server.url, group, named, weight_version="10").status_code == 200
    before = model_checksum(core.model)
    other = [(n, p.detach()) for n, p in make_model(seed=6).named_parameters()]
    older = (
        "weight_version: 3 is older than the weights this engine holds (version 10); a trainer that restarted "
        "sends allow_older: true to go back"
    )
    for version, staged, message in [
        ("-1", [], "weight_version: must be an int >= 0, got -1"),
        ("3", [], older),
        ("3", other[:3], older),  # the buckets staged before a refused last call are dropped with it
    ]:
        if staged:
            assert send(server.url, group, staged, stage=True).status_code == 200
        resp = send(server.url, group, other[len(staged) :], weight_version=version)
        error = {"message": message, "type": "invalid_request_error", "param": "weight_version", "code": 400}
        assert (resp.status_code, resp.json()) == (400, {"error": error, "success": False, "message": message})
        assert core.weight_version == 10 and model_checksum(core.model) == before
    # in step: the group carries the next calls; the stage was emptied, so a partial call loads alone
    name, norm = other[-1]
    assert send(server.url, group, [(name, norm)], weight_version="11").status_code == 200
    assert model_checksum(core.model) == weights_checksum([*named[:-1], (name, norm)])
    resp = send(server.url, group, other, weight_version="3", allow_older=True)
    assert resp.status_code == 200 and resp.json()["weight_version"] == 3
    assert model_checksum(core.model) == weights_checksum(other)
    group.close()


def test_a_partial_update_changes_only_what_it_sends(served):
    """SGLang loads the names a call sends and keeps the rest."""
    server, core = served
    group = form_group(server.url, group_name())
    before = {n: p.detach().clone() for n, p in core.model.named_parameters()}
    name = "model.norm.weight"
    resp = send(server.url, group, [(name, torch.full_like(before[name], 2.0))], weight_version="1")
    assert resp.status_code == 200, resp.text
    after = dict(core.model.named_parameters())
    assert torch.equal(after[name], torch.full_like(before[name], 2.0))
    assert all(torch.equal(after[n], t) for n, t in before.items() if n != name)
    assert core.weight_version == 1
    group.close()


def test_a_malformed_call_destroys_the_group_and_names_the_field(served):
    server, _ = served
    name = group_name()
    group = form_group(server.url, name)
    resp = post(server.url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                "rank_offset": 1, "world_size": 2, "group_name": name, "backend": "gloo"})  # fmt: skip
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == f"group_name: a group {name!r} exists; destroy it first"
    body = {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [1]], "group_name": name}
    resp = post(server.url, "/update_weights_from_distributed", body)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == (
        f"names: 2 names, 1 dtypes and 2 shapes (the group {name!r} is out of step and was destroyed)"
    )
    body = {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": name}
    resp = post(server.url, "/update_weights_from_distributed", body)
    assert resp.status_code == 400
    assert "no group" in resp.json()["error"]["message"]
    resp = post(server.url, "/destroy_weights_update_group", {"group_name": name})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == f"group_name: no group {name!r} on this server"
    group.close()


def test_destroy_then_form_again(served):
    server, core = served
    name = group_name()
    group = form_group(server.url, name)
    resp = post(server.url, "/destroy_weights_update_group", {"group_name": name})
    assert resp.status_code == 200 and resp.json()["success"] is True
    group.close()
    # torch's name registry is not involved on either side: the same name forms a new group
    group = form_group(server.url, name)
    named = [(n, p.detach()) for n, p in make_model(seed=3).named_parameters()]
    assert send(server.url, group, named, weight_version="2").status_code == 200
    assert core.weight_version == 2
    group.close()


def test_nccl_is_refused_without_cuda(served):
    server, _ = served
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
    resp = post(server.url, "/init_weights_update_group", body)  # SGLang's default backend: nccl
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "backend: nccl needs CUDA and this server has none; use gloo"


def test_worker_routes_the_router_reads(served):
    server, core = served
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["engine"] == "tidal" and info["dtype"] == "float32"
    assert httpx.get(server.url + "/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0}]
    steps = core.counters["steps"]
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    assert core.counters["steps"] > steps  # it generated a token to say so
