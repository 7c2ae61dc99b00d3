"""Mistakes a new user makes at the start of a run, each named before any training happens."""

import shutil

import pytest
from conftest import loop_config, make_tokenizer

import tidal.loop
from tidal.convert import load_tokenizer
from tidal.options import ConfigError
from tidal.train.actor import Actor


def test_a_model_folder_without_tokenizer_is_named(tiny_model_dir, tmp_path):
    model = tmp_path / "weights_only"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, model / name)
    expected = (
        f"model folder {model} has no tokenizer: expected tokenizer.json (or tokenizer.model, or vocab.json with "
        "merges.txt) and tokenizer_config.json, as `tokenizer.save_pretrained(folder)` writes them; copy them from "
        "the model this one was trained from"
    )
    with pytest.raises(FileNotFoundError) as err:
        tidal.loop.train(loop_config(model, tmp_path / "run"))
    assert str(err.value) == expected
    assert not (tmp_path / "run").exists()  # nothing written
    assert load_tokenizer(tiny_model_dir).encode("ab") == make_tokenizer().encode("ab")  # with one: as before


def test_a_dict_reward_without_reward_key_stops_before_any_training(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "parts.py").write_text("def reward(sample):\n    return {'correct': 1.0, 'short': 0.0}\n")
    trained = []
    monkeypatch.setattr(Actor, "train_step", lambda self, *a: trained.append(1))
    cfg = loop_config(tiny_model_dir, tmp_path / "run", **{"reward.fn": f"{tmp_path / 'parts.py'}:reward"})
    with pytest.raises(ConfigError, match=r"^reward.key: the reward returned a dict without the key 'score' "):
        tidal.loop.train(cfg)
    assert trained == []
    assert not (tmp_path / "run" / "checkpoints").exists()
