"""The `http` and `delta` transports against a real `tidal serve` (a `BackgroundServer` on
127.0.0.1, tiny fp32 model): a tensor larger than a chunk goes in pieces (NAME@OFFSET/SHAPE,
`tidal.adapters.client`), so no request is larger than a chunk plus its base64 and header, and
the server puts the pieces together and loads them bit for bit. A push missing a piece or
repeating one is refused naming the tensor, with nothing loaded; a server whose limit on weight
bodies is below the push's chunks is refused before anything is sent, naming the flag to raise.
And (slow) a run on SmolLM2 trains over `http` as it does in process."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import make_model, make_tokenizer

from tidal.adapters.async_engine import AsyncEngine
from tidal.adapters.client import (
    DEFAULT_CHUNK_BYTES,
    WEIGHTS_CONTENT_TYPE,
    EngineClient,
    body_bytes,
    decode_tensors,
    encode_tensors,
)
from tidal.aio import LoopThread
from tidal.engine.llm_engine import LLMEngine
from tidal.engine.weights import model_checksum
from tidal.server.app import BackgroundServer, build_app
from tidal.server.options import ServerConfig
from tidal.sync.base import SyncError
from tidal.sync.remote import HttpSync

EMBED = "model.embed_tokens.weight"  # 320 x 64 fp32 in the tiny model: 81,920 bytes
CHUNK = 20_000  # bytes of tensors a request: the embedding in 5 pieces, each MLP matrix (32 KiB) in 2
LIMIT = 32 * 2**10  # the server's limit on a weight body: a 20,000-byte chunk fits, the embedding whole does not


class Trainer:
    """The trainer role's `named_weights`, over a model of the tiny family."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def named_weights(self, dtype=None):
        for name, p in self.model.named_parameters():
            yield name, p.detach()


class Served:
    """tidal's engine on the tiny model behind `tidal serve`'s app, with a weight body limit."""

    def __init__(self, limit: int) -> None:
        self.core = LLMEngine(make_model(), make_tokenizer(), dtype="float32", kv_cache_tokens=512)
        self.engine = AsyncEngine(self.core)
        app = build_app(self.engine, "tiny", ServerConfig(max_weights_body_bytes=limit))
        self.server = BackgroundServer(app).start()
        self.url = self.server.url

    def state(self) -> dict:
        """The version and checksum the server reports."""
        return httpx.get(self.url + "/get_weight_version?checksum=true", timeout=60).json()

    def post(self, blob: bytes, **options) -> httpx.Response:
        """One chunk as the trainer sends it: the blob as the body, `options` in the query string."""
        query = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in options.items()}
        kw = {"content": blob, "params": query, "headers": {"content-type": WEIGHTS_CONTENT_TYPE}}
        return httpx.post(self.url + "/update_weights_from_tensor", timeout=60, **kw)

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


@pytest.fixture
def served():
    s = Served(LIMIT)
    yield s
    s.close()


@pytest.fixture
def requests(monkeypatch) -> list[list[tuple[str, int]]]:
    """Each weight request sent: its (wire name, bytes) of every tensor or piece, and its body's bytes last."""
    sent: list[list[tuple[str, int]]] = []
    real = EngineClient.send_tensor_chunk

    async def spy(self, blob, *args, **kwargs):
        named = decode_tensors(blob)
        sent.append([(k, t.numel() * t.element_size()) for k, t in named] + [("<body>", body_bytes(blob))])
        return await real(self, blob, *args, **kwargs)

    monkeypatch.setattr(EngineClient, "send_tensor_chunk", spy)
    return sent


def make_sync(served: Served, trainer: Trainer, loop: LoopThread, delta: bool) -> HttpSync:
    return HttpSync(trainer, [EngineClient(served.url, 60)], timeout=60, chunk_bytes=CHUNK, delta=delta, loop=loop)


def check_bounded(sent: list[list[tuple[str, int]]]) -> None:
    """Every request held at most a chunk of tensors, in a body under the server's limit."""
    for request in sent:
        *tensors, (_, body) = request
        assert sum(n for _, n in tensors) <= CHUNK and body <= LIMIT, request


@pytest.mark.parametrize("transport", ["http", "delta"])
def test_a_tensor_larger_than_a_chunk_goes_in_pieces_and_loads_bit_for_bit(served, requests, transport):
    trainer = Trainer(make_model(seed=5))
    with LoopThread() as loop:
        sync = make_sync(served, trainer, loop, delta=transport == "delta")
        metrics = sync.push(1)  # the first push sends every tensor (delta too)
        assert served.state() == {"weight_version": 1, "weight_checksum": model_checksum(trainer.model)}
        assert model_checksum(served.core.model) == model_checksum(trainer.model)
        check_bounded(requests)
        names = [name for request in requests for name, _ in request[:-1]]
        assert [n for n in names if n.startswith(EMBED)] == [f"{EMBED}@{i}/320x64" for i in range(0, 20480, 5000)]
        assert metrics["sync/tensors"] == len(list(trainer.model.parameters()))

        # only the embedding changes: delta sends it alone, still in pieces, as a partial update
        with torch.no_grad():
            trainer.model.model.embed_tokens.weight.mul_(-0.5)
        requests.clear()
        metrics = sync.push(2)
        assert served.state() == {"weight_version": 2, "weight_checksum": model_checksum(trainer.model)}
        check_bounded(requests)
        if transport == "delta":
            assert metrics["sync/tensors"] == 1 and len(requests) == 5
            assert all(name.startswith(f"{EMBED}@") for request in requests for name, _ in request[:-1])
        sync.close()


def test_a_push_missing_a_piece_or_repeating_one_is_refused_naming_the_tensor(served):
    other = make_model(seed=6)
    blobs = list(encode_tensors(other.named_parameters(), CHUNK))
    # the embedding comes first: chunks 1 to 5 are its pieces of 5000 elements each
    assert [k for k, _ in decode_tensors(blobs[1])] == [f"{EMBED}@5000/320x64"]
    before = served.state()

    # chunk 2 left out: the last request names the tensor and the elements missing
    for blob in [blobs[0], *blobs[2:-1]]:
        assert served.post(blob, stage=True).status_code == 200
    r = served.post(blobs[-1], weight_version=3)
    assert r.status_code == 400 and r.json()["success"] is False
    assert r.json()["message"] == (
        f"tensors: update_weights: {EMBED} (320x64, torch.float32) is missing elements [5000, 10000) of its "
        "20480 (4 piece(s) arrived): a piece was not sent; send the whole update again"
    )
    assert served.state() == before and served.core.weight_version == 0

    # chunk 2 sent twice: refused when it comes again, and the update's staged chunks are dropped
    assert served.post(blobs[0], stage=True).status_code == 200
    assert served.post(blobs[1], stage=True).status_code == 200
    r = served.post(blobs[1], stage=True)
    assert r.status_code == 400 and r.json()["message"] == (
        f"tensors: update_weights: a piece of {EMBED} (320x64, torch.float32) at elements [5000, 10000) overlaps "
        "elements [5000, 10000), received already: every piece is sent once; send the whole update again"
    )
    for blob in blobs[2:-1]:  # a client that goes on regardless loads nothing: chunks 1 and 2 are gone
        assert served.post(blob, stage=True).status_code == 200
    r = served.post(blobs[-1], weight_version=3)
    assert r.status_code == 400 and f"{EMBED} (320x64, torch.float32) is missing elements [0, 10000)" in r.text
    assert served.state() == before and served.core.weight_version == 0

    # the whole push, once each, loads
    for blob in blobs[:-1]:
        assert served.post(blob, stage=True).status_code == 200
    assert served.post(blobs[-1], weight_version=3).status_code == 200
    assert served.state() == {"weight_version": 3, "weight_checksum": model_checksum(other)}


def test_a_chunk_streamed_without_its_length_loads_and_one_over_the_limit_is_refused(served):
    """A body sent in pieces with no Content-Length (chunked) is read up to the server's limit:
    a whole push so sent loads bit for bit, and a body that grows past the limit is a 413 naming
    the flag, with nothing loaded."""
    other = make_model(seed=7)
    blobs = list(encode_tensors(other.named_parameters(), CHUNK))

    def streamed(blob: bytes, **options) -> httpx.Response:
        query = {k: str(v).lower() for k, v in options.items()}
        pieces = (blob[i : i + 1000] for i in range(0, len(blob), 1000))  # a generator: no length to send
        headers = {"content-type": WEIGHTS_CONTENT_TYPE}
        url = served.url + "/update_weights_from_tensor"
        return httpx.post(url, content=pieces, params=query, headers=headers, timeout=60)

    too_big = blobs[0] * 2  # past the 32 KiB limit only once it has been read in part
    assert len(blobs[0]) <= LIMIT < len(too_big)
    r = streamed(too_big, stage=True)
    assert r.status_code == 413 and r.json()["error"]["message"] == (
        f"body: more than {LIMIT} bytes (tidal serve --max-weights-body-bytes)"
    )
    for blob in blobs[:-1]:
        assert streamed(blob, stage=True).status_code == 200
    assert streamed(blobs[-1], weight_version=4).status_code == 200
    assert served.state() == {"weight_version": 4, "weight_checksum": model_checksum(other)}


def test_a_server_limit_below_the_push_chunks_is_refused_before_anything_is_sent(requests):
    small = Served(16 * 2**10)  # a chunk of up to 20,000 bytes of tensors and its header does not fit
    try:
        with LoopThread() as loop:
            sync = make_sync(small, Trainer(make_model(seed=5)), loop, delta=False)
            with pytest.raises(SyncError) as err:
                sync.push(1)
            sync.close()
        msg = str(err.value)
        assert msg.startswith(f"weight sync to engine {small.url} (engine 0) over http: chunk ")
        assert "(at most 20000 bytes of tensors and their header) and the engine takes weight bodies of at most " in msg
        assert "16384 bytes: start it with `tidal serve --max-weights-body-bytes " in msg
        assert msg.endswith("` or more (nothing of this push was sent)")
        assert requests == [] and small.state()["weight_version"] == 0
    finally:
        small.close()


def test_the_default_chunk_fits_the_default_server_limit():
    (blob,) = encode_tensors([("w", torch.zeros(DEFAULT_CHUNK_BYTES // 4))])
    assert body_bytes(blob) < ServerConfig().max_weights_body_bytes


# ---------------------------------------------------------------------- SmolLM2, trained remotely
SAME = ("reward/mean", "response/length_mean", "loss/pg", "actor/tokens", "actor/skipped_samples")


@pytest.mark.slow
def test_smollm2_trains_over_http_as_in_process(smollm2_dir, tmp_path, requests):
    """Issue 48: SmolLM2's fp32 embedding (49152 x 576, 113 MB) went as one 151 MB body, over tidal
    serve's 64 MiB. Now two steps over `http` give the in-process run's metrics (the keys the Ray
    test compares, tests/cluster/test_ray.py), every push checked by the server's checksum."""
    import tidal.loop
    from tidal.config import build_config
    from tidal.convert import load_tokenizer

    values = {
        "train.model": str(smollm2_dir),
        "train.num_steps": 2,
        "train.dtype": "float32",
        "engine.dtype": "float32",
        "rollout.rollout_batch_size": 2,
        "rollout.n_samples_per_prompt": 4,
        "rollout.max_new_tokens": 16,
        "reward.fn": "conftest:token_sum_parity_reward",
        "train.global_batch_size": 8,
        "train.micro_batch_size": 4,
        "train.lr": 1e-5,
        "log.tensorboard": False,
        "log.console": False,
    }
    local = tidal.loop.train(build_config(None, {**values, "train.output_dir": str(tmp_path / "local")}))
    core = LLMEngine(smollm2_dir, load_tokenizer(smollm2_dir), dtype="float32", kv_cache_tokens=4096)
    engine = AsyncEngine(core)
    server = BackgroundServer(build_app(engine, "smollm2")).start()  # tidal serve's default limits
    try:
        over = {"engine.kind": "remote", "engine.urls": [server.url], "cluster.weight_sync": "http"}
        remote = tidal.loop.train(build_config(None, {**values, **over, "train.output_dir": str(tmp_path / "remote")}))
    finally:
        server.stop()
        engine.close()
    assert [h["step"] for h in remote] == [1, 2] and core.weight_version == 2
    assert any(h["actor/grad_norm"] > 0 for h in local)  # a step moved the weights: step 2 samples pushed ones
    for got, want in zip(remote, local, strict=True):
        for key in SAME:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-4)
    # the embedding went in pieces of at most a chunk, every body under the default limit
    limit = ServerConfig().max_weights_body_bytes
    assert max(request[-1][1] for request in requests) < limit
    assert all(sum(n for _, n in request[:-1]) <= DEFAULT_CHUNK_BYTES for request in requests)
    pieces = {name for request in requests for name, _ in request[:-1] if name.startswith(EMBED + "@")}
    assert pieces == {f"{EMBED}@{i}/49152x576" for i in range(0, 49152 * 576, DEFAULT_CHUNK_BYTES // 4)}
