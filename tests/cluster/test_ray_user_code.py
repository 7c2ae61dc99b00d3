"""User code in Ray actors: a trainer rank imports the run's policy loss (`algo.policy_loss`) in its
own worker process, which gets this process's import path, so a module found here (in the working
directory, on PYTHONPATH, or in a folder a script added) is found there too."""

from __future__ import annotations

import sys

import torch
from conftest import make_samples
from test_ray import no_workers_left

from tidal.cluster.options import ClusterConfig
from tidal.cluster.trainers import rank_env

LOSS = '''
def loss(logp, old_logp, advantages, mask, algo):
    """REINFORCE on the sampled tokens."""
    return -(advantages[:, None] * logp) if advantages.dim() == 1 else -(advantages * logp), {"user_loss": 1.0}
'''


def test_a_rank_gets_the_import_path_as_pythonpath(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setenv("PYTHONPATH", "/opt/extra")
    env = rank_env(ClusterConfig(cpus_per_trainer=2))
    entries = env["PYTHONPATH"].split(":")
    assert entries[0] == str(tmp_path) and entries[-1] == "/opt/extra"
    assert not any(p.startswith(sys.prefix + "/") for p in entries)  # the interpreter's own are its own
    assert env["OMP_NUM_THREADS"] == "2"


def test_a_trainer_rank_loads_a_user_loss_from_a_folder_only_the_driver_has_on_its_path(
    ray_session, tiny_model_dir, tmp_path, monkeypatch
):
    from ray.util.placement_group import remove_placement_group

    from tidal.cluster.ray_setup import placement
    from tidal.cluster.trainers import TrainerGroup
    from tidal.config import build_config

    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / "tidal_test_user_loss.py").write_text(LOSS)
    monkeypatch.setattr(sys, "path", [str(folder), *sys.path])  # as a script's own folder would be
    cfg = build_config(
        None,
        {
            "train.model": str(tiny_model_dir),
            "train.dtype": "float32",
            "train.global_batch_size": 4,
            "train.micro_batch_size": 4,
            "algo.policy_loss": "tidal_test_user_loss:loss",
        },
    )
    group, bundles, _ = placement(cfg.cluster)
    ranks = None
    try:
        # the rank imports the loss as it starts: a rank that could not would fail here, naming it
        ranks = TrainerGroup(
            cfg.cluster, cfg.train, cfg.algo, tiny_model_dir, tiny_model_dir, 1.0, 0, 16, group, bundles
        )
        metrics = ranks.train_step(make_samples(4, seed=1), torch.tensor([1.0, -1.0, 0.5, -0.5]))
        assert metrics["actor/user_loss"] == 1.0  # the user's function computed the step's loss
    finally:
        if ranks is not None:
            ranks.close()
        remove_placement_group(group)
    assert no_workers_left()
