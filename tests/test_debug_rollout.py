"""Debug modes: save each step's rollout, replay it with no engine, roll out without training."""

import pytest
import torch
from conftest import loop_config
from transformers import AutoModelForCausalLM

import tidal.loop
from tidal.debug_rollout import load_rollout, save_rollout
from tidal.options import ConfigError
from tidal.samples_log import read_samples
from tidal.train.actor import Actor

# what replaying the same samples from the same weights must reproduce exactly
REPLAYED = ("loss/", "actor/", "reward/", "response/", "advantage/", "rewards/")


def test_replay_of_saved_rollouts_repeats_the_updates_without_an_engine(tiny_model_dir, tmp_path, monkeypatch):
    saved = tmp_path / "rollouts"
    original = tidal.loop.train(
        loop_config(tiny_model_dir, tmp_path / "run", **{"train.num_steps": 3, "debug.save_rollout": str(saved)})
    )
    assert sorted(p.name for p in saved.iterdir() if p.name.endswith(".gz")) == [
        "step_000001.jsonl.gz",
        "step_000002.jsonl.gz",
        "step_000003.jsonl.gz",
    ]

    def no_engine(*args, **kwargs):
        raise AssertionError("replaying saved rollouts must not start an engine")

    monkeypatch.setattr("tidal.adapters.factory.make_engine", no_engine)
    replay = tidal.loop.train(
        loop_config(tiny_model_dir, tmp_path / "replay", **{"train.num_steps": 3, "debug.load_rollout": str(saved)})
    )
    assert len(replay) == len(original) == 3
    for a, b in zip(original, replay, strict=True):
        keys = sorted(k for k in a if k.startswith(REPLAYED))
        assert "loss/pg" in keys and "actor/grad_norm" in keys and "reward/mean" in keys
        assert {k: b[k] for k in keys} == {k: a[k] for k in keys}
    # the replay keeps its samples too, with the weight versions they were generated on
    assert [{r["weight_version"] for r in rows} for rows in read_samples(tmp_path / "replay").values()] == [
        {0},
        {1},
        {2},
    ]


def test_replay_past_the_saved_steps_names_what_is_there(tiny_model_dir, tmp_path):
    saved = tmp_path / "rollouts"
    tidal.loop.train(
        loop_config(tiny_model_dir, tmp_path / "run", **{"train.num_steps": 1, "debug.save_rollout": str(saved)})
    )
    cfg = loop_config(tiny_model_dir, tmp_path / "replay", **{"train.num_steps": 2, "debug.load_rollout": str(saved)})
    with pytest.raises(FileNotFoundError, match=r"step_000002\.jsonl\.gz does not exist; .* holds steps 1\.\.1"):
        tidal.loop.train(cfg)


def test_saved_samples_round_trip_exactly(tmp_path):
    from conftest import make_samples

    samples = make_samples(n=3)
    samples[0].reward = {"score": 1.0, "parts": [1, 2]}
    samples[1].metadata = {"turns": 2}
    save_rollout(tmp_path, 5, samples, {"dynamic_sampling/rounds": 2.0})
    loaded, metrics = load_rollout(tmp_path, 5)
    assert [s.to_dict() for s in loaded] == [s.to_dict() for s in samples]
    assert metrics == {"dynamic_sampling/rounds": 2.0}
    samples[2].metadata = {"x": object()}
    with pytest.raises(TypeError, match="debug.save_rollout: step 6: a sample field is not JSON-serialisable"):
        save_rollout(tmp_path, 6, samples, {})


def test_rollout_only_keeps_samples_and_never_trains(tiny_model_dir, tmp_path, monkeypatch):
    roles = {}
    real_build = tidal.loop.build_roles

    def keep(*args, **kwargs):
        roles["r"] = real_build(*args, **kwargs)
        return roles["r"]

    def no_training(*args, **kwargs):
        raise AssertionError("rollout_only must not train")

    monkeypatch.setattr(tidal.loop, "build_roles", keep)
    monkeypatch.setattr(Actor, "train_step", no_training)
    history = tidal.loop.train(
        loop_config(tiny_model_dir, tmp_path / "run", **{"train.num_steps": 2, "debug.rollout_only": True})
    )
    assert [h["step"] for h in history] == [1, 2]
    assert "reward/mean" in history[0] and "loss/pg" not in history[0]
    kept = read_samples(tmp_path / "run")
    assert sorted(kept) == [1, 2] and all(len(rows) == 16 for rows in kept.values())
    assert {r["weight_version"] for rows in kept.values() for r in rows} == {0}  # never synced
    assert not (tmp_path / "run" / "checkpoints").exists()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    after = roles["r"].trainer.model.state_dict()
    assert all(torch.equal(after[k], initial[k]) for k in initial)


def test_debug_options_are_checked_up_front(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError) as e:
        loop_config(
            tiny_model_dir,
            tmp_path,
            **{"debug.rollout_only": True, "debug.load_rollout": str(tmp_path / "none"), "log.wandb_mode": "cloud"},
        )
    msg = str(e.value)
    assert "debug.rollout_only: cannot replay saved rollouts (load_rollout)" in msg
    assert f"debug.load_rollout: {str(tmp_path / 'none')!r} is not a folder" in msg
    assert "log.wandb_mode: offline or online, got 'cloud'" in msg
