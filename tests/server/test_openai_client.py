"""`tidal serve` driven by the real `openai` package and by SGLang-style requests (tiny fp32 model,
byte tokenizer with a ChatML template): streaming, logprobs with alternatives, content parts,
n > 1, tool calls both ways, penalties and logit bias, and the server's hardening (all-or-nothing
weight updates, limits, auth)."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import torch
from conftest import hf_greedy, make_model, make_tokenizer

from tidal.adapters.async_engine import AsyncEngine
from tidal.engine.llm_engine import LLMEngine
from tidal.server.app import BackgroundServer, build_app
from tidal.server.options import ServerConfig

USER = [{"role": "user", "content": "What is 2 + 3?"}]


class Served:
    def __init__(self, config: ServerConfig | None = None, model=None, **kw) -> None:
        self.tokenizer = make_tokenizer()
        self.model = model or make_model(vocab_size=259, seed=0)
        self.core = LLMEngine(self.model, self.tokenizer, dtype="float32", block_size=4, **kw)
        self.engine = AsyncEngine(self.core)
        self.server = BackgroundServer(build_app(self.engine, "tiny", config)).start()
        self.url = self.server.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=(config.api_key if config else None) or "none")

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


@pytest.fixture
def served():
    s = Served()
    yield s
    s.close()


def chat_prompt(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------- OpenAI client
def test_streaming_chat_equals_the_whole_answer_and_reports_usage(served):
    kw = {"model": "tiny", "messages": USER, "max_tokens": 12, "temperature": 0}
    whole = served.client.chat.completions.create(**kw)
    chunks = list(served.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == len(chat_prompt(served.tokenizer, USER))
    # the greedy tokens are transformers' greedy tokens
    ids = hf_greedy(served.model, chat_prompt(served.tokenizer, USER), 12)
    assert whole.choices[0].message.content == served.tokenizer.decode(ids)


def test_logprobs_with_alternatives(served):
    out = served.client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        alts = entry.top_logprobs
        assert len(alts) == 3 and [a.logprob for a in alts] == sorted((a.logprob for a in alts), reverse=True)
        # greedy: the chosen token is the most likely one, with the same log-prob
        assert alts[0].token == entry.token and alts[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    comp = served.client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(alts) <= 2 for alts in lp.top_logprobs)
    assert all(lp.tokens[k] in lp.top_logprobs[k] for k in range(4))


def test_content_parts_and_n_samples(served):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]}]
    a = served.client.chat.completions.create(model="tiny", messages=parts, max_tokens=6, temperature=0)
    b = served.client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    many = served.client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, n=3, seed=7)
    assert [c.index for c in many.choices] == [0, 1, 2]
    again = served.client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, n=3, seed=7)
    assert [c.message.content for c in many.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in many.choices}) > 1  # seed + j: different samples
    assert many.usage.prompt_tokens == b.usage.prompt_tokens  # the prompt counts once


def test_stop_strings_are_trimmed_in_whole_and_streamed_answers(served):
    base = served.client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text[3:5]  # something the greedy answer contains
    cut = served.client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    chunks = served.client.completions.create(
        model="tiny", prompt="abc", max_tokens=12, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut.choices[0].text


def test_penalties_and_logit_bias_change_the_greedy_answer(served):
    plain = served.client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0)
    forced_id = served.tokenizer.encode("z", add_special_tokens=False)[0]
    forced = served.client.completions.create(
        model="tiny", prompt="abc", max_tokens=6, temperature=0, logit_bias={str(forced_id): 100}
    )
    assert forced.choices[0].text == "z" * 6 != plain.choices[0].text
    # a frequency penalty larger than the bias's lead stops the repetition
    mixed = served.client.completions.create(
        model="tiny", prompt="abc", max_tokens=6, temperature=0, logit_bias={str(forced_id): 1.5}, frequency_penalty=2
    )
    assert mixed.choices[0].text.count("z") < 6


def test_unknown_fields_are_ignored(served):
    out = served.client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=2, extra_body={"guided_choice": ["a"], "some_new_option": 1}
    )
    assert out.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------- tools
class ScriptedCore(LLMEngine):
    """The tiny engine answering `script` (then its end-of-turn token) whatever it samples, so a
    tool call can be exercised end to end with a random model."""

    script = ""

    def _complete(self, launch, next_launch):
        # the step's tokens as the host reads them (on a CPU the copy is done already)
        want = self.tokenizer.encode(self.script, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        for i, seq in enumerate(launch.seqs):
            k = len(seq.output_ids)
            if k < len(want):
                launch.host[0, i] = want[k]
        return super()._complete(launch, next_launch)


@pytest.fixture
def scripted():
    # the tool descriptions alone are ~500 byte tokens: a longer context than the default
    s = Served(model=make_model(vocab_size=259, seed=0, max_position_embeddings=2048))
    s.engine.close()
    s.server.stop()
    s.core = ScriptedCore(s.model, s.tokenizer, dtype="float32", block_size=4)
    s.engine = AsyncEngine(s.core)
    s.server = BackgroundServer(build_app(s.engine, "tiny")).start()
    s.client = openai.OpenAI(base_url=s.server.url + "/v1", api_key="none")
    yield s
    s.close()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_a_tool_call_round_trip(scripted):
    scripted.core.script = (
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    out = scripted.client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content == "Let me look."
    # the tool result turn is accepted and rendered as a <tool_response>
    scripted.core.script = "It is sunny."
    follow = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
    ]
    seen = []
    add = scripted.core.add_request
    scripted.core.add_request = lambda rid, ids, params: seen.append(ids) or add(rid, ids, params)
    out = scripted.client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=200)
    assert out.choices[0].message.content == "It is sunny." and out.choices[0].finish_reason == "stop"
    text = scripted.tokenizer.decode(seen[0])
    # the tools were described to the model (this ChatML template has no tool support of its own)
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in text and "<tool_call>" in text


def test_a_call_inside_a_reasoning_block_is_not_a_call(scripted):
    scripted.core.script = '<think><tool_call>{"name": "get_weather", "arguments": {}}</tool_call></think>No call.'
    out = scripted.client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=200)
    assert out.choices[0].finish_reason == "stop" and not out.choices[0].message.tool_calls


def test_streamed_tool_calls(scripted):
    scripted.core.script = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    chunks = list(scripted.client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


# ---------------------------------------------------------------------- SGLang-style /generate
def test_sglang_generate_fields(served):
    url = served.url
    base = {"text": "abc", "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    plain = httpx.post(f"{url}/generate", json=base).json()
    r = httpx.post(
        f"{url}/generate",
        json={**base, "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True},
    ).json()
    meta = r["meta_info"]
    assert r["output_ids"] == plain["output_ids"] and len(meta["output_token_logprobs"]) == 6
    lp, tid, text = meta["output_token_logprobs"][0]
    assert tid == r["output_ids"][0] and text == served.tokenizer.decode([tid])
    assert len(meta["output_top_logprobs"]) == 6 and all(len(a) == 2 for a in meta["output_top_logprobs"])
    assert meta["output_top_logprobs"][0][0][1] == tid  # greedy: the top alternative is the token
    # stop strings are trimmed from the text unless no_stop_trim; the tokens are kept
    stop = plain["text"][2:4]
    sp = {"temperature": 0, "max_new_tokens": 6, "stop": stop}
    trimmed = httpx.post(f"{url}/generate", json={"text": "abc", "sampling_params": sp}).json()
    kept = httpx.post(f"{url}/generate", json={"text": "abc", "sampling_params": {**sp, "no_stop_trim": True}}).json()
    assert trimmed["text"] == plain["text"][: plain["text"].index(stop)]
    assert kept["text"].endswith(stop) and kept["output_ids"] == trimmed["output_ids"]
    # streaming: cumulative events, the last one the whole result, then [DONE]
    with httpx.stream("POST", f"{url}/generate", json={**base, "stream": True}) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["output_ids"] == plain["output_ids"] and last["meta_info"]["finish_reason"] == {"type": "length"}
    assert len(events) >= 4  # one per step at least for some of them


# ---------------------------------------------------------------------- hardening
def greedy_ids(url: str) -> list[int]:
    body = {"input_ids": [5, 9, 33], "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    return httpx.post(f"{url}/generate", json=body).json()["output_ids"]


def test_a_failed_weight_update_changes_nothing(served, tmp_path):
    from safetensors.torch import save_file

    before = greedy_ids(served.url)
    partial = tmp_path / "partial"
    partial.mkdir()
    save_file({"model.norm.weight": torch.zeros(64)}, partial / "model.safetensors")
    r = httpx.post(f"{served.url}/update_weights_from_disk", json={"model_path": str(partial), "weight_version": 5})
    assert r.status_code == 400 and r.json()["success"] is False and "no tensor given for" in r.json()["message"]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not safetensors")
    r = httpx.post(f"{served.url}/update_weights_from_disk", json={"model_path": str(corrupt), "weight_version": 6})
    assert r.status_code == 400 and "cannot read" in r.json()["error"]["message"]
    wrong = tmp_path / "wrong"
    other = make_model(vocab_size=259, seed=1).state_dict()
    other["model.norm.weight"] = torch.zeros(65)
    wrong.mkdir()
    save_file({k: v.contiguous() for k, v in other.items() if k != "lm_head.weight"}, wrong / "model.safetensors")
    r = httpx.post(f"{served.url}/update_weights_from_disk", json={"model_path": str(wrong), "weight_version": 7})
    assert r.status_code == 400 and "model.norm.weight has shape (65,)" in r.json()["error"]["message"]
    assert greedy_ids(served.url) == before
    assert httpx.get(f"{served.url}/get_weight_version").json() == {"weight_version": 0}


def test_limits_protect_the_server():
    s = Served(ServerConfig(max_body_bytes=2**20, max_n=4, max_request_tokens=500))
    try:
        r = httpx.post(f"{s.url}/generate", json={"text": "x" * 2**21})
        assert r.status_code == 413 and "at most 1048576" in r.json()["error"]["message"]
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": USER, "n": 100000})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("n: must be between 1 and 4")
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "n": 4, "max_tokens": 200})
        assert r.status_code == 400 and "this server takes at most 500 per request" in r.json()["error"]["message"]
    finally:
        s.close()


def test_health_answers_while_a_huge_text_is_tokenised():
    """Tokenising runs off the event loop: /health answers while a request's text is being encoded.
    The tokenizer is held inside `encode` until /health has answered, so nothing depends on timing:
    had the encoding run on the event loop, /health could not answer and its request would time out."""
    # a context long enough that the 1 MB text is not refused unread (no token spells more than 13 bytes)
    s = Served(ServerConfig(max_request_tokens=10**8), max_model_len=100_000)
    inside, release = threading.Event(), threading.Event()
    encode = s.tokenizer.encode

    def held_encode(text, *args, **kwargs):
        if len(text) > 10_000:  # the big request's text, not a chat template's
            inside.set()
            release.wait(120)
        return encode(text, *args, **kwargs)

    s.tokenizer.encode = held_encode
    try:
        done = {}
        big = threading.Thread(
            target=lambda: done.setdefault(
                "r", httpx.post(f"{s.url}/generate", json={"text": "ab" * 500_000}, timeout=120)
            )
        )
        big.start()
        assert inside.wait(60), "the 1 MB text never reached the tokenizer"
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
        assert big.is_alive() and not release.is_set()  # answered while the encoding was still held
        release.set()
        big.join(120)
        assert done["r"].status_code == 400 and "the prompt has 1000000 tokens" in done["r"].json()["error"]["message"]
    finally:
        release.set()
        s.close()


def test_api_key_is_required_on_every_route_but_health(monkeypatch):
    s = Served(ServerConfig(api_key="s3cret"))
    try:
        for method, path in [
            ("GET", "/v1/models"),
            ("POST", "/generate"),
            ("POST", "/abort_request"),
            ("POST", "/update_weights_from_disk"),
            ("GET", "/get_weight_version"),
        ]:
            r = httpx.request(method, f"{s.url}{path}", json={})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        assert httpx.get(f"{s.url}/health").status_code == 200
        r = httpx.get(f"{s.url}/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        out = s.client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)  # key s3cret
        assert out.choices[0].finish_reason == "length"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong").models.list()
    finally:
        s.close()


def test_binding_beyond_loopback_without_a_key_warns(caplog):
    from tidal.server.app import warn_if_open

    with caplog.at_level("WARNING", logger="tidal.server"):
        warn_if_open("0.0.0.0", ServerConfig())
        warn_if_open("127.0.0.1", ServerConfig())
        warn_if_open("0.0.0.0", ServerConfig(api_key="k"))
    assert caplog.text.count("WITHOUT AN API KEY") == 1
