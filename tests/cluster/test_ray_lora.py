"""LoRA on Ray: engine actors get the merged adapters by broadcast, the whole model once, then only
the targeted matrices, each push checked, and they sample what the trainer scores."""

from conftest import loop_config

import tidal.loop


def test_lora_on_ray_engines_broadcasts_only_the_merged_matrices(ray_session, tiny_model_dir, tmp_path):
    from conftest import make_model

    over = {
        "cluster.trainers": 1,
        "cluster.engines": 2,
        "train.lora_rank": 4,
        "train.lora_alpha": 8.0,
        "train.lr": 1e-2,
        "train.num_steps": 2,
        "train.global_batch_size": 16,  # one optimizer step per rollout
    }
    history = tidal.loop.train(loop_config(tiny_model_dir, tmp_path, **over))
    proj = sum(p.numel() for n, p in make_model().named_parameters() if n.endswith("_proj.weight"))
    # the run's first push (version 0) was whole; each step's then moved the 14 merged matrices
    assert [h["sync/tensors"] for h in history] == [14.0, 14.0]
    assert [h["sync/bytes"] for h in history] == [proj * 4.0] * 2
    # the engines sampled with the weights the trainer scored them with (fp32)
    assert all(h["actor/rollout_logprob_abs_diff"] < 1e-4 for h in history)
    assert all(h["actor/grad_norm"] > 0 for h in history)
