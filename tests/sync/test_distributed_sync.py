"""The `distributed` weight transport against two `tidal serve` servers in this process: the
trainer forms one group with both, pushes in buckets and checks version and checksum. A server
that dies mid-push is covered with real processes in tests/adapters/test_sglang_launch.py."""

from __future__ import annotations

import itertools

import httpx
import pytest
import torch
from conftest import make_model, make_tokenizer

from tidal.adapters.async_engine import AsyncEngine
from tidal.adapters.client import EngineClient
from tidal.engine.llm_engine import LLMEngine
from tidal.engine.weights import model_checksum, weights_checksum
from tidal.server.app import BackgroundServer, build_app
from tidal.sync.base import SyncError
from tidal.sync.distributed import DistributedSync, buckets

_names = itertools.count()


class Trainer:
    """The trainer role's `named_weights`, over a model of the tiny family."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.extra: list[tuple[str, torch.Tensor]] = []

    def named_weights(self, dtype=None):
        for name, p in self.model.named_parameters():
            yield name, p.detach().to(dtype) if dtype is not None else p.detach()
        yield from self.extra


@pytest.fixture
def two_servers(request):
    dtype = getattr(request, "param", "float32")
    cores, engines, servers = [], [], []
    for _ in range(2):
        core = LLMEngine(make_model(), make_tokenizer(), dtype=dtype, kv_cache_tokens=512)
        engine = AsyncEngine(core)
        cores.append(core)
        engines.append(engine)
        servers.append(BackgroundServer(build_app(engine, "tiny")).start())
    yield servers, cores
    for server, engine in zip(servers, engines, strict=True):
        server.stop()
        engine.close()


def make_sync(trainer, servers, **kw) -> DistributedSync:
    kw.setdefault("bucket_bytes", 40_000)  # several buckets for the tiny model
    clients = [EngineClient(s.url, 60) for s in servers]
    return DistributedSync(trainer, clients, timeout=60, group_name=f"tidal-test-{next(_names)}", **kw)


def test_buckets_keep_order_and_size():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]
    parts = buckets(named, bucket_bytes=80)
    assert [[n for n, _ in b] for b in parts] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


def test_push_reaches_both_servers_with_version_and_checksum(two_servers):
    servers, cores = two_servers
    trainer = Trainer(make_model(seed=11))
    sync = make_sync(trainer, servers)
    try:
        metrics = sync.push(1)
        want = model_checksum(trainer.model)
        assert [c.weight_version for c in cores] == [1, 1]
        assert [model_checksum(c.model) for c in cores] == [want, want]
        assert metrics["sync/buckets"] > 1
        assert metrics["sync/tensors"] == len(list(trainer.model.named_parameters()))
        assert metrics["sync/bytes"] == sum(p.numel() * 4 for p in trainer.model.parameters())
        group = sync.group
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(0.5)
        sync.push(2)
        assert sync.group is group  # the group is formed once
        want = model_checksum(trainer.model)
        assert [c.weight_version for c in cores] == [2, 2]
        assert [model_checksum(c.model) for c in cores] == [want, want]
        for s in servers:
            info = httpx.get(s.url + "/get_weight_version?checksum=true").json()
            assert info == {"weight_version": 2, "weight_checksum": want}
    finally:
        sync.close()


def test_a_bad_tensor_shape_fails_naming_the_servers_and_leaves_the_old_weights(two_servers):
    servers, cores = two_servers
    trainer = Trainer(make_model(seed=12))
    sync = make_sync(trainer, servers)
    try:
        sync.push(1)
        before = [model_checksum(c.model) for c in cores]
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(1.0)
        trainer.extra = [("model.norm.weight", torch.ones(3))]  # announced and sent with a wrong shape
        with pytest.raises(SyncError) as err:
            sync.push(2)
        message = str(err.value)
        assert message.startswith("weight sync to engine http://127.0.0.1:")
        assert "model.norm.weight has shape (3,), the engine's is (64,)" in message
        assert err.value.engine in (servers[0].url, servers[1].url)
        assert [c.weight_version for c in cores] == [1, 1]  # nothing of push 2 was loaded
        assert [model_checksum(c.model) for c in cores] == before
        assert sync.group is None  # a failed push leaves the group; the next one forms it again
        trainer.extra = []
        sync.push(3)
        assert [c.weight_version for c in cores] == [3, 3]
        assert [model_checksum(c.model) for c in cores] == [model_checksum(trainer.model)] * 2
    finally:
        sync.close()


@pytest.mark.parametrize("two_servers", ["bfloat16"], indirect=True)
def test_pushes_in_the_servers_dtype(two_servers):
    """bfloat16 servers get bfloat16 tensors (half the bytes) and the checksum of those."""
    servers, cores = two_servers
    trainer = Trainer(make_model(seed=13))
    sync = make_sync(trainer, servers, bucket_bytes=2**30)
    try:
        metrics = sync.push(1)
        assert metrics["sync/bytes"] == sum(p.numel() * 2 for p in trainer.model.parameters())
        want = weights_checksum(trainer.model.named_parameters(), torch.bfloat16)
        assert [model_checksum(c.model) for c in cores] == [want, want]
    finally:
        sync.close()


def test_a_server_that_does_not_answer_is_named(two_servers):
    servers, _ = two_servers
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    sync = DistributedSync(
        Trainer(make_model()), [EngineClient(servers[0].url, 60), EngineClient(dead, 60)], timeout=60
    )
    with pytest.raises(SyncError) as err:
        sync.push(1)
    assert err.value.engine == dead
    assert "cannot connect" in str(err.value)
