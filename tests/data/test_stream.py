"""Streamed prompts (`data.streaming`): every row once per epoch, exact resume with the shuffle
buffer's contents, the same prompts as the in-memory loader, errors naming file and line."""

import json

import pytest

from tidal.data.load import load_data, prompt_options, prompt_source
from tidal.data.options import DataConfig
from tidal.data.source import DataSource
from tidal.data.stream import StreamingSource

OPTIONS = prompt_options(DataConfig(max_prompt_length=256))


def write_jsonl(path, n, blank_every=0):
    with path.open("w") as f:
        for i in range(n):
            if blank_every and i % blank_every == 0:
                f.write("\n")  # blank lines are skipped but counted in line numbers
            f.write(json.dumps({"prompt": f"question {i}", "label": str(i), "metadata": {"i": i}}) + "\n")
    return path


def write_parquet(path, n, row_group_size=7):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"question {i}", "label": str(i), "metadata": {"i": i}} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


@pytest.fixture(params=["jsonl", "parquet"])
def data_file(request, tmp_path):
    if request.param == "jsonl":
        return write_jsonl(tmp_path / "prompts.jsonl", 50, blank_every=9)
    return write_parquet(tmp_path / "prompts.parquet", 50)


def key(r):
    return (r.index, r.text, tuple(r.input_ids), r.label, json.dumps(r.metadata))


def test_every_row_once_per_epoch_in_a_new_order(data_file, tokenizer):
    src = StreamingSource(data_file, tokenizer, 7, OPTIONS, shuffle=True, seed=3, buffer_size=8)
    stream = [r.index for _ in range(22) for r in src.next_batch()]  # 154: batches straddle epochs
    orders = [stream[:50], stream[50:100], stream[100:150]]
    for order in orders:
        assert sorted(order) == list(range(50))
    assert orders[0] != list(range(50)) and orders[0] != orders[1] != orders[2]
    # a row moves at most buffer_size - 1 places earlier than its place in the file
    assert all(pos >= idx - 7 for pos, idx in enumerate(orders[0]))
    assert src.epoch == 3 and src.samples_consumed == 154
    # rows carry their label and metadata; index is the row's position in the file
    r = src.next_batch()[0]
    assert (r.label, r.metadata) == (str(r.index), {"i": r.index})


def test_without_shuffle_the_stream_is_the_in_memory_loaders_records_in_order(data_file, tokenizer):
    one_digit = load_data(DataConfig(path=str(data_file)), tokenizer)[0]
    # rows 10.. have a two-digit number, one token more: all dropped as over-long
    cfg = DataConfig(path=str(data_file), shuffle=False, max_prompt_length=len(one_digit.input_ids))
    eager = DataSource(load_data(cfg, tokenizer), 7, shuffle=False)
    streamed = StreamingSource(data_file, tokenizer, 7, prompt_options(cfg), shuffle=False)
    want = [key(r) for _ in range(12) for r in eager.next_batch()]
    got = [key(r) for _ in range(12) for r in streamed.next_batch()]
    assert got == want
    assert {k[0] for k in want} == set(range(10))
    assert streamed.epoch == eager.epoch


@pytest.mark.parametrize("cut", [0, 1, 3, 8, 9, 16])  # 8 x 6 = 48: just before an epoch ends, 9 straddles it
@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_yields_exactly_the_uninterrupted_batches(data_file, tokenizer, cut, shuffle):
    def make():
        return StreamingSource(data_file, tokenizer, 6, OPTIONS, shuffle=shuffle, seed=1, buffer_size=10)

    full = make()
    want = [[key(r) for r in full.next_batch()] for _ in range(20)]

    first = make()
    got = [[key(r) for r in first.next_batch()] for _ in range(cut)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    assert len(state["buffer"]) <= 10  # references to the buffered rows, not the rows
    resumed = StreamingSource(data_file, tokenizer, 6, OPTIONS, shuffle=not shuffle, seed=99, buffer_size=3)
    resumed.load_state_dict(state)  # the checkpoint's order settings win over the constructor's
    got += [[key(r) for r in resumed.next_batch()] for _ in range(20 - cut)]
    assert got == want
    assert (resumed.epoch, resumed.samples_consumed) == (full.epoch, full.samples_consumed)


def test_resume_refuses_a_changed_file_or_the_other_kind_of_source(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", 20)
    src = StreamingSource(path, tokenizer, 4, OPTIONS)
    src.next_batch()
    state = src.state_dict()
    write_jsonl(path, 21)
    with pytest.raises(ValueError, match=r"p.jsonl has \d+ bytes, the checkpoint's file had \d+"):
        StreamingSource(path, tokenizer, 4, OPTIONS).load_state_dict(state)
    eager = DataSource(load_data(DataConfig(path=str(path)), tokenizer), 4)
    with pytest.raises(ValueError, match="in-memory data source from a checkpoint of a streamed one"):
        eager.load_state_dict(state)
    with pytest.raises(ValueError, match="streamed data source from a checkpoint of an in-memory one"):
        StreamingSource(path, tokenizer, 4, OPTIONS).load_state_dict(eager.state_dict())


def test_bad_rows_are_named_by_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "hi"})
    path.write_text("\n".join([good, "", good, '{"prompt": "cut', good]) + "\n")
    src = StreamingSource(path, tokenizer, 1, OPTIONS, shuffle=False)
    src.next_batch()
    with pytest.raises(ValueError, match=r"bad.jsonl:4: invalid JSON: Unterminated string"):
        src.next_batch()  # the one-row buffer reads line 4 as line 3's row is handed out
    path.write_text("\n".join([good, good, json.dumps({"question": "hi"})]) + "\n")
    src = StreamingSource(path, tokenizer, 1, OPTIONS, shuffle=False)
    with pytest.raises(ValueError, match=r"bad.jsonl:3: missing key 'prompt' \(set data.input_key"):
        src.next_batch(3)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected a JSON object, got list"):
        StreamingSource(path, tokenizer, 1, OPTIONS)
    path.write_bytes(good.encode() + b"\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not UTF-8"):
        StreamingSource(path, tokenizer, 1, OPTIONS)
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    with pytest.raises(ValueError, match=r"fake.parquet: not a Parquet file"):
        StreamingSource(fake, tokenizer, 1, OPTIONS)
    path.write_text(json.dumps({"prompt": "x" * 400}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: all 1 prompts are longer than data.max_prompt_length \("):
        StreamingSource(path, tokenizer, 1, OPTIONS).next_batch()


def test_prompt_source_picks_the_streamed_reader(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", 5)
    assert isinstance(prompt_source(DataConfig(path=str(path), streaming=True), tokenizer, 2), StreamingSource)
    assert isinstance(prompt_source(DataConfig(path=str(path)), tokenizer, 2), DataSource)


def test_a_streamed_run_resumed_after_a_crash_matches_an_uninterrupted_one(tiny_model_dir, tmp_path, monkeypatch):
    from conftest import loop_config, train_killed

    import tidal.loop

    path = write_jsonl(tmp_path / "p.jsonl", 10)  # 4 steps x 4 prompts: the stream wraps past an epoch
    over = {
        "data.path": str(path),
        "data.streaming": True,
        "data.shuffle_buffer": 5,
        "train.save_interval": 2,
    }
    full = tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "full", **over))
    cut = loop_config(tiny_model_dir, tmp_path / "cut", **over)
    train_killed(cut, monkeypatch)
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["data"]["streaming"] and state["data"]["samples_consumed"] == 8
    resumed = tidal.loop.train(cut, resume=True)  # from step_2, mid-epoch with a part-drained buffer

    def stable(history):
        return [{k: v for k, v in h.items() if not k.startswith(("time/", "perf/"))} for h in history]

    assert stable(resumed) == stable(full)
    assert [h["data/epoch"] for h in full] == [0.0, 0.0, 1.0, 1.0]
    assert len({h["reward/mean"] for h in full}) > 1
