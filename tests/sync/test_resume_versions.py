"""Weight versions across a trainer restart, over every HTTP transport against `tidal serve`
in this process (issue 48, item 3): a server refuses a version older than the one it holds
unless the push says `allow_older`, which a trainer's weight sync sends on its first push only
(it may have restarted, or resumed from a checkpoint behind servers that lived on)."""

from __future__ import annotations

import itertools

import httpx
import pytest
from conftest import make_model, make_tokenizer

from tidal.adapters.async_engine import AsyncEngine
from tidal.adapters.client import EngineClient
from tidal.engine.llm_engine import LLMEngine
from tidal.engine.weights import model_checksum, weights_checksum
from tidal.server.app import BackgroundServer, build_app
from tidal.sync.base import SyncError
from tidal.sync.distributed import DistributedSync
from tidal.sync.remote import DiskSync, HttpSync

_names = itertools.count()


class Trainer:
    """The trainer role's `named_weights` and `save_model`, over a model of the tiny family."""

    def __init__(self, seed: int) -> None:
        self.model = make_model(seed=seed)

    def named_weights(self, dtype=None):
        for name, p in self.model.named_parameters():
            yield name, p.detach().to(dtype) if dtype is not None else p.detach()

    def save_model(self, path) -> None:
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in self.named_weights()}, f"{path}/model.safetensors")


@pytest.fixture
def server():
    core = LLMEngine(make_model(), make_tokenizer(), dtype="float32", kv_cache_tokens=512)
    engine = AsyncEngine(core)
    served = BackgroundServer(build_app(engine, "tiny")).start()
    yield served, core
    served.stop()
    engine.close()


def transport(kind: str, trainer: Trainer, url: str, tmp_path):
    clients = [EngineClient(url, 60)]
    if kind == "distributed":
        return DistributedSync(trainer, clients, timeout=60, group_name=f"tidal-test-{next(_names)}")
    if kind == "disk":
        return DiskSync(trainer, clients, root=tmp_path, timeout=60)
    return HttpSync(trainer, clients, timeout=60, delta=kind == "delta")


@pytest.mark.parametrize("kind", ["http", "delta", "disk", "distributed"])
def test_a_restarted_trainer_goes_back_once_and_then_only_forward(server, kind, tmp_path):
    served, core = server
    old = transport(kind, Trainer(seed=3), served.url, tmp_path / "old")
    old.push(12)  # the run before the restart got this far
    old.close()
    assert core.weight_version == 12
    trainer = Trainer(seed=4)
    sync = transport(kind, trainer, served.url, tmp_path / "new")
    try:
        sync.push(10)  # resumed from the checkpoint of step 10: the first push may go back
        assert core.weight_version == 10 and model_checksum(core.model) == weights_checksum(trainer.named_weights())
        sync.push(11)
        assert core.weight_version == 11
        before = model_checksum(core.model)
        with pytest.raises(SyncError, match=r"weight_version: 9 is older than the weights this engine holds"):
            sync.push(9)  # later pushes only go forward
        assert core.weight_version == 11 and model_checksum(core.model) == before
        # and the server still serves
        body = {"input_ids": [5, 9], "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(served.url + "/generate", json=body, timeout=60).json()["meta_info"]["weight_version"] == 11
    finally:
        sync.close()


def test_weights_sent_again_as_the_version_held_are_taken(server, tmp_path):
    """A push that repeats the version the server holds (an engine given the current version
    again, a retried push) is not going back."""
    served, core = server
    sync = transport("http", Trainer(seed=3), served.url, tmp_path)
    try:
        sync.push(0)
        sync.push(0)
        sync.push(1)
        assert core.weight_version == 1
    finally:
        sync.close()
