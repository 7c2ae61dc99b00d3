"""`tidal serve` against hostile or careless clients (issue 25): streams abandoned mid-answer,
huge texts under the body limit, `n` on `/generate`, out-of-vocabulary logit biases and
non-finite weights. Each test drives a real server on 127.0.0.1 (the tiny fp32 model, byte
tokenizer) as such a client would, and waits on conditions, never on timing."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from conftest import make_model, make_tokenizer

from tidal.config import ServerConfig
from tidal.engine.async_engine import AsyncEngine
from tidal.engine.llm_engine import LLMEngine
from tidal.server import BackgroundServer, build_app

USER = [{"role": "user", "content": "hi"}]
DEADLINE_S = 300.0  # generous: these machines are shared and slow; a passing run takes a second or two


class RecordingEngine(LLMEngine):
    """The tiny engine, recording how each request ended: (finish reason, tokens generated)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.ended: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def _finish(self, seq, reason):
        out = super()._finish(seq, reason)
        with self.lock:
            self.ended.append((reason, len(out.token_ids)))
        return out


class Served:
    """A real server on a free 127.0.0.1 port over the tiny engine."""

    def __init__(self, config: ServerConfig | None = None, context: int = 512, **kw) -> None:
        self.tokenizer = make_tokenizer()
        model = make_model(vocab_size=259, seed=0, max_position_embeddings=context)
        self.core = RecordingEngine(model, self.tokenizer, dtype="float32", block_size=4, **kw)
        self.engine = AsyncEngine(self.core)
        self.server = BackgroundServer(build_app(self.engine, "tiny", config)).start()
        self.url = self.server.url

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


def wait_for(cond, what: str, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"{what}: not reached within {deadline_s:g} s"
        time.sleep(0.02)


# ---------------------------------------------------------------------- abandoned streams
MAX_NEW = 2000
STREAMS = {  # route -> a streamed request that would decode MAX_NEW tokens (the end-of-turn token banned)
    "/generate": {"input_ids": [5, 9, 33], "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True}},
    "/v1/completions": {"prompt": "abc", "max_tokens": MAX_NEW, "logit_bias": {"2": -100}},
    "/v1/chat/completions": {"messages": USER, "max_tokens": MAX_NEW, "logit_bias": {"2": -100}},
}


@pytest.mark.parametrize("route", list(STREAMS))
def test_a_stream_the_client_leaves_is_aborted(route):
    """Clients open streams, read a few events and leave: every one of their requests is aborted
    (the probe saw 11,950 of 12,000 such tokens decoded anyway)."""
    clients = 4
    s = Served(context=4096)
    try:

        def leave_early(_: int) -> int:
            with httpx.Client(timeout=120) as http:
                with http.stream("POST", s.url + route, json={**STREAMS[route], "stream": True}) as r:
                    assert r.status_code == 200
                    events = 0
                    for line in r.iter_lines():
                        events += line.startswith("data: ")
                        if events == 3:
                            return events
            return events

        with ThreadPoolExecutor(clients) as pool:
            assert list(pool.map(leave_early, range(clients))) == [3] * clients
        wait_for(lambda: len(s.core.ended) == clients, "every abandoned request ended")
        assert s.engine.load() == 0
        reasons = [reason for reason, _ in s.core.ended]
        assert reasons == ["abort"] * clients, s.core.ended
        assert all(n < MAX_NEW for _, n in s.core.ended), s.core.ended
    finally:
        s.close()


# ---------------------------------------------------------------------- /generate n, logit_bias
@pytest.fixture
def served():
    s = Served()
    yield s
    s.close()


def generate(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def test_generate_honours_n_as_sglang_does(served):
    """`sampling_params.n` was silently ignored: one sample came back for n = 3."""
    sp = {"max_new_tokens": 6, "seed": 7, "n": 3}
    r = generate(served.url, {"input_ids": [5, 9, 33], "sampling_params": sp, "rid": "x"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 3
    assert [o["meta_info"]["id"] for o in out] == ["x_0", "x_1", "x_2"]
    # sample j is the request with seed 7 + j: reproducible, and the samples differ
    for j, o in enumerate(out):
        one = generate(served.url, {"input_ids": [5, 9, 33], "sampling_params": {"max_new_tokens": 6, "seed": 7 + j}})
        assert one.json()["output_ids"] == o["output_ids"]
    assert len({tuple(o["output_ids"]) for o in out}) > 1
    # a batch: n samples of each prompt, prompt-major
    batch = generate(served.url, {"input_ids": [[5, 9, 33], [40, 41]], "sampling_params": {**sp, "n": 2}}).json()
    assert len(batch) == 4
    assert [o["output_ids"] for o in batch[:2]] == [o["output_ids"] for o in out[:2]]
    alone = generate(served.url, {"input_ids": [40, 41], "sampling_params": {"max_new_tokens": 6, "seed": 7}}).json()
    assert batch[2]["output_ids"] == alone["output_ids"]


@pytest.mark.parametrize(
    ("sampling_params", "message"),
    [
        ({"n": 0}, "sampling_params.n: must be between 1 and 16 on this server, got 0"),
        ({"n": 17}, "sampling_params.n: must be between 1 and 16 on this server, got 17"),
        ([{"n": 1}, {"n": 2}], "sampling_params.n: must be the same for every prompt, got [1, 2]"),
    ],
)
def test_generate_refuses_a_bad_n_naming_the_field(served, sampling_params, message):
    r = generate(served.url, {"input_ids": [[5, 9], [33]], "sampling_params": sampling_params})
    assert r.status_code == 400 and r.json()["error"]["message"] == message
    assert r.json()["error"]["param"] == "sampling_params.n"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("token", [259, 10**9])
def test_logit_bias_outside_the_vocabulary_is_refused(served, route, token):
    """A bias on an id the model has no logit for did nothing, silently."""
    body = {"prompt": "abc"} if route == "/v1/completions" else {"messages": USER}
    r = httpx.post(f"{served.url}{route}", json={**body, "max_tokens": 2, "logit_bias": {str(token): 5}}, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        f"logit_bias: token id {token} is outside the vocabulary; this model's ids are 0 to 258"
    )
    assert r.json()["error"]["param"] == "logit_bias"
    ok = httpx.post(f"{served.url}{route}", json={**body, "max_tokens": 2, "logit_bias": {"258": 5}}, timeout=120)
    assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------------- non-finite weights
def greedy_ids(url: str) -> list[int]:
    body = {"input_ids": [5, 9, 33], "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    return generate(url, body).json()["output_ids"]


def served_weights(url: str) -> dict:
    return httpx.get(f"{url}/get_weight_version", params={"checksum": "true"}, timeout=120).json()


def test_non_finite_weights_are_refused_and_the_served_weights_kept(served, tmp_path):
    """All-NaN weights from disk were loaded and served garbage; so were infinities by tensor."""
    from safetensors.torch import save_file

    from tidal.engine.client import encode_tensors

    before, weights = greedy_ids(served.url), served_weights(served.url)
    state = {k: v.detach().clone() for k, v in make_model(vocab_size=259, seed=1).state_dict().items()}
    state.pop("lm_head.weight")  # tied to the embedding
    nan = tmp_path / "nan"
    nan.mkdir()
    save_file({k: torch.full_like(v, float("nan")) for k, v in state.items()}, nan / "model.safetensors")
    r = httpx.post(f"{served.url}/update_weights_from_disk", json={"model_path": str(nan), "weight_version": 3})
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    message = r.json()["error"]["message"]
    # every value is NaN: the count is the tensor's size
    found = re.fullmatch(
        rf"model_path: cannot load {re.escape(str(nan))}: update_weights: (\S+) holds (\d+) NaN or infinite "
        r"value\(s\) of (\d+); weights must be finite",
        message,
    )
    assert found and found[1] in state and int(found[2]) == int(found[3]) == state[found[1]].numel(), message

    one_inf = dict(state)
    one_inf["model.norm.weight"] = state["model.norm.weight"].clone()
    one_inf["model.norm.weight"][7] = float("inf")
    (blob,) = encode_tensors(one_inf.items())
    r = httpx.post(f"{served.url}/update_weights_from_tensor", json={"tensors": blob, "weight_version": 4}, timeout=120)
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert r.json()["error"]["message"] == (
        "tensors: update_weights: model.norm.weight holds 1 NaN or infinite value(s) of 64; weights must be finite"
    )
    # a chunk staged for a later update is checked as it arrives
    (chunk,) = encode_tensors([("model.norm.weight", one_inf["model.norm.weight"])])
    r = httpx.post(f"{served.url}/update_weights_from_tensor", json={"tensors": chunk, "stage": True}, timeout=120)
    assert r.status_code == 400 and "model.norm.weight holds 1 NaN or infinite value(s)" in r.text

    assert served_weights(served.url) == weights  # same version, same bytes
    assert greedy_ids(served.url) == before
    # the same weights, finite, load
    (blob,) = encode_tensors(state.items())
    r = httpx.post(f"{served.url}/update_weights_from_tensor", json={"tensors": blob, "weight_version": 5}, timeout=120)
    assert r.status_code == 200 and served_weights(served.url)["weight_version"] == 5


def test_non_finite_counts_exactly_even_when_a_finite_sum_overflows():
    from tidal.engine.weights import non_finite

    t = torch.randn(300, 200)
    assert non_finite(t) == 0
    t[3, 4], t[5, 6], t[7, 8] = float("nan"), float("inf"), float("-inf")
    assert non_finite(t) == 3 and non_finite(t.T) == 3 and non_finite(t.to(torch.bfloat16)) == 3
    assert non_finite(torch.full((10,), 3e38)) == 0  # its float32 sum overflows; every value is finite
    assert non_finite(torch.full((10,), 6e4, dtype=torch.float16)) == 0
    assert non_finite(torch.arange(5)) == 0
