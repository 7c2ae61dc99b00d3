"""`tidal serve`'s `/v1/responses` driven by the real `openai` package (tiny fp32 model, byte
tokenizer with a ChatML template): item lists translated to the exact chat messages, one prompt
for one conversation on all three routes, whole and streamed answers alike (and assembled by the
package's own stream helper), sampled tokens with a seed, log-probs, a function tool both ways,
`previous_response_id`, and errors naming the field."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from conftest import hf_greedy
from test_anthropic import WEATHER, scripted, served, sse_events  # noqa: F401  (fixtures)
from test_openai_client import TOOLS, USER, chat_prompt

from tidal.chat.errors import BadRequest
from tidal.chat.responses import RESPONSES_ROUTE as ROUTE
from tidal.chat.responses import ResponsesBody, ResponseStore, translate

FUNCTIONS = [{"type": "function", "strict": False, **t["function"]} for t in TOOLS]  # the Responses shape
GREEDY = {"temperature": 0}


def body(**kw) -> ResponsesBody:
    return ResponsesBody.model_validate(kw)


def input_text(t: str) -> dict:
    return {"type": "input_text", "text": t}


# ---------------------------------------------------------------------------- translate
def test_items_translate_to_the_chat_messages_they_stand_for():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [input_text("Weather in "), input_text("Paris?")]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": "{}"},
    ]  # fmt: skip
    chat, tools = translate(body(input=items, instructions="You are a bot.", tools=FUNCTIONS), [])
    call = lambda i, city: {  # noqa: E731
        "id": i,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city}) if city else "{}"},
    }
    assert chat == [
        {"role": "system", "content": "You are a bot."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call("c1", "Paris"), call("c2", "Lyon")]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [call("c3", None)]},
    ]
    assert tools == TOOLS
    # a string is one user message; the history of a previous response comes first
    history = [{"type": "message", "role": "user", "content": "Hi"}]
    chat, tools = translate(body(input="Again", tool_choice="none", tools=FUNCTIONS), history)
    assert chat == [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Again"}] and tools is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type: only text parts (input_text, output_text) are supported, got 'input_image'",
        ),
        (
            {"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]},
            "input[0].type: reasoning items are not supported: this server returns none, and their content cannot "
            "be rendered as text the model saw",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
            "input[0].arguments: must be a JSON object in a string, as the model would write it (e.g. "
            "'{\"a\": 1}'); it holds a JSON array",
        ),
        (
            {"input": [{"role": "tool", "content": "x"}]},
            "input[0].role: must be user, assistant, system or developer, got 'tool'",
        ),
        (
            {"input": "x", "tools": [{"type": "web_search"}]},
            "tools[0].type: only function tools are supported, got 'web_search'",
        ),
        (
            {"input": "x", "tool_choice": "required"},
            "tool_choice: only 'auto' and 'none' are supported (nothing can force a call: there is no constrained "
            "decoding), got 'required'",
        ),
        (
            {"input": "x", "tool_choice": {"type": "function", "name": "f"}},
            "tool_choice: only 'auto' and 'none' are supported (nothing can force a call: there is no constrained "
            "decoding), got the function 'f'",
        ),
        (
            {"input": "x", "text": {"format": {"type": "json_object"}}},
            "text.format: type 'json_object' is not supported (no constrained decoding); use 'text' and validate "
            "the answer yourself",
        ),
        (
            {"input": "x", "include": ["reasoning.encrypted_content"]},
            "include: 'reasoning.encrypted_content' is not supported; this server can include "
            "'message.output_text.logprobs' only",
        ),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens: must be >= 1, got 0"),
        ({"input": []}, "input: at least one item is needed"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_field(fields, message):
    with pytest.raises(BadRequest) as err:
        translate(body(**fields), [])
    assert str(err.value) == message


def test_the_store_keeps_the_latest_within_its_limits():
    store = ResponseStore(max_responses=2, max_chars=10_000)
    for k in range(3):
        store.put(f"r{k}", [{"k": k}])
    assert store.history("r2") == [{"k": 2}] and store.history(None) == []
    with pytest.raises(BadRequest, match="previous_response_id: no stored response 'r0'"):
        store.history("r0")
    store.history("r1")  # used: now the newest
    store.put("big", [{"text": "x" * 10_000}])  # over the characters limit alone: everything older goes
    assert list(store.items) == [] and store.chars == 0


# ---------------------------------------------------------------------------- served
def test_a_response_is_the_chat_completion_of_the_same_conversation(served):  # noqa: F811
    resp = served.client.responses.create(model="tiny", input="What is 2 + 3?", max_output_tokens=12, **GREEDY)
    chat = served.client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, **GREEDY)
    msg = served.anthropic.messages.create(model="tiny", max_tokens=12, messages=USER, extra_body=GREEDY)
    prompt = chat_prompt(served.tokenizer, USER)
    assert served.prompts == [prompt] * 3  # one renderer: the same prompt ids on the three routes
    text = served.tokenizer.decode(hf_greedy(served.model, prompt, 12))
    assert resp.output_text == chat.choices[0].message.content == msg.content[0].text == text
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == "tiny"
    (item,) = resp.output
    assert (item.type, item.role, item.status, [p.type for p in item.content]) == (
        "message",
        "assistant",
        "completed",
        ["output_text"],
    )
    assert (resp.status, resp.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (
        len(prompt),
        12,
        len(prompt) + 12,
    )
    assert resp.usage.input_tokens_details.cached_tokens == resp.usage.output_tokens_details.reasoning_tokens == 0
    # the same question as input_text parts, and instructions as the system message
    again = served.client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": [input_text("What is "), input_text("2 + 3?")]}],
        max_output_tokens=12,
        **GREEDY,
    )  # fmt: skip
    assert served.prompts[-1] == prompt and again.output_text == text
    served.client.responses.create(model="tiny", input="What is 2 + 3?", instructions="Be brief.", max_output_tokens=2)
    assert served.prompts[-1] == chat_prompt(served.tokenizer, [{"role": "system", "content": "Be brief."}, *USER])


def test_seeded_sampling_and_logprobs_match_the_chat_route(served):  # noqa: F811
    kw = {"model": "tiny", "temperature": 1.0, "extra_body": {"seed": 7}}
    resp = served.client.responses.create(
        input="What is 2 + 3?", max_output_tokens=10, include=["message.output_text.logprobs"], top_logprobs=2, **kw
    )
    chat = served.client.chat.completions.create(messages=USER, max_tokens=10, logprobs=True, top_logprobs=2, **kw)
    part = resp.output[0].content[0]
    assert part.text == chat.choices[0].message.content
    want = chat.choices[0].logprobs.content
    # the same tokens, their log-probs to float rounding (the second request reads the first's cached prompt)
    assert [(e.token, e.bytes) for e in part.logprobs] == [(e.token, e.bytes) for e in want]
    assert [e.logprob for e in part.logprobs] == pytest.approx([e.logprob for e in want], abs=1e-5)
    got_alts = [[(a.token, a.logprob) for a in e.top_logprobs] for e in part.logprobs]
    want_alts = [[(a.token, a.logprob) for a in e.top_logprobs] for e in want]
    assert [[t for t, _ in a] for a in got_alts] == [[t for t, _ in a] for a in want_alts]
    assert [v for a in got_alts for _, v in a] == pytest.approx([v for a in want_alts for _, v in a], abs=1e-5)
    # no include: no log-probs
    plain = served.client.responses.create(input="What is 2 + 3?", max_output_tokens=10, **kw)
    assert plain.output_text == part.text and plain.output[0].content[0].logprobs == []


def test_streamed_events_in_order_add_up_to_the_whole_answer(served):  # noqa: F811
    kw = {"model": "tiny", "input": "What is 2 + 3?", "max_output_tokens": 12, "temperature": 0}
    whole = served.client.responses.create(**kw)
    events = sse_events(served.url, {**kw, "stream": True}, ROUTE)
    kinds = [k for k, _ in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert all(d["type"] == k for k, d in events) and [d["sequence_number"] for _, d in events] == list(
        range(len(events))
    )
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    text = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    assert text == whole.output_text == events[-4][1]["text"]
    last = events[-1][1]["response"]
    assert last["id"] == events[0][1]["response"]["id"] and last["usage"] == whole.usage.model_dump(exclude_none=True)
    assert last["output"][0]["content"][0]["text"] == text
    # the package's own stream helper, and create(stream=True), put the same response together (the
    # helper's `get_final_response` needs `response.completed`: `test_a_streamed_function_call` uses it)
    with served.client.responses.stream(**kw) as stream:
        seen = list(stream)
    pieces = [e.delta for e in seen if e.type == "response.output_text.delta"]
    assert seen[-1].type == "response.incomplete" and seen[-1].response.status == "incomplete"
    assert "".join(pieces) == seen[-1].response.output_text == whole.output_text
    created = [e for e in served.client.responses.create(**kw, stream=True)]
    assert created[-1].type == "response.incomplete" and created[-1].response.output_text == whole.output_text
    # the streamed request rendered the same prompt
    assert len(set(map(tuple, served.prompts))) == 1


def test_a_function_call_round_trip_and_previous_response_id(scripted):  # noqa: F811
    scripted.core.script = (
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    resp = scripted.client.responses.create(
        model="tiny", input="What is 2 + 3?", tools=FUNCTIONS, max_output_tokens=200
    )
    message, call = resp.output
    assert (message.type, message.content[0].text) == ("message", "Let me look.")
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call",
        "get_weather",
        {"city": "Paris"},
        "completed",
    )
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and resp.status == "completed"
    # the tools reach the model as the chat route's functions and Messages' tools do
    scripted.client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=200)
    scripted.anthropic.messages.create(model="tiny", max_tokens=200, messages=USER, tools=WEATHER)
    assert scripted.prompts[0] == scripted.prompts[1] == scripted.prompts[2]

    # the result continues the conversation by previous_response_id, or with every item sent again
    scripted.core.script = "It is sunny."
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}
    follow = scripted.client.responses.create(
        model="tiny", previous_response_id=resp.id, input=[result], tools=FUNCTIONS, max_output_tokens=200
    )
    assert follow.output_text == "It is sunny." and follow.previous_response_id == resp.id
    items = [{"role": "user", "content": "What is 2 + 3?"}, *[o.model_dump() for o in resp.output], result]
    scripted.client.responses.create(model="tiny", input=items, tools=FUNCTIONS, max_output_tokens=200)
    chat_call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [
        *USER,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": "c", "content": '{"sky": "sunny"}'},
    ]
    scripted.client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=200)
    assert scripted.prompts[3] == scripted.prompts[4] == scripted.prompts[5]  # the full history's prompt
    # a chain goes on; one not stored cannot be continued
    third = scripted.client.responses.create(
        model="tiny", previous_response_id=follow.id, input="Thanks!", store=False, max_output_tokens=200
    )
    assert scripted.tokenizer.decode(scripted.prompts[6]).count("It is sunny.") == 1
    with pytest.raises(openai.BadRequestError) as err:
        scripted.client.responses.create(model="tiny", previous_response_id=third.id, input="x")
    assert err.value.body["message"] == (
        f"previous_response_id: no stored response {third.id!r} (responses are kept in memory, the latest 1024, "
        "and only with store: true)"
    )


def test_a_streamed_function_call(scripted):  # noqa: F811
    scripted.core.script = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    kw = {"model": "tiny", "input": "What is 2 + 3?", "tools": FUNCTIONS, "max_output_tokens": 200}
    with scripted.client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    (call,) = final.output
    assert (call.type, call.name, json.loads(call.arguments), final.status) == (
        "function_call",
        "get_weather",
        {"city": "Oslo"},
        "completed",
    )
    scripted.core.script = "It is sunny."  # a text answer that ends by itself: completed
    with scripted.client.responses.stream(**{**kw, "previous_response_id": final.id, "input": "And?"}) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        done = stream.get_final_response()
    assert text == done.output_text == "It is sunny." and done.status == "completed"
    assert done.output[0].content[0].text == "It is sunny." and done.previous_response_id == final.id
    scripted.core.script = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    events = sse_events(scripted.url, {**kw, "stream": True}, ROUTE)
    assert [k for k, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[3][1]["delta"] == '{"city": "Oslo"}' == events[-1][1]["response"]["output"][0]["arguments"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id: no stored response 'resp_nope'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
            "input[0].content[0].type: only text parts (input_text, output_text) are supported, got 'input_image'",
        ),
        ({"input": "x", "tool_choice": "required"}, "tool_choice: only 'auto' and 'none' are supported"),
        ({}, "input: Field required"),
    ],
)
def test_errors_name_the_field(served, fields, message):  # noqa: F811
    r = httpx.post(served.url + "/v1/responses", json={"model": "tiny", **fields}, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"].startswith(message) and error["param"] == message.split(":")[0]
    assert error["type"] == "invalid_request_error"
    # the server keeps serving, and the package raises with the message
    with pytest.raises(openai.BadRequestError) as err:
        served.client.responses.create(model="tiny", input="x", tool_choice="required")
    assert err.value.status_code == 400 and err.value.body["param"] == "tool_choice"
    assert served.client.responses.create(model="tiny", input="x", max_output_tokens=1).usage.output_tokens == 1


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
def test_an_openai_agents_sdk_agent_runs_against_the_server(scripted, stream):  # noqa: F811
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # its traces would go to OpenAI's servers

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        return "sunny"

    scripted.core.script = "It is sunny in Paris."
    client = openai.AsyncOpenAI(base_url=scripted.url + "/v1", api_key="none", max_retries=0)
    model = agents.OpenAIResponsesModel(model="tiny", openai_client=client)
    agent = agents.Agent(name="weather", instructions="Answer briefly.", model=model, tools=[get_weather])

    async def run():
        if not stream:
            return await agents.Runner.run(agent, "What is the weather in Paris?")
        result = agents.Runner.run_streamed(agent, "What is the weather in Paris?")
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert result.final_output == "It is sunny in Paris."
    # the SDK's instructions, question and function tool rendered as the chat route renders them
    rendered = scripted.tokenizer.decode(scripted.prompts[0])
    assert rendered.startswith("<|im_start|>system\nAnswer briefly.\n\n") and '"name": "get_weather"' in rendered
    assert rendered.endswith("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
