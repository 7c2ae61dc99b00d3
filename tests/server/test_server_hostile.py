"""`tidal serve` against hostile or careless clients (issue 25): streams abandoned mid-answer,
huge texts under the body limit, `n` on `/generate`, out-of-vocabulary logit biases and
non-finite weights. Each test drives a real server on 127.0.0.1 (the tiny fp32 model, byte
tokenizer) as such a client would, and waits on conditions, never on timing."""

from __future__ import annotations

import base64
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from conftest import make_model, make_tokenizer, start_serve

from tidal.adapters.async_engine import AsyncEngine
from tidal.engine.llm_engine import LLMEngine
from tidal.server.app import BackgroundServer, build_app
from tidal.server.options import ServerConfig

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
def b64(blob: bytes) -> str:
    """A chunk as a JSON body's `tensors` take it (the form for clients that only send JSON)."""
    return base64.b64encode(blob).decode("ascii")


def greedy_ids(url: str) -> list[int]:
    body = {"input_ids": [5, 9, 33], "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    return generate(url, body).json()["output_ids"]


def served_weights(url: str) -> dict:
    return httpx.get(f"{url}/get_weight_version", params={"checksum": "true"}, timeout=120).json()


def test_non_finite_weights_are_refused_and_the_served_weights_kept(served, tmp_path):
    """All-NaN weights from disk were loaded and served garbage; so were infinities by tensor."""
    from safetensors.torch import save_file

    from tidal.adapters.client import encode_tensors

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
    body = {"tensors": b64(blob), "weight_version": 4}
    r = httpx.post(f"{served.url}/update_weights_from_tensor", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert r.json()["error"]["message"] == (
        "tensors: update_weights: model.norm.weight holds 1 NaN or infinite value(s) of 64; weights must be finite"
    )
    # a chunk staged for a later update is checked as it arrives
    (chunk,) = encode_tensors([("model.norm.weight", one_inf["model.norm.weight"])])
    r = httpx.post(f"{served.url}/update_weights_from_tensor", json={"tensors": b64(chunk), "stage": True}, timeout=120)
    assert r.status_code == 400 and "model.norm.weight holds 1 NaN or infinite value(s)" in r.text

    assert served_weights(served.url) == weights  # same version, same bytes
    assert greedy_ids(served.url) == before
    # the same weights, finite, load
    (blob,) = encode_tensors(state.items())
    body = {"tensors": b64(blob), "weight_version": 5}
    r = httpx.post(f"{served.url}/update_weights_from_tensor", json=body, timeout=120)
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


# ---------------------------------------------------------------------- huge texts
TOKEN_BYTES = 13  # the byte tokenizer's longest token: "<|endoftext|>", one token of 13 bytes


def test_a_text_too_long_to_fit_is_refused_unread_and_the_bound_is_exact(served):
    """No token spells more than 13 bytes here, so a text of more than 13 x 511 bytes cannot be a
    prompt of the 512-token context: refused before tokenising. A text of exactly 13 x 511 bytes
    may still fit (511 of the 13-byte tokens), so it is tokenised and served."""
    assert served.engine.max_model_len == 512
    fits = "<|endoftext|>" * 511
    body = {"sampling_params": {"max_new_tokens": 1}}
    r = generate(served.url, {"text": fits, **body})
    assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] == 511, r.text
    r = generate(served.url, {"text": fits + "a", **body})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        f"text: {13 * 511 + 1} bytes; a prompt here is at most 511 tokens (the context less one new token) and no "
        f"token of this model spells more than 13 bytes, so a text of at most {13 * 511} bytes"
    )
    r = generate(served.url, {"text": ["hi", fits + "a"], **body})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"text[1]: {13 * 511 + 1} bytes;")


def test_text_tokenised_at_once_is_bounded_server_wide():
    """While one request's text is being tokenised, another that would take the server over its
    budget for text tokenised at once is answered 503 (and may retry), not queued; the budget is
    the server's, not a route's. The first text is held inside the tokenizer, so nothing depends
    on timing."""
    cfg = ServerConfig(max_tokenising_bytes=300_000, max_request_tokens=10**8)
    s = Served(cfg, max_model_len=100_000)
    inside, release = threading.Event(), threading.Event()
    encode = s.tokenizer.encode

    def held_encode(text, *args, **kwargs):
        if len(text) >= 200_000:
            inside.set()
            release.wait(DEADLINE_S)
        return encode(text, *args, **kwargs)

    s.tokenizer.encode = held_encode
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(generate, s.url, {"text": "a" * 200_000})
            assert inside.wait(DEADLINE_S), "the first text never reached the tokenizer"
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "b" * 150_000}, timeout=120)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"] == {
                "message": "prompt: 150000 bytes to tokenise, but 200000 of this server's 300000 bytes for "
                "tokenising at once are in use; retry shortly",
                "type": "server_busy",
                "param": "prompt",
                "code": 503,
            }
            small = generate(s.url, {"text": "c" * 1000, "sampling_params": {"max_new_tokens": 1}})
            assert small.status_code == 200, small.text  # within what is left
            assert not first.done()
            release.set()
            assert first.result().status_code == 400  # 200,000 tokens: more than the context
        # the budget is free again once the first request is done
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "b" * 150_000}, timeout=120)
        assert r.status_code == 400 and "the prompt is 150000 tokens" in r.text
        r = generate(s.url, {"text": "d" * 300_001})  # more than the whole budget: never
        assert r.status_code == 413 and r.json()["error"]["message"] == (
            "text: 300001 bytes; this server tokenises at most 300000 bytes at once"
        )
    finally:
        release.set()
        s.close()


class ServeProcess:
    """`tidal serve` in a subprocess on 127.0.0.1, its address space capped (so a regression fails
    the test instead of exhausting the machine), and its peak RSS readable."""

    def __init__(self, model_dir, log, *options: str, headroom_gb: float = 4.0) -> None:
        import resource

        self.log = log
        self.proc, self.url = start_serve([str(model_dir), "--dtype", "float32", *options], log)
        wait_for(self._healthy, "tidal serve answers /health")
        cap = self.status("VmSize") + int(headroom_gb * 2**30)
        resource.prlimit(self.proc.pid, resource.RLIMIT_AS, (cap, cap))
        assert generate(self.url, {"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
        with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS: what follows is measured from here
        self.base = self.status("VmHWM")

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, f"tidal serve exited: {self.log.read_text()[-3000:]}"
        try:
            return httpx.get(f"{self.url}/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def status(self, key: str) -> int:
        """A /proc/PID/status size in bytes (VmSize, VmRSS, VmHWM: the peak RSS)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            line = next(x for x in f if x.startswith(key + ":"))
        return int(line.split()[1]) * 1024

    def peak_growth(self) -> int:
        assert self.proc.poll() is None, f"tidal serve died: {self.log.read_text()[-3000:]}"
        return self.status("VmHWM") - self.base

    def post_concurrently(self, route: str, body: dict, clients: int) -> list[httpx.Response]:
        import json

        payload = json.dumps(body).encode()

        def post(_: int) -> httpx.Response:
            headers = {"content-type": "application/json"}
            return httpx.post(self.url + route, content=payload, headers=headers, timeout=DEADLINE_S)

        with ThreadPoolExecutor(clients) as pool:
            return list(pool.map(post, range(clients)))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def big_bodies(size: int) -> dict[str, tuple[str, dict]]:
    """route -> (the field named in a refusal, a body whose one text is `size` bytes)."""
    text = "ab" * (size // 2)
    return {
        "/generate": ("text", {"text": text}),
        "/v1/completions": ("prompt", {"prompt": text}),
        "/v1/chat/completions": ("messages", {"messages": [{"role": "user", "content": text}]}),
    }


def test_the_probe_huge_texts_are_refused_unread_and_memory_stays_flat(tiny_model_dir, tmp_path):
    """The probe: six 7.8 MB texts at once (under the 8 MiB body limit) took the server from
    0.4 to 8.1 GB RSS while tokenised whole, then refused. Now each is refused before tokenising;
    the server's peak RSS grows by the bodies only (66 MB measured; 512 MB allowed)."""
    s = ServeProcess(tiny_model_dir, tmp_path / "serve.log")
    try:
        for route, (field, body) in big_bodies(7_800_000).items():
            for r in s.post_concurrently(route, body, 6 if route == "/generate" else 3):
                assert r.status_code == 400, r.text[:300]
                message = r.json()["error"]["message"]
                assert re.match(rf"{field}: 78000\d\d bytes; a prompt here is at most 511 tokens", message), message
            assert s.peak_growth() < 512 * 2**20, f"{route}: peak RSS grew {s.peak_growth() / 2**20:.0f} MB"
    finally:
        s.close()


def test_texts_that_may_fit_are_tokenised_within_the_budget(tiny_model_dir, tmp_path):
    """Texts the size check cannot refuse (a context of 4M tokens) are tokenised at most 2.1 MB at
    a time: four 2 MB texts at once grow the peak RSS by one encoding (~0.5 GB measured, 1.2 GB
    allowed; unbounded, six such texts took 2.3-2.7 GB and kept 1.8 GB)."""
    options = ["--max-model-len", "4000000", "--max-request-tokens", "100000000", "--max-tokenising-bytes", "2100000"]
    s = ServeProcess(tiny_model_dir, tmp_path / "serve.log", *options)
    try:
        field, body = big_bodies(2_000_000)["/generate"]
        for r in s.post_concurrently("/generate", body, 4):
            assert r.status_code in (400, 503), r.text[:300]
            message = r.json()["error"]["message"]
            if r.status_code == 503:  # another text held the budget
                assert message.startswith(f"{field}: 2000000 bytes to tokenise, but 2000000 of this server's"), message
            else:  # tokenised, then too long for the KV cache
                assert "tokens cannot fit in the KV cache" in message, message
        assert s.peak_growth() < 1.2 * 2**30, f"peak RSS grew {s.peak_growth() / 2**20:.0f} MB"
        # and the tokenizer's scratch went back to the OS
        assert s.status("VmRSS") - s.base < 1.2 * 2**30
    finally:
        s.close()


# ---------------------------------------------------------------------- issue 48: weight versions
def model_state(seed: int) -> dict[str, torch.Tensor]:
    """The tiny model's weights (seed 0: the served ones), as a trainer would send them."""
    state = {k: v.detach().clone() for k, v in make_model(vocab_size=259, seed=seed).state_dict().items()}
    state.pop("lm_head.weight")  # tied to the embedding
    return state


def blob(named: dict[str, torch.Tensor]) -> str:
    """`named` in one chunk, as base64 for a JSON body's `tensors`."""
    from tidal.adapters.client import encode_tensors

    (one,) = encode_tensors(named.items())
    return b64(one)


def push(url: str, named: dict[str, torch.Tensor], version: int | None, **fields) -> httpx.Response:
    body = {"tensors": blob(named), "weight_version": version, **fields}
    return httpx.post(f"{url}/update_weights_from_tensor", json=body, timeout=120)


def refused(message: str, status: int = 400, param: str | None = "weight_version") -> dict:
    """A weight route's refusal: the one error shape plus SGLang's `success` and `message`."""
    kind = "invalid_request_error" if status == 400 else "engine_unavailable"
    error = {"message": message, "type": kind, "param": param, "code": status}
    return {"error": error, "success": False, "message": message}


def older(value: int, held: int) -> str:
    return (
        f"weight_version: {value} is older than the weights this engine holds (version {held}); a trainer "
        "that restarted sends allow_older: true to go back"
    )


def test_a_weight_version_below_zero_or_older_than_the_held_one_is_refused(served, tmp_path):
    """Issue 48 (3): `weight_version: -7` on a partial update was loaded, and every generate then
    answered 500 "the engine holds no weights" while /health said ok; -1 from disk the same; 10 -> 3
    went back silently. Now each is refused, naming the value and the version held, and nothing
    changes; going back takes `allow_older: true` (a trainer that restarted)."""
    from safetensors.torch import save_file

    state = model_state(1)
    assert push(served.url, state, 10).status_code == 200
    before, weights = greedy_ids(served.url), served_weights(served.url)
    assert weights["weight_version"] == 10
    norm = {"model.norm.weight": state["model.norm.weight"] * 2}
    folder = tmp_path / "w"
    folder.mkdir()
    save_file(state, folder / "model.safetensors")
    tensor, disk = f"{served.url}/update_weights_from_tensor", f"{served.url}/update_weights_from_disk"
    refusals = [
        (
            tensor,
            {"tensors": blob(norm), "partial": True, "weight_version": -7},
            "weight_version: must be an int >= 0, got -7",
        ),
        (disk, {"model_path": str(folder), "weight_version": "-1"}, "weight_version: must be an int >= 0, got -1"),
        (disk, {"model_path": str(folder), "weight_version": "ten"}, "weight_version: must be an int >= 0, got 'ten'"),
        (tensor, {"tensors": blob(norm), "partial": True, "weight_version": 3}, older(3, 10)),
        (disk, {"model_path": str(folder), "weight_version": 9}, older(9, 10)),
    ]
    for url, body, message in refusals:
        r = httpx.post(url, json=body, timeout=120)
        assert (r.status_code, r.json()) == (400, refused(message)), (body, r.text)
        assert served_weights(served.url) == weights  # same version, same bytes
    assert greedy_ids(served.url) == before

    # a chunk staged before a refused last call is dropped with it: all or nothing
    assert push(served.url, norm, None, stage=True).status_code == 200
    assert push(served.url, norm, 2).json() == refused(older(2, 10))
    rest = {k: v for k, v in state.items() if k != "model.norm.weight"}
    r = push(served.url, rest, 11)
    assert r.status_code == 400 and "model.norm.weight" in r.json()["message"], r.text
    assert served_weights(served.url) == weights

    # what a trainer sends: the version held again, a newer one, and after a restart an older one
    assert push(served.url, norm, 10, partial=True).status_code == 200
    assert push(served.url, norm, 12, partial=True).json()["weight_version"] == 12
    r = push(served.url, state, 3, allow_older=True)
    assert r.status_code == 200 and served_weights(served.url)["weight_version"] == 3
    r = httpx.post(disk, json={"model_path": str(folder), "weight_version": "1", "allow_older": True}, timeout=120)
    assert r.status_code == 200 and served_weights(served.url) == {**weights, "weight_version": 1}
    assert greedy_ids(served.url) == before


# ---------------------------------------------------------------------- issue 48: engine state
ASLEEP = "the engine is asleep (its memory is released): POST /resume_memory_occupation first, then send weights"
NO_WEIGHTS = (
    "the engine holds no weights (it was woken and none were sent since): send weights first "
    "(POST /update_weights_from_tensor, /update_weights_from_disk or /update_weights_from_distributed)"
)
GREEDY = {"input_ids": [5, 9, 33], "sampling_params": {"temperature": 0, "max_new_tokens": 6}}


def unavailable(message: str) -> dict:
    return {"error": {"message": message, "type": "engine_unavailable", "param": None, "code": 503}}


def test_an_engine_that_cannot_generate_answers_503_and_keeps_the_connection(served, tmp_path):
    """Issue 48 (4): asleep, or woken with no weights, a generate escaped as an unhandled
    exception (a traceback, the keep-alive connection closed under the client, whose next request
    on it failed with ReadError), and a weight update while asleep was refused with a shape error.
    Now every route answers 503 saying what to do, and one connection carries every request."""
    from safetensors.torch import save_file

    state = model_state(0)  # the served weights
    folder = tmp_path / "w"
    folder.mkdir()
    save_file(state, folder / "model.safetensors")
    before = greedy_ids(served.url)
    streams = []  # each answer's connection (held, so no two can share an id)
    with httpx.Client(base_url=served.url, timeout=120) as http:

        def post(path: str, body: dict) -> httpx.Response:
            r = http.post(path, json=body)
            streams.append(r.extensions["network_stream"])
            return r

        assert post("/release_memory_occupation", {}).status_code == 200
        for path, body in [
            ("/generate", GREEDY),
            ("/generate", {**GREEDY, "stream": True}),
            ("/v1/completions", {"prompt": "abc", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "stream": True}),
        ]:
            r = post(path, body)
            assert (r.status_code, r.json()) == (503, unavailable(ASLEEP)), (path, r.text)
        r = post("/v1/messages", {"max_tokens": 2, "messages": USER})
        assert (r.status_code, r.json()) == (
            503,
            {"type": "error", "error": {"type": "overloaded_error", "message": ASLEEP}},
        )
        r = post("/update_weights_from_tensor", {"tensors": blob(state), "weight_version": 1})
        assert (r.status_code, r.json()) == (503, refused(ASLEEP, 503, None))
        r = post("/update_weights_from_disk", {"model_path": str(folder), "weight_version": 1})
        assert (r.status_code, r.json()) == (503, refused(ASLEEP, 503, None))
        assert served.engine.weight_version == 0

        assert post("/resume_memory_occupation", {}).status_code == 200
        r = post("/generate", GREEDY)
        assert (r.status_code, r.json()) == (503, unavailable(NO_WEIGHTS))
        assert post("/update_weights_from_tensor", {"tensors": blob(state), "weight_version": 1}).status_code == 200
        r = post("/generate", GREEDY)
        assert r.status_code == 200 and r.json()["output_ids"] == before
    assert all(x is streams[0] for x in streams)  # every answer came on the one connection


CLOSED = "the engine is closed: this server cannot serve any more; restart it"


def test_a_request_waiting_on_a_paused_engine_that_closes_answers_503(served):
    """Issue 48 (4): paused, then closed: the waiting request escaped as an unhandled EngineClosed
    (500, the connection closed after it)."""
    with httpx.Client(base_url=served.url, timeout=120) as http:
        assert http.post("/pause_generation", json={}).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(http.post, "/generate", json=GREEDY)
            wait_for(lambda: served.engine.load() == 1, "the request waits on the paused engine")
            served.engine.close()
            r = waiting.result()
        assert (r.status_code, r.json()) == (503, unavailable(CLOSED))
        after = http.get("/health")  # the same client, the connection kept
        assert after.status_code == 503 and after.extensions["network_stream"] is r.extensions["network_stream"]


def test_the_clients_read_the_503_of_an_asleep_engine(served):
    import anthropic
    import openai

    assert httpx.post(f"{served.url}/release_memory_occupation", timeout=120).status_code == 200
    oa = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        oa.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert err.value.status_code == 503 and err.value.body == unavailable(ASLEEP)["error"]
    an = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as err:
        an.messages.create(model="tiny", max_tokens=2, messages=USER)
    assert err.value.status_code == 503 and err.value.body["error"]["message"] == ASLEEP


# ---------------------------------------------------------------------- issue 48: tool calls, tool_choice, stop ids
@pytest.fixture
def roomy():
    """A server with room for a chat with tools (their description alone is ~450 byte tokens)."""
    s = Served(context=2048)
    yield s
    s.close()


ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}


def called_with(arguments) -> list[dict]:
    """A chat whose assistant turn called `add` with these arguments."""
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}
    return [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ("{not json", "it is not JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
        ("[1, 2]", "it holds a JSON array"),
        ('"x"', "it holds a JSON string"),
        (7, "it is a JSON number, not a string"),
    ],
)
def test_tool_call_arguments_not_a_json_object_are_refused_naming_the_field(roomy, arguments, said):
    """Issue 48 (9): `"{not json"` was answered with the bare parser message, and `param` held
    that message instead of the field."""
    import openai

    client = openai.OpenAI(base_url=roomy.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=called_with(arguments), tools=[ADD], max_tokens=2)
    field = "messages[1].tool_calls[0].function.arguments"
    message = f"{field}: must be a JSON object in a string, as the model would write it (e.g. '{{\"a\": 1}}'); {said}"
    assert err.value.body == {"message": message, "type": "invalid_request_error", "param": field, "code": 400}
    # the same call with an object for arguments is served
    out = client.chat.completions.create(model="tiny", messages=called_with('{"a": 1}'), tools=[ADD], max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_anthropic_tool_use_input_not_an_object_is_refused_naming_the_field(served):
    use = {"type": "tool_use", "id": "t1", "name": "add", "input": "{not json"}
    body = {"max_tokens": 2, "messages": [*USER, {"role": "assistant", "content": [use]}]}
    r = httpx.post(f"{served.url}/v1/messages", json=body, timeout=120)
    message = "messages[1].content[0].input: must be an object"
    assert (r.status_code, r.json()) == (
        400,
        {"type": "error", "error": {"type": "invalid_request_error", "message": message}},
    )


@pytest.mark.parametrize(
    ("tool_choice", "got"),
    [
        ("required", "'required'"),
        ({"type": "function", "function": {"name": "add"}}, "the function 'add'"),
        ({"type": "function", "function": {"name": "nowhere"}}, "the function 'nowhere'"),
    ],
)
def test_a_tool_choice_that_would_force_a_call_is_refused(roomy, tool_choice, got):
    """Issue 48 (10): `required`, and a function (even one not in `tools`), were answered 200 with
    no call; the Anthropic route refused `{"type": "any"}`. Nothing can force a call (there is no
    constrained decoding), so both routes refuse what would."""
    import openai

    client = openai.OpenAI(base_url=roomy.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=USER, tools=[ADD], tool_choice=tool_choice, max_tokens=2)
    message = (
        "tool_choice: only 'auto' and 'none' are supported (nothing can force a call: there is no constrained "
        f"decoding), got {got}"
    )
    assert err.value.body == {"message": message, "type": "invalid_request_error", "param": "tool_choice", "code": 400}
    for allowed in ("auto", "none"):
        out = client.chat.completions.create(
            model="tiny", messages=USER, tools=[ADD], tool_choice=allowed, max_tokens=2
        )
        assert out.usage.completion_tokens == 2


STOP_IDS = {  # route -> (a body whose stop_token_ids hold the given ids, the field named)
    "/generate": (
        lambda ids: {"input_ids": [5, 9], "sampling_params": {"max_new_tokens": 2, "stop_token_ids": ids}},
        "sampling_params.stop_token_ids",
    ),
    "/v1/completions": (lambda ids: {"prompt": "abc", "max_tokens": 2, "stop_token_ids": ids}, "stop_token_ids"),
    "/v1/chat/completions": (lambda ids: {"messages": USER, "max_tokens": 2, "stop_token_ids": ids}, "stop_token_ids"),
}


@pytest.mark.parametrize("route", list(STOP_IDS))
@pytest.mark.parametrize("token", [259, 10**9])
def test_stop_token_ids_outside_the_vocabulary_are_refused(served, route, token):
    """Issue 48 (10): an out-of-vocabulary stop id was accepted (it can never be sampled, so it
    stopped nothing) while such a `logit_bias` id was refused; now both are, the same way."""
    body, field = STOP_IDS[route]
    r = httpx.post(f"{served.url}{route}", json=body([7, token]), timeout=120)
    message = f"{field}: token id {token} is outside the vocabulary; this model's ids are 0 to 258"
    assert (r.status_code, r.json()) == (
        400,
        {"error": {"message": message, "type": "invalid_request_error", "param": field, "code": 400}},
    )
    assert httpx.post(f"{served.url}{route}", json=body([7, 258]), timeout=120).status_code == 200
