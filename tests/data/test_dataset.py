"""Prompt loading: file formats, chat templating, length filtering and error messages."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tidal.data.dataset import PromptRecord, build_prompts, load_prompts, read_rows

ROWS = [
    {"prompt": "What is 1 + 1?", "label": "2", "metadata": {"id": "a"}},
    {"prompt": "Name a colour.", "label": "red", "metadata": {"id": "b"}},
    {"prompt": "Say hi.", "label": "hi", "metadata": {"id": "c"}},
]


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def chatml(*turns):
    body = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return body + "<|im_start|>assistant\n"


@pytest.fixture
def jsonl_file(tmp_path):
    # The blank line checks that line numbers and indices stay right around skipped lines.
    lines = [json.dumps(ROWS[0]), "", json.dumps(ROWS[1]), json.dumps(ROWS[2])]
    return write_jsonl(tmp_path / "data.jsonl", lines)


@pytest.fixture
def parquet_file(tmp_path):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


def test_read_rows_jsonl_numbers_are_file_lines(jsonl_file):
    assert list(read_rows(jsonl_file)) == [(1, ROWS[0]), (3, ROWS[1]), (4, ROWS[2])]


def test_read_rows_parquet_numbers_are_rows(parquet_file):
    assert list(read_rows(parquet_file)) == [(1, ROWS[0]), (2, ROWS[1]), (3, ROWS[2])]


def test_read_rows_json_array_and_json_lines(tmp_path):
    array = tmp_path / "array.json"
    array.write_text(json.dumps(ROWS), encoding="utf-8")
    assert list(read_rows(array)) == [(1, ROWS[0]), (2, ROWS[1]), (3, ROWS[2])]
    lines = write_jsonl(tmp_path / "lines.json", [json.dumps(r) for r in ROWS])
    assert list(read_rows(lines)) == [(1, ROWS[0]), (2, ROWS[1]), (3, ROWS[2])]
    single = write_jsonl(tmp_path / "single.json", [json.dumps(ROWS[0])])
    assert list(read_rows(single)) == [(1, ROWS[0])]


def test_jsonl_and_parquet_give_identical_records(jsonl_file, parquet_file, tokenizer):
    from_jsonl, dropped_jsonl = load_prompts(jsonl_file, tokenizer)
    from_parquet, dropped_parquet = load_prompts(parquet_file, tokenizer)
    assert from_jsonl == from_parquet
    assert dropped_jsonl == dropped_parquet == 0
    assert [r.index for r in from_jsonl] == [0, 1, 2]
    assert [r.label for r in from_jsonl] == ["2", "red", "hi"]
    assert [r.metadata for r in from_jsonl] == [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    assert from_jsonl[0].prompt == "What is 1 + 1?"


def test_chat_template_applied(jsonl_file, tokenizer):
    records, _ = load_prompts(jsonl_file, tokenizer)
    r = records[0]
    assert r.text == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert r.input_ids == tokenizer(r.text, add_special_tokens=False)["input_ids"]
    # 3 special tokens + one token per byte of the rest.
    assert len(r.input_ids) == 3 + len("user\nWhat is 1 + 1?\n" + "assistant\n")
    assert r.input_ids[0] == 1  # <|im_start|>
    assert r.input_ids.count(2) == 1  # one <|im_end|>, none added at the end


def test_chat_template_not_applied(jsonl_file, tokenizer):
    records, _ = load_prompts(jsonl_file, tokenizer, apply_chat_template=False)
    r = records[0]
    assert r.text == "What is 1 + 1?"
    assert len(r.input_ids) == len("What is 1 + 1?")
    assert r.input_ids == tokenizer("What is 1 + 1?", add_special_tokens=False)["input_ids"]


def test_system_prompt(jsonl_file, tokenizer):
    records, _ = load_prompts(jsonl_file, tokenizer, system_prompt="Be brief.")
    assert records[2].text == chatml(("system", "Be brief."), ("user", "Say hi."))
    assert records[2].text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert records[2].prompt == "Say hi."
    # the conversation the template rendered, for rewards that render it their own way (reward models)
    assert records[2].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    assert load_prompts(jsonl_file, tokenizer, apply_chat_template=False)[0][2].messages is None


def test_system_prompt_without_chat_template_is_an_error(jsonl_file, tokenizer):
    with pytest.raises(ValueError, match="system_prompt needs apply_chat_template=True"):
        load_prompts(jsonl_file, tokenizer, system_prompt="x", apply_chat_template=False)


def test_message_list_prompt_used_as_is(tokenizer):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "U2"},
    ]
    records, _ = build_prompts([(1, {"prompt": messages})], tokenizer, source="mem", system_prompt="ignored")
    assert records[0].prompt == messages
    assert records[0].text == chatml(("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2"))


def test_message_list_without_chat_template_is_an_error(tokenizer):
    rows = [(7, {"prompt": [{"role": "user", "content": "hi"}]})]
    with pytest.raises(ValueError) as exc:
        build_prompts(rows, tokenizer, source="f.jsonl", apply_chat_template=False)
    assert str(exc.value) == "f.jsonl:7: 'prompt' is a list of messages, which needs apply_chat_template=True"


def test_malformed_message_is_an_error(tokenizer):
    with pytest.raises(ValueError, match=r"^f.jsonl:2: message 0 must be an object with 'role' and 'content'$"):
        build_prompts([(2, {"prompt": [{"role": "user"}]})], tokenizer, source="f.jsonl")


def test_prompt_of_wrong_type_is_an_error(tokenizer):
    with pytest.raises(ValueError) as exc:
        build_prompts([(4, {"prompt": 12})], tokenizer, source="f.jsonl")
    assert str(exc.value) == "f.jsonl:4: 'prompt' must be a string or a list of messages, got int"


def test_max_prompt_length_drops_long_prompts(tokenizer):
    rows = [
        (1, {"prompt": "abc"}),
        (2, {"prompt": "abcde"}),
        (3, {"prompt": "abcdef"}),
        (4, {"prompt": "x" * 20}),
    ]
    records, dropped = build_prompts(rows, tokenizer, source="mem", apply_chat_template=False, max_prompt_length=5)
    assert dropped == 2
    assert [r.text for r in records] == ["abc", "abcde"]  # a prompt of exactly the limit is kept
    assert [r.index for r in records] == [0, 1]
    records, dropped = build_prompts(rows, tokenizer, source="mem", apply_chat_template=False)
    assert (len(records), dropped) == (4, 0)


def test_dropped_rows_keep_source_indices(tokenizer):
    rows = [(1, {"prompt": "x" * 9}), (2, {"prompt": "ab"}), (3, {"prompt": "x" * 9}), (4, {"prompt": "cd"})]
    records, dropped = build_prompts(rows, tokenizer, source="mem", apply_chat_template=False, max_prompt_length=4)
    assert dropped == 2
    assert [(r.index, r.text) for r in records] == [(1, "ab"), (3, "cd")]


def test_custom_keys(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "custom.jsonl",
        [json.dumps({"question": "Q?", "answer": 42, "info": {"src": "gsm"}, "prompt": "unused"})],
    )
    records, _ = load_prompts(
        path,
        tokenizer,
        input_key="question",
        label_key="answer",
        metadata_key="info",
        apply_chat_template=False,
    )
    assert records == [
        PromptRecord(
            index=0,
            prompt="Q?",
            text="Q?",
            input_ids=tokenizer("Q?", add_special_tokens=False)["input_ids"],
            label=42,
            metadata={"src": "gsm"},
        )
    ]


def test_label_and_metadata_are_optional(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "bare.jsonl", [json.dumps({"prompt": "p"}), json.dumps({"prompt": "q", "metadata": None})]
    )
    records, _ = load_prompts(path, tokenizer)
    assert [(r.label, r.metadata) for r in records] == [(None, {}), (None, {})]


def test_metadata_must_be_an_object(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "meta.jsonl", [json.dumps({"prompt": "p"}), json.dumps({"prompt": "q", "metadata": [1]})]
    )
    with pytest.raises(ValueError) as exc:
        load_prompts(path, tokenizer)
    assert str(exc.value) == f"{path}:2: 'metadata' must be an object, got list"


def test_missing_input_key(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "missing.jsonl", [json.dumps({"prompt": "p"}), json.dumps({"question": "q"})])
    with pytest.raises(ValueError) as exc:
        load_prompts(path, tokenizer)
    assert str(exc.value) == (f"{path}:2: missing key 'prompt' (set data.input_key to the field that holds the prompt)")


def test_malformed_json_line(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "bad.jsonl", [json.dumps(ROWS[0]), json.dumps(ROWS[1]), '{"prompt": "x",'])
    with pytest.raises(ValueError) as exc:
        load_prompts(path, tokenizer)
    assert str(exc.value) == (
        f"{path}:3: invalid JSON: Expecting property name enclosed in double quotes: line 1 column 16 (char 15)"
    )


@pytest.mark.parametrize(("line", "kind"), [("[1, 2]", "list"), ('"text"', "str"), ("5", "int"), ("null", "null")])
def test_non_object_line(tmp_path, line, kind):
    path = write_jsonl(tmp_path / "nonobj.jsonl", [json.dumps(ROWS[0]), line])
    with pytest.raises(ValueError) as exc:
        list(read_rows(path))
    assert str(exc.value) == f"{path}:2: expected a JSON object, got {kind}"


def test_non_object_in_json_array(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([ROWS[0], [1]]), encoding="utf-8")
    with pytest.raises(ValueError) as exc:
        list(read_rows(path))
    assert str(exc.value) == f"{path}:2: expected a JSON object, got list"


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError) as exc:
        read_rows(path)
    assert str(path) in str(exc.value)


def test_unknown_extension(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt\nhi\n", encoding="utf-8")
    with pytest.raises(ValueError) as exc:
        read_rows(path)
    assert str(exc.value) == f"{path}: unsupported file extension '.csv'; supported: .jsonl, .json, .parquet"


def test_invalid_max_prompt_length(tokenizer):
    with pytest.raises(ValueError, match="max_prompt_length must be >= 1"):
        build_prompts([], tokenizer, source="mem", max_prompt_length=0)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (
            b'{"prompt": "x"}\n',
            "Parquet magic bytes not found in footer. Either the file is corrupted or this is not a parquet file.",
        ),
        (b"", "Parquet file size is 0 bytes"),
    ],
)
def test_a_parquet_file_that_is_not_parquet_is_named(tmp_path, content, why):
    path = tmp_path / "prompts.parquet"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        list(read_rows(path))
    assert str(err.value) == (
        f"{path}: not a Parquet file ({why}); a .parquet file must hold Parquet, as pandas.DataFrame.to_parquet or "
        "pyarrow.parquet.write_table write it (JSON Lines go in a .jsonl file)"
    )
