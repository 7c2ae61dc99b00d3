"""Samples kept per step: atomic gzip JSONL files, read back exactly, a few lines on the console."""

import gzip
import logging

import pytest
import torch
from conftest import make_samples

from tidal.samples_log import (
    read_jsonl_gz,
    read_samples,
    record_step,
    sample_records,
    saved_steps,
    step_path,
    write_jsonl_gz,
)
from tidal.types import Status


def _batch():
    samples = make_samples(n=4, group=2)
    texts = ["What is 2+2?", "What is 3+5?"]
    for i, s in enumerate(samples):
        s.prompt, s.response = texts[i // 2], f"answer {i} ünïcode"
        s.group_index, s.weight_version = i // 2, 7
        s.reward = {"score": float(i % 2), "format": 0.5}
    samples[3].status = Status.FAILED
    samples[3].metadata["error"] = "ValueError: boom"
    return samples


def test_round_trip_of_a_step(tmp_path, caplog):
    samples = _batch()
    rewards = torch.tensor([0.0, 1.0, 0.0, float("nan")])
    # per-token advantages, zero-padded past each response: the record keeps the mean over the response
    width = max(s.response_length for s in samples)
    adv = torch.zeros(4, width)
    for i, s in enumerate(samples):
        adv[i, : s.response_length] = torch.linspace(0, 2 * (i - 1.5), s.response_length)
    with caplog.at_level(logging.INFO, logger="tidal"):
        path = record_step(tmp_path, 12, samples, rewards, adv, show=2)
    assert path == tmp_path / "samples" / "step_000012.jsonl.gz"
    rows = read_samples(tmp_path)[12]
    assert rows == sample_records(12, samples, rewards, adv)
    assert [r["index"] for r in rows] == [s.index for s in samples]
    first = rows[1]
    assert first["prompt"] == "What is 2+2?" and first["response"] == "answer 1 ünïcode"
    assert first["reward"] == 1.0 and first["reward_parts"] == {"score": 1.0, "format": 0.5}
    assert first["weight_version"] == 7 and first["group"] == 0 and first["step"] == 12
    assert first["response_length"] == samples[1].response_length
    assert first["prompt_length"] == len(samples[1].tokens) - samples[1].response_length
    assert first["advantage"] == pytest.approx((2 * (1 - 1.5)) / 2)  # mean of a linspace from 0
    assert rows[3]["status"] == "failed" and rows[3]["error"] == "ValueError: boom"
    assert rows[3]["metadata"] == {"error": "ValueError: boom"} and rows[0]["metadata"] == {}
    assert rows[3]["reward"] is None  # NaN is not JSON
    shown = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sample ")]
    assert len(shown) == 2
    assert shown[1].startswith("sample 12.1 (reward 1.00, adv -0.50, completed") and "v7" in shown[1]


def test_steps_listed_and_read_by_number(tmp_path):
    for step in (3, 1, 10):
        record_step(tmp_path, step, _batch())
    (tmp_path / "samples" / ".step_000011.jsonl.gz.abc.tmp").write_bytes(b"half")  # a killed write
    assert saved_steps(tmp_path / "samples") == [1, 3, 10]
    assert list(read_samples(tmp_path, [10])) == [10]
    # without rewards, the record takes the sample's own (dict) reward through reward_key
    assert [r["reward"] for r in read_samples(tmp_path)[3]] == [0.0, 1.0, 0.0, 1.0]
    assert record_step(tmp_path, 4, _batch(), save=False) is None
    assert not step_path(tmp_path / "samples", 4).exists()


def test_writes_replace_whole_files_and_bad_files_name_themselves(tmp_path):
    path = tmp_path / "x.jsonl.gz"
    write_jsonl_gz(path, [{"a": 1}, {"a": 2}])
    write_jsonl_gz(path, [{"a": 3}])
    assert read_jsonl_gz(path) == [{"a": 3}]
    assert [p.name for p in tmp_path.iterdir()] == ["x.jsonl.gz"]  # no temp file left
    with pytest.raises(TypeError):
        write_jsonl_gz(path, [{"a": {1, 2}}], strict=True)
    assert read_jsonl_gz(path) == [{"a": 3}]  # the failed write touched nothing
    write_jsonl_gz(path, [{"a": {1}}])  # display records fall back to str()
    assert read_jsonl_gz(path) == [{"a": "{1}"}]

    path.write_bytes(b"plain text")
    with pytest.raises(ValueError, match=r"x\.jsonl\.gz: not a gzip-compressed JSONL file"):
        read_jsonl_gz(path)
    path.write_bytes(gzip.compress(b'{"a": 1}\n{"a": \n'))
    with pytest.raises(ValueError, match=r"x\.jsonl\.gz:2: not valid JSON"):
        read_jsonl_gz(path)
    path.write_bytes(gzip.compress(b"[1]\n"))
    with pytest.raises(ValueError, match=r"x\.jsonl\.gz:1: expected a JSON object, got list"):
        read_jsonl_gz(path)


def test_missing_reward_key_gives_nan_record_not_a_crash():
    s = _batch()[0]
    s.reward = {"format": 1.0}
    (rec,) = sample_records(1, [s], reward_key="score")
    assert rec["reward"] is None and rec["reward_parts"] == {"format": 1.0}
    assert rec["advantage"] is None
