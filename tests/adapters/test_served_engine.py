"""The real LLMEngine behind the HTTP server (tiny fp32 model): exact tokens over HTTP, weight
updates, abort, pause/continue, bad requests, and a training loop against remote servers."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from conftest import hf_greedy, run_batch, shared_loop
from conftest import make_model as _make_model

from tidal.adapters.async_engine import AsyncEngine
from tidal.adapters.client import HttpEngine
from tidal.contracts import SamplingParams
from tidal.engine.llm_engine import LLMEngine
from tidal.server.app import BackgroundServer, build_app

PROMPTS = [[5, 9, 33, 70], [12, 40, 41, 42, 43, 44, 45, 46, 47], [5, 9, 33, 70], [100]]


def make_model(seed=0):
    return _make_model(seed=seed, tie_word_embeddings=False)


class Served:
    def __init__(self, model, tokenizer=None, **kw) -> None:
        kw.setdefault("block_size", 4)
        self.core = LLMEngine(model, tokenizer, dtype="float32", **kw)
        self.engine = AsyncEngine(self.core)
        self.server = BackgroundServer(build_app(self.engine, "tiny")).start()
        self.url = self.server.url

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


@pytest.fixture
def served():
    s = Served(make_model())
    yield s
    s.close()


def test_greedy_over_http_equals_transformers(served):
    ref = make_model()
    remote = HttpEngine([served.url], timeout=60)
    outs = run_batch(remote, PROMPTS, [SamplingParams(temperature=0.0, max_new_tokens=8) for _ in PROMPTS])
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.token_ids == hf_greedy(ref, p, 8)
        with torch.no_grad():
            logits = ref(torch.tensor([p + o.token_ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[len(p) - 1 : -1].gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(o.log_probs), lp, atol=1e-4, rtol=0)


def test_weight_update_over_http_switches_to_the_new_model(served):
    other = make_model(seed=1)
    remote = HttpEngine([served.url], timeout=60)
    client = remote.router.clients[0]
    shared_loop().run(client.update_weights_from_tensors(other.state_dict().items(), version=7), 60)
    assert shared_loop().run(remote.get_weight_versions(), 60) == [7]
    (out,) = run_batch(remote, [PROMPTS[1]], [SamplingParams(temperature=0.0, max_new_tokens=8)])
    assert out.token_ids == hf_greedy(other, PROMPTS[1], 8)
    assert out.weight_version == 7


def test_abort_pause_and_continue_over_http(served):
    url = served.url
    results = {}

    def post(name, body):
        results[name] = httpx.post(f"{url}/generate", json=body, timeout=60).json()

    long = {"input_ids": PROMPTS[1], "sampling_params": {"temperature": 0, "max_new_tokens": 400}, "rid": "long"}
    long["return_logprob"] = True
    t = threading.Thread(target=post, args=("long", long))
    t.start()
    deadline = time.monotonic() + 30
    while served.core.stats()["steps"] < 5:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert httpx.post(f"{url}/abort_request", json={"rid": "long"}).json()["aborted"] == ["long"]
    t.join(30)
    meta = results["long"]["meta_info"]
    n = meta["completion_tokens"]
    assert meta["finish_reason"]["type"] == "abort" and 1 <= n < 400
    assert results["long"]["output_ids"] == hf_greedy(make_model(), PROMPTS[1], n)  # the partial greedy prefix
    assert len(meta["output_token_logprobs"]) == n

    assert httpx.post(f"{url}/pause_generation", json={}).status_code == 200
    steps = served.core.stats()["steps"]
    short = {"input_ids": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    t = threading.Thread(target=post, args=("short", short))
    t.start()
    deadline = time.monotonic() + 30
    while served.core.stats()["waiting"] == 0:  # the request has reached the engine...
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.005)
    time.sleep(0.3)
    assert served.core.stats()["steps"] == steps and t.is_alive()  # ...and is held while paused
    assert httpx.post(f"{url}/continue_generation").status_code == 200
    t.join(30)
    assert results["short"]["output_ids"] == hf_greedy(make_model(), PROMPTS[0], 6)


def test_bad_requests_are_400_and_the_engine_keeps_serving(served, caplog):
    url = served.url
    too_long = {"input_ids": [7] * 597, "sampling_params": {"max_new_tokens": 4}}
    r = httpx.post(f"{url}/generate", json=too_long)
    assert r.status_code == 400 and "the prompt has 597 tokens; the context holds 512" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": -1}})
    assert r.status_code == 400 and "max_new_tokens" in r.json()["error"]["message"]
    # an unknown field is ignored with a warning, as OpenAI-compatible servers do
    with caplog.at_level("WARNING", logger="tidal.server"):
        r = httpx.post(f"{url}/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}, "zzz": 1})
    assert r.status_code == 200 and "/generate: ignoring unknown field 'zzz'" in caplog.text
    ok = {"input_ids": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    assert httpx.post(f"{url}/generate", json=ok).json()["output_ids"] == hf_greedy(make_model(), PROMPTS[0], 3)


def test_training_loop_against_two_remote_servers(tiny_model_dir, tmp_path, tokenizer):
    """engine.kind remote: rollouts come from HTTP servers and every step's weights reach both."""
    from test_loop import config
    from transformers import AutoModelForCausalLM

    import tidal.loop

    a, b = (Served(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tokenizer, block_size=16) for _ in range(2))
    try:
        over = {"engine.kind": "remote", "engine.urls": [a.url, b.url], "train.num_steps": 2}
        history = tidal.loop.train(config(tiny_model_dir, tmp_path, **over))
        assert [h["step"] for h in history] == [1, 2]
        assert a.core.weight_version == b.core.weight_version == 2
        assert a.core.stats()["steps"] > 0 and b.core.stats()["steps"] > 0  # the router used both
    finally:
        a.close()
        b.close()
