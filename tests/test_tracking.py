"""wandb tracking in offline mode: the values logged per step are in the offline run's files."""

import struct
import sys
import time
from types import SimpleNamespace

import pytest

from tidal.log import MetricsLogger
from tidal.tracking import open_tracker


def _wandb_records(path):
    """The protobuf records of a `.wandb` file: a 7-byte header, then LevelDB-log-style chunks
    (crc32, length, type) in 32 KiB blocks; FIRST/MIDDLE/LAST chunks make up one record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # still being written
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def _history(run_dir, timeout=60.0):
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    # wandb's writer is a separate process: on a busy machine the last records land just after
    # run.finish() returns; the run is complete once its exit record is in the file
    deadline = time.monotonic() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(path)):
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout} s"
        time.sleep(0.2)
    rows = {}
    for r in _wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: i.value_json for i in r.history.item}
            rows[r.history.step.num] = {k: float(v) for k, v in items.items() if not k.startswith("_")}
    return rows


def _cfg(**kw):
    return SimpleNamespace(**{"wandb": True, "wandb_project": "tidal-test", "wandb_mode": "offline", **kw})


def test_offline_wandb_run_holds_the_logged_values(tmp_path):
    pytest.importorskip("wandb", reason="wandb is the optional extra tidal[wandb]")
    tracker = open_tracker(_cfg(), tmp_path, {"train": {"lr": 1e-5}})
    with MetricsLogger(tmp_path, tensorboard=False, console=False, tracker=tracker) as logger:
        logger.log(1, {"reward/mean": 0.25, "loss/pg": float("nan")})
        logger.log(2, {"reward/mean": 0.75, "loss/pg": -0.5})
    # NaN is left out, as in TensorBoard; metrics.jsonl keeps it as null
    assert _history(tmp_path) == {1: {"reward/mean": 0.25}, 2: {"reward/mean": 0.75, "loss/pg": -0.5}}
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert (tmp_path / "wandb" / "latest-run").resolve().name.endswith(run_id)


def test_tracker_off_or_missing_package(tmp_path, monkeypatch):
    assert open_tracker(_cfg(wandb=False), tmp_path, {}) is None
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(RuntimeError, match=r"log.wandb: true needs the wandb package: pip install 'tidal\[wandb\]'"):
        open_tracker(_cfg(), tmp_path, {})
    assert not (tmp_path / "wandb_run_id").exists()
