"""The serving parts that are pure functions: tool-call parsing and rendering, logit penalties,
incremental detokenisation."""

import json

import pytest
import torch
from conftest import make_tokenizer

from tidal.chat.text import TextStream, trim_stop
from tidal.chat.tools import flatten_content, parse_tool_calls, render_messages, template_takes_tools
from tidal.contracts import SamplingParams
from tidal.engine.sampling import adjust_logits, top_logprobs


def test_tool_calls_are_parsed_outside_reasoning_only():
    text = (
        '<think>maybe <tool_call>{"name": "a", "arguments": {}}</tool_call></think>'
        'Sure.<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>'
        '<tool_call>{"name": "c", "arguments": "{\\"y\\": 2}"}</tool_call>'
        "<tool_call>not json</tool_call>"
    )
    rest, calls, problems = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("b", {"x": 1}), ("c", {"y": 2})]
    assert problems == ["tool call is not JSON: Expecting value at position 0"]
    assert rest.startswith("<think>") and "Sure." in rest and "not json" in rest
    assert json.loads(calls[0].to_openai()["function"]["arguments"]) == {"x": 1}
    _, calls, problems = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert calls == [] and problems == ['tool call must be {"name": string, "arguments": object}']
    # an unclosed reasoning block hides everything after it
    assert parse_tool_calls('<think>x <tool_call>{"name": "a", "arguments": {}}</tool_call>')[1] == []


def test_messages_with_tools_render_for_a_template_without_tool_support():
    tok = make_tokenizer()
    assert not template_takes_tools(tok)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"q": 1}'}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    out, passed_tools = render_messages(messages, tools, "required", native=False)
    assert passed_tools is None
    assert out[0]["content"].startswith("Be brief.\n\nYou may call") and '"name": "f"' in out[0]["content"]
    assert "You must call at least one function." in out[0]["content"]
    assert out[1] == {"role": "user", "content": "hi there"}
    assert out[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"q": 1}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    # tool_choice none: no tools at all; a template with tool support gets them as they are
    assert render_messages(messages[:2], tools, "none", native=False)[0][0] == {
        "role": "system",
        "content": "Be brief.",
    }
    assert render_messages(messages[:2], tools, "auto", native=True)[1] == tools
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: part type 'image_url' is not supported"):
        flatten_content([{"type": "image_url"}], "messages[0]")


def test_penalties_and_bias_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    p0 = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias={1: 10.0})
    p1 = SamplingParams()
    out = adjust_logits(logits, [p0, p1], [[0, 0, 1], [3]])
    # token 0: seen twice, positive: 2 / 2 - 0.5 - 0.25 * 2 = 0; token 1: seen once, negative:
    # -1 * 2 - 0.5 - 0.25 + 10 = 7.25; unseen tokens unchanged; row 1 has no adjustments
    assert out[0].tolist() == [0.0, 7.25, 0.5, 3.0]
    assert torch.equal(out[1], logits[1]) and torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0]))
    assert adjust_logits(logits, [p1, p1], [[0], [1]]) is logits  # nothing to do: no copy
    ids, lps = top_logprobs(logits, torch.tensor([0.0, 2.0]), 2)
    assert ids[0].tolist() == [3, 0] and lps[0].tolist() == pytest.approx(
        torch.log_softmax(logits[0], 0)[[3, 0]].tolist()
    )
    assert lps[1].tolist() == pytest.approx([-torch.log(torch.tensor(4.0)).item()] * 2)


def test_sampling_params_reject_bad_serving_values():
    for bad, msg in [
        ({"seed": 2**64}, r"seed must be in \[0, 2\*\*64\)"),
        ({"top_logprobs": 21}, "top_logprobs must be an int in"),
        ({"presence_penalty": 3}, "presence_penalty must be a number in"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a number in"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {5: 1000}}, r"logit_bias\[5\] must be a number in"),
    ]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**bad).validate()


def test_text_stream_holds_back_partial_characters_and_stop_strings():
    tok = make_tokenizer()
    ids = tok.encode("héllo END more", add_special_tokens=False)
    stream = TextStream(tok, stops=["END"])
    out = "".join(stream.add([t]) for t in ids) + stream.add([], final=True)
    assert out == "héllo " == trim_stop("héllo END more", ["END"])
    plain = TextStream(tok)
    pieces = [plain.add([t]) for t in tok.encode("é", add_special_tokens=False)]
    assert pieces == ["", "é"]  # the first byte alone is not sent as a replacement character
