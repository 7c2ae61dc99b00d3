"""The start-up line saying what trains: full fine-tuning or LoRA, parameters trained of the
total, precision and device (`tidal.train.actor.describe_training`)."""

import json

import torch
from conftest import make_model, make_samples

from tidal.algo.options import AlgoConfig
from tidal.train.actor import Actor, count_text
from tidal.train.options import TrainConfig

# the tiny Llama: 320 x 64 tied embeddings, 2 layers of q (64x64), k and v (64x32), o (64x64),
# gate, up and down (64x128 each) and two norms, and the final norm
TOTAL = 320 * 64 + 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64


def actor(dtype="float32", **train):
    cfg = TrainConfig(micro_batch_size=4, global_batch_size=8, lr=1e-3, dtype=dtype, **train)
    return Actor(make_model(seed=0), cfg, AlgoConfig())


def test_count_text():
    assert [count_text(n) for n in (950, 4_600, 1_234_567, 134_515_008, 1_700_000_000)] == [
        "950",
        "4.6K",
        "1.23M",
        "135M",
        "1.7B",
    ]


def test_full_fine_tuning():
    assert TOTAL == 94_528
    assert actor().describe() == "trains all 94.5K parameters (full fine-tuning), fp32 weights and compute, on cpu"
    assert actor("bfloat16").describe().endswith("(full fine-tuning), fp32 master weights, bf16 compute, on cpu")


def test_lora_names_rank_targets_and_the_share_trained():
    got = actor("bfloat16", lora_rank=4, lora_alpha=8.0, lora_target_modules=["q_proj", "v_proj"]).describe()
    # per layer: q gets A 4x64 + B 64x4, v gets A 4x64 + B 32x4
    assert 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4) == 1792
    assert got == (
        "trains 1.79K of 94.5K parameters (LoRA r=4, alpha 8, on q_proj, v_proj; the base weights frozen), "
        "fp32 master weights, bf16 compute, on cpu"
    )
    every = actor(lora_rank=4).describe()
    assert "on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj;" in every


def test_a_lora_checkpoint_on_named_targets_saves(tmp_path):
    a = actor(lora_rank=4, lora_target_modules=["q_proj", "v_proj"])
    a.train_step(make_samples(), torch.ones(8))
    a.save_model(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["r"] == 4
