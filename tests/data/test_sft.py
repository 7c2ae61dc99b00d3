"""SFT data: chat and pair rows to token-exact Samples, loss-mask spans, lengths and errors."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import CHATML, make_tokenizer

from tidal.data.dataset import read_rows
from tidal.data.sft import build_sft_samples, load_sft_samples
from tidal.types import Sample, Status

IM_START, IM_END = 1, 2


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def enc(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def trained(tokenizer, sample: Sample) -> list[str]:
    """The runs of mask-1 response tokens, decoded."""
    runs, run = [], []
    for token, m in zip(sample.response_tokens, sample.loss_mask, strict=True):
        if m:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return [tokenizer.decode(r) for r in runs]


def chat(*turns):
    return [{"role": role, "content": content} for role, content in turns]


def test_single_turn_chat(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat(("user", "What is 2+2?"), ("assistant", "4."))}])
    samples, dropped = load_sft_samples(path, tokenizer)
    assert dropped == 0
    (s,) = samples
    header = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert s.prompt == header
    assert tokenizer.decode(s.tokens[: s.prompt_length]) == header
    assert s.tokens[: s.prompt_length] == enc(tokenizer, header)
    # The response is the content and <|im_end|>, all trained; ChatML's trailing "\n" is cut off.
    assert s.response == "4.<|im_end|>"
    assert s.response_tokens == enc(tokenizer, "4.") + [IM_END]
    assert s.loss_mask == [1, 1, 1]
    assert trained(tokenizer, s) == ["4.<|im_end|>"]
    assert s.rollout_log_probs == [0.0, 0.0, 0.0]
    assert s.response_length == 3
    assert (s.status, s.reward, s.label, s.index) == (Status.COMPLETED, None, None, 0)
    assert s.metadata == {"source": f"{path}:1"}
    s.validate()


def test_multi_turn_chat_masks_only_assistant_turns(tokenizer):
    messages = chat(("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2"), ("assistant", "A2"))
    (s,), _ = build_sft_samples([(1, {"messages": messages})], tokenizer, source="mem")
    assert s.prompt == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\n"
    middle = "\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n"
    assert s.response == "A1<|im_end|>" + middle + "A2<|im_end|>"
    assert trained(tokenizer, s) == ["A1<|im_end|>", "A2<|im_end|>"]
    # Mask spans by hand: A1 (2 bytes) + <|im_end|>, then the second user turn and the header at 0,
    # then A2 + <|im_end|>.
    n_middle = len(enc(tokenizer, middle))
    assert n_middle == 3 + len("\nuser\nU2\nassistant\n")  # <|im_end|>, 2x <|im_start|> + bytes
    assert s.loss_mask == [1, 1, 1] + [0] * n_middle + [1, 1, 1]
    assert s.response_tokens[3 : 3 + n_middle] == enc(tokenizer, middle)
    # Prompt + response is the whole rendered chat minus ChatML's final "\n".
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert s.tokens == enc(tokenizer, full)[:-1]


def test_tool_turn_and_trailing_user_turn_are_not_trained(tokenizer):
    messages = chat(("user", "U"), ("assistant", "call"), ("tool", "out"), ("assistant", "done"), ("user", "bye"))
    (s,), _ = build_sft_samples([(1, {"messages": messages})], tokenizer, source="mem")
    assert trained(tokenizer, s) == ["call<|im_end|>", "done<|im_end|>"]
    assert "<|im_start|>tool\nout<|im_end|>" in s.response
    # Nothing after the last trained token: the trailing user turn never reaches the loss.
    assert s.loss_mask[-1] == 1
    assert s.response.endswith("done<|im_end|>")


def test_system_prompt_prepended_only_when_missing(tokenizer):
    rows = [
        (1, {"messages": chat(("user", "U"), ("assistant", "A"))}),
        (2, {"messages": chat(("system", "Mine"), ("user", "U"), ("assistant", "A"))}),
    ]
    samples, _ = build_sft_samples(rows, tokenizer, source="mem", system_prompt="Be brief.")
    assert samples[0].prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nU")
    assert samples[1].prompt.startswith("<|im_start|>system\nMine<|im_end|>\n")
    assert "Be brief." not in samples[1].prompt
    assert [trained(tokenizer, s) for s in samples] == [["A<|im_end|>"], ["A<|im_end|>"]]


def test_pair_with_chat_template(tokenizer):
    rows = [(1, {"prompt": "Hi?", "response": "Hello."})]
    (s,), _ = build_sft_samples(rows, tokenizer, source="mem", system_prompt="S")
    prompt_text = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    assert s.prompt == prompt_text
    assert s.tokens == enc(tokenizer, prompt_text) + enc(tokenizer, "Hello.") + [tokenizer.eos_token_id]
    assert s.response == "Hello.<|im_end|>"
    assert s.response_length == len("Hello.") + 1
    assert s.loss_mask == [1] * s.response_length
    assert s.rollout_log_probs == [0.0] * s.response_length


def test_pair_without_chat_template(tokenizer):
    rows = [(1, {"prompt": "2+2=", "response": "4"})]
    (s,), _ = build_sft_samples(rows, tokenizer, source="mem", apply_chat_template=False)
    assert s.tokens == enc(tokenizer, "2+2=") + enc(tokenizer, "4") + [IM_END]
    assert (s.prompt, s.response) == ("2+2=", "4<|im_end|>")
    assert s.prompt_length == 4
    assert s.loss_mask == [1, 1]


def test_pair_with_message_list_prompt(tokenizer):
    rows = [(1, {"prompt": chat(("user", "U1"), ("assistant", "A1"), ("user", "U2")), "response": "A2"})]
    (s,), _ = build_sft_samples(rows, tokenizer, source="mem")
    assert s.prompt.endswith("<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n")
    assert trained(tokenizer, s) == ["A2<|im_end|>"]


def test_custom_keys(tmp_path, tokenizer):
    rows = [{"conv": chat(("user", "q"), ("assistant", "a"))}, {"question": "q", "answer": "a"}]
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    samples, _ = load_sft_samples(path, tokenizer, messages_key="conv", prompt_key="question", response_key="answer")
    # Both formats give the same tokens for a single-turn exchange.
    assert samples[0].tokens == samples[1].tokens
    assert samples[0].loss_mask == samples[1].loss_mask


def test_jsonl_and_parquet_give_identical_samples(tmp_path, tokenizer):
    rows = [
        {"messages": chat(("user", "U1"), ("assistant", "A1"), ("user", "U2"), ("assistant", "A2"))},
        {"messages": chat(("system", "S"), ("user", "U"), ("assistant", "A"))},
    ]
    jsonl = write_jsonl(tmp_path / "data.jsonl", rows)
    parquet = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    from_jsonl, _ = load_sft_samples(jsonl, tokenizer)
    from_parquet, _ = load_sft_samples(parquet, tokenizer)
    strip = [{k: v for k, v in s.to_dict().items() if k != "metadata"} for s in from_jsonl]
    assert strip == [{k: v for k, v in s.to_dict().items() if k != "metadata"} for s in from_parquet]
    assert [s.metadata["source"] for s in from_parquet] == [f"{parquet}:1", f"{parquet}:2"]
    assert [s.index for s in from_parquet] == [0, 1]


def test_parquet_mixed_chat_and_pair_rows(tmp_path, tokenizer):
    # Parquet fills the columns a row lacks with None; that must read as "absent".
    rows = [
        {"messages": chat(("user", "q"), ("assistant", "a")), "prompt": None, "response": None},
        {"messages": None, "prompt": "q", "response": "a"},
    ]
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert [r["messages"] is None for _, r in read_rows(path)] == [False, True]
    samples, _ = load_sft_samples(path, tokenizer)
    assert samples[0].tokens == samples[1].tokens


def test_max_length_drops_and_counts(tmp_path, tokenizer):
    rows = [
        {"prompt": "ab", "response": "cd"},  # 2 + 2 + eos = 5 tokens
        {"prompt": "ab", "response": "cde"},  # 6
        {"prompt": "ab", "response": "c"},  # 4
        {"prompt": "x" * 10, "response": "y"},  # 12
    ]
    path = write_jsonl(tmp_path / "len.jsonl", rows)
    samples, dropped = load_sft_samples(path, tokenizer, max_length=5, apply_chat_template=False)
    assert dropped == 2
    assert [len(s.tokens) for s in samples] == [5, 4]  # exactly max_length is kept
    assert [s.index for s in samples] == [0, 2]
    assert [s.metadata["source"] for s in samples] == [f"{path}:1", f"{path}:3"]


def test_no_assistant_turn_is_an_error(tmp_path, tokenizer):
    rows = [{"messages": chat(("user", "q"), ("assistant", "a"))}, {"messages": chat(("user", "q"))}]
    path = write_jsonl(tmp_path / "noasst.jsonl", rows)
    with pytest.raises(ValueError, match=rf"^{path}:2: 'messages' has no assistant message"):
        load_sft_samples(path, tokenizer)


def test_missing_key_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "missing.jsonl", [{"prompt": "p", "response": "r"}, {"text": "t"}])
    with pytest.raises(ValueError, match=rf"^{path}:2: missing key 'messages' \(a chat\) or 'prompt' and 'response'"):
        load_sft_samples(path, tokenizer)
    path = write_jsonl(tmp_path / "noresp.jsonl", [{"prompt": "p"}])
    with pytest.raises(ValueError, match=rf"^{path}:1: missing key 'response'"):
        load_sft_samples(path, tokenizer)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"messages": [{"role": "user"}]}, "'messages' message 0 is missing key 'content'"),
        ({"messages": [{"content": "x"}]}, "'messages' message 0 is missing key 'role'"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 5}]},
            "'messages' message 1 'content' must be a string, got int",
        ),
        ({"messages": [{"role": "robot", "content": "q"}]}, "'messages' message 0 has role 'robot'"),
        ({"messages": [{"role": 3, "content": "q"}]}, "'messages' message 0 has role 3"),
        ({"messages": ["hi"]}, "'messages' message 0 must be an object, got str"),
        ({"messages": "hi"}, "'messages' must be a list of messages, got str"),
        ({"messages": []}, "'messages' is an empty list"),
        ({"messages": chat(("assistant", "a"))}, "'messages' starts with an assistant message"),
        ({"prompt": "p", "response": 3}, "'response' must be a string, got int"),
        ({"prompt": 3, "response": "r"}, "'prompt' must be a string or a list of messages, got int"),
    ],
)
def test_bad_rows_name_file_line_and_field(tokenizer, row, message):
    with pytest.raises(ValueError) as exc:
        build_sft_samples([(7, row)], tokenizer, source="f.jsonl")
    assert str(exc.value).startswith(f"f.jsonl:7: {message}")


def test_chat_without_chat_template_is_an_error(tokenizer):
    rows = [(3, {"messages": chat(("user", "q"), ("assistant", "a"))})]
    with pytest.raises(ValueError, match=r"^f.jsonl:3: 'messages' is a chat, which needs apply_chat_template=True"):
        build_sft_samples(rows, tokenizer, source="f.jsonl", apply_chat_template=False)
    with pytest.raises(ValueError, match="system_prompt needs apply_chat_template=True"):
        build_sft_samples(rows, tokenizer, source="f", apply_chat_template=False, system_prompt="S")


def test_non_prefix_stable_template_is_an_error(tmp_path):
    tokenizer = make_tokenizer()
    tokenizer.chat_template = "{{ messages | length }}\n" + CHATML  # the count changes as turns are added
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat(("user", "q"), ("assistant", "a"))}])
    with pytest.raises(ValueError, match=rf"^{path}:1: the chat template is not prefix-stable"):
        load_sft_samples(path, tokenizer)


def test_template_that_fails_names_the_row(tmp_path):
    tokenizer = make_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('bad turn') }}"
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat(("user", "q"), ("assistant", "a"))}])
    with pytest.raises(ValueError, match=rf"^{path}:1: the chat template failed .*bad turn"):
        load_sft_samples(path, tokenizer)
