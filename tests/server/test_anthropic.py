"""`tidal serve`'s `/v1/messages` driven by the real `anthropic` package (tiny fp32 model, byte
tokenizer with a ChatML template): the same prompt and answer as OpenAI's chat route for one
conversation, the system prompt, stop sequences, max_tokens, a tool call both ways (a scripted
engine writes the call), streaming events, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import hf_greedy, make_model
from test_openai_client import TOOLS, USER, ScriptedCore, Served, chat_prompt

from tidal.adapters.async_engine import AsyncEngine
from tidal.server.app import BackgroundServer, build_app

anthropic = pytest.importorskip("anthropic")

# anthropic 2.x's `messages.create` no longer takes `temperature`; the API (and this server) does
GREEDY = {"extra_body": {"temperature": 0}}

WEATHER = [
    {
        "name": "get_weather",
        "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def with_clients(s: Served) -> Served:
    s.anthropic = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
    s.prompts = []  # every prompt the engine was given, in order
    add = s.core.add_request
    s.core.add_request = lambda rid, ids, params: s.prompts.append(list(ids)) or add(rid, ids, params)
    return s


@pytest.fixture
def served():
    s = with_clients(Served())
    yield s
    s.close()


@pytest.fixture
def scripted():
    s = scripted_served()
    yield s
    s.close()


def scripted_served() -> Served:
    """A server whose engine writes `core.script` (`ScriptedCore`), with both clients."""
    # the tool descriptions alone are ~500 byte tokens: a longer context than the default
    s = Served(model=make_model(vocab_size=259, seed=0, max_position_embeddings=2048))
    s.engine.close()
    s.server.stop()
    s.core = ScriptedCore(s.model, s.tokenizer, dtype="float32", block_size=4)
    s.engine = AsyncEngine(s.core)
    s.server = BackgroundServer(build_app(s.engine, "tiny")).start()
    s.url = s.server.url
    s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
    return with_clients(s)


def test_a_message_is_the_chat_completion_of_the_same_conversation(served):
    msg = served.anthropic.messages.create(model="tiny", max_tokens=12, messages=USER, **GREEDY)
    chat = served.client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, **GREEDY)
    prompt = chat_prompt(served.tokenizer, USER)
    assert served.prompts == [prompt, prompt]  # one renderer: the same prompt ids
    text = served.tokenizer.decode(hf_greedy(served.model, prompt, 12))  # transformers' greedy answer
    assert [(b.type, b.text) for b in msg.content] == [("text", text)]
    assert chat.choices[0].message.content == text
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny" and msg.id.startswith("msg_")
    assert (msg.stop_reason, msg.stop_sequence) == ("max_tokens", None)
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (len(prompt), 12)
    # the same question as text blocks
    blocks = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 3?"}]}]
    again = served.anthropic.messages.create(model="tiny", max_tokens=12, messages=blocks, **GREEDY)
    assert served.prompts[-1] == prompt and again.content[0].text == text


def test_the_system_prompt_is_the_first_message(served):
    conversation = [{"role": "system", "content": "Answer briefly."}, *USER]
    prompt = chat_prompt(served.tokenizer, conversation)
    chat = served.client.chat.completions.create(model="tiny", messages=conversation, max_tokens=6, **GREEDY)
    for system in ("Answer briefly.", [{"type": "text", "text": "Answer "}, {"type": "text", "text": "briefly."}]):
        msg = served.anthropic.messages.create(model="tiny", max_tokens=6, system=system, messages=USER, **GREEDY)
        assert served.prompts[-1] == prompt and msg.content[0].text == chat.choices[0].message.content


def test_stop_sequences_end_the_answer_and_name_the_match(served):
    whole = served.anthropic.messages.create(model="tiny", max_tokens=12, messages=USER, **GREEDY).content[0].text
    stop = whole[3:5]  # something the greedy answer contains
    msg = served.anthropic.messages.create(
        model="tiny", max_tokens=12, messages=USER, stop_sequences=["never written", stop], **GREEDY
    )
    assert msg.content[0].text == whole[: whole.index(stop)]
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.usage.output_tokens == whole.index(stop) + len(stop)  # one byte a token; the engine keeps the stop


def test_a_tool_call_round_trip(scripted):
    scripted.core.script = (
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    msg = scripted.anthropic.messages.create(
        model="tiny", max_tokens=200, messages=USER, tools=WEATHER, tool_choice={"type": "auto"}
    )
    text, use = msg.content
    assert (text.type, text.text) == ("text", "Let me look.")
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert use.id.startswith("toolu_") and (msg.stop_reason, msg.stop_sequence) == ("tool_use", None)
    # the tools reach the model as OpenAI's functions would
    openai_tools = scripted.client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=200)
    assert scripted.prompts[0] == scripted.prompts[1]
    assert openai_tools.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'

    # the result in the next request is rendered as the template renders a tool message
    scripted.core.script = "It is sunny."
    result = {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": '{"sky": "sunny"}'}]}
    follow = [*USER, {"role": "assistant", "content": msg.content}, {"role": "user", "content": [result]}]
    out = scripted.anthropic.messages.create(model="tiny", max_tokens=200, messages=follow, tools=WEATHER)
    assert [(b.type, b.text) for b in out.content] == [("text", "It is sunny.")]
    assert (out.stop_reason, out.stop_sequence) == ("end_turn", None)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    openai_follow = [
        *USER,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]
    scripted.client.chat.completions.create(model="tiny", messages=openai_follow, tools=TOOLS, max_tokens=200)
    assert scripted.prompts[2] == scripted.prompts[3]
    rendered = scripted.tokenizer.decode(scripted.prompts[2])
    assert rendered.endswith(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    )
    # a failed tool says so
    failed = [*follow[:2], {"role": "user", "content": [{**result, "content": "no such city", "is_error": True}]}]
    scripted.anthropic.messages.create(model="tiny", max_tokens=200, messages=failed, tools=WEATHER)
    assert "<tool_response>\nError: no such city\n</tool_response>" in scripted.tokenizer.decode(scripted.prompts[4])


def sse_events(url: str, body: dict, route: str = "/v1/messages") -> list[tuple[str, dict]]:
    """(event line, data) of each server-sent event of `route`, in order."""
    with httpx.stream("POST", url + route, json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = []
    for chunk in raw.strip().split("\n\n"):
        kind, data = chunk.split("\n")
        events.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_streamed_events_in_order_add_up_to_the_whole_answer(served):
    body = {"model": "tiny", "max_tokens": 12, "messages": USER}
    whole = served.anthropic.messages.create(**body, **GREEDY)
    events = sse_events(served.url, {**body, "temperature": 0, "stream": True})
    kinds = [k for k, _ in events]
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == kind for kind, data in events)  # the event line names the data's type
    start = events[0][1]["message"]
    assert (start["content"], start["usage"]) == ([], {"input_tokens": whole.usage.input_tokens, "output_tokens": 0})
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"output_tokens": 12},
    }
    # the anthropic package's own stream helper puts the same message together
    with served.anthropic.messages.stream(**body, **GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.text for b in final.content] == [whole.content[0].text] and final.stop_reason == "max_tokens"


def test_a_streamed_tool_call(scripted):
    scripted.core.script = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    body = {"model": "tiny", "max_tokens": 200, "messages": USER, "tools": WEATHER}
    with scripted.anthropic.messages.stream(**body) as stream:
        final = stream.get_final_message()
    (use,) = final.content
    assert (use.type, use.name, use.input, final.stop_reason) == (
        "tool_use",
        "get_weather",
        {"city": "Oslo"},
        "tool_use",
    )
    kinds = [(k, d.get("delta", {}).get("type")) for k, d in sse_events(scripted.url, {**body, "stream": True})]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", None),
        ("content_block_delta", "input_json_delta"),
        ("content_block_stop", None),
        ("message_delta", None),
        ("message_stop", None),
    ]


PNG_SOURCE = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": USER}, "max_tokens: Field required"),
        ({"max_tokens": 0, "messages": USER}, "max_tokens: must be >= 1, got 0"),
        (
            {"max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"}},
            "tool_choice: only {'type': 'auto'} is supported (nothing can force or forbid a call: there is no "
            "constrained decoding), got type 'any'",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
            "messages[0].role: must be 'user' or 'assistant', got 'system'",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}],
            },
            "messages[0].content[0].source: only base64 image sources are taken (nothing is fetched), got 'url'",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": PNG_SOURCE}]}]},
            "messages[0].content[0]: part type 'image_url' is not supported (text only: this model takes no images)",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "messages[0].content[0].type: a user's blocks are text, image or tool_result, got 'document'",
        ),
        (
            {"max_tokens": 5, "messages": USER, "tools": [{"name": "f"}]},
            "tools[0].input_schema: must be a JSON schema object",
        ),
    ],
)
def test_errors_have_anthropics_shape_and_name_the_field(served, body, message):
    r = httpx.post(served.url + "/v1/messages", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    # the server keeps serving
    assert served.anthropic.messages.create(model="tiny", max_tokens=1, messages=USER).usage.output_tokens == 1


def test_the_anthropic_package_raises_with_the_message(served):
    with pytest.raises(anthropic.BadRequestError) as err:
        served.anthropic.messages.create(model="tiny", max_tokens=5, messages=USER, tool_choice={"type": "none"})
    assert err.value.status_code == 400 and err.value.body["error"]["message"].endswith("got type 'none'")
    # the rest of the server keeps OpenAI's shape
    r = httpx.post(served.url + "/v1/chat/completions", json={"messages": USER, "n": 0}, timeout=30)
    assert r.json()["error"]["message"] == "n: must be between 1 and 16 on this server, got 0"
