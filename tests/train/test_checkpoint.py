import json

import pytest
import torch
from conftest import make_model

from tidal.train import checkpoint as ckpt


def test_save_load_round_trip(tmp_path):
    model = make_model()
    path = ckpt.save_checkpoint(
        tmp_path, 5, model.save_pretrained, None, {"optimizer": {"x": torch.ones(2)}}, {"data": {"epoch": 1}}
    )
    assert path == tmp_path / "checkpoints" / "step_5"
    assert ckpt.latest_checkpoint(tmp_path) == path
    trainer_state, state = ckpt.load_checkpoint(path)
    assert state == {"data": {"epoch": 1}, "step": 5}
    assert torch.equal(trainer_state["optimizer"]["x"], torch.ones(2))


def test_rng_state_is_restored(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, make_model().save_pretrained, None, {}, {})
    expected = torch.rand(3)
    ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))
    assert torch.equal(torch.rand(3), expected)


def test_a_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = make_model()
    ckpt.save_checkpoint(tmp_path, 2, model.save_pretrained, None, {}, {"data": {}})

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, 4, model.save_pretrained, None, {}, {"data": {}})
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]  # no half-written step_4
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_2"
    assert json.loads((root / "step_2" / "state.json").read_text())["step"] == 2


def test_latest_pointing_at_a_missing_folder_is_an_error(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_9\n")
    with pytest.raises(FileNotFoundError, match="names step_9, which is missing or incomplete"):
        ckpt.latest_checkpoint(tmp_path)
    assert ckpt.latest_checkpoint(tmp_path / "nothing") is None
