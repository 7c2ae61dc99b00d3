"""A trainer rank that dies or stops during a train step (two FSDP2 ranks on Ray, tiny model) is
named, with its node and pid, and the healthy rank's gloo error says what it was waiting in:
not Ray's bare ActorDiedError, nor a gloo receive timeout that names nobody."""

import os
import re
import signal
from pathlib import Path

import pytest
import torch
from conftest import make_samples
from test_ray import no_workers_left

COLLECTIVE_TIMEOUT = 15  # cluster.sync_timeout: how long the healthy rank waits in a collective


def trainer_group(model_dir: Path):
    from tidal.cluster.ray_setup import placement
    from tidal.cluster.trainers import TrainerGroup
    from tidal.config import build_config

    cfg = build_config(
        None,
        {
            "train.model": str(model_dir),
            "train.dtype": "float32",
            "train.global_batch_size": 8,
            "train.micro_batch_size": 4,
            "cluster.trainers": 2,
            "cluster.sync_timeout": COLLECTIVE_TIMEOUT,
        },
    )
    group, bundles, _ = placement(cfg.cluster)
    try:
        ranks = TrainerGroup(cfg.cluster, cfg.train, cfg.algo, model_dir, model_dir, 1.0, 0, 16, group, bundles)
    except BaseException:
        _remove(group)
        raise
    return ranks, group


def _remove(group) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_trainer_rank_that_dies_or_stops_is_named_with_its_node_and_pid(ray_session, tiny_model_dir, fault):
    from tidal.cluster.ranks import TrainerRankError

    ranks, group = trainer_group(tiny_model_dir)
    stopped = None
    try:
        node, pid = ranks.where[1]
        assert pid != os.getpid() and ranks.where[0][1] != pid
        samples = make_samples(8, seed=3)
        if fault == "kill":
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            stopped = pid
        with pytest.raises(TrainerRankError) as err:
            ranks.train_step(samples, torch.ones(8))
        msg = str(err.value)
        assert err.value.rank == 1
        named = f"trainer rank 1 (node {node}, pid {pid})"
        if fault == "kill":
            # with the exit Ray recorded, when Ray reported the death before /proc showed it
            died = rf"{re.escape(named)} died during a train step \(its process is gone(; Ray: \w+: [^;]+)?\)"
            assert re.match(died, msg), msg
        else:
            assert msg.startswith(f"{named} stopped during a train step (its process is stopped"), msg
        # the healthy rank's collective error, translated: which collective, where in tidal, and why
        assert re.search(r"; rank 0 was waiting for it in \w+ \(tidal/[\w/]+\.py:\d+ in \w+\): ", msg), msg
        if fault == "stop":  # what it waited for is the collective timeout, and the key that sets it
            assert "Timed out waiting" in msg
            assert msg.endswith(f"the trainers' collectives wait at most {COLLECTIVE_TIMEOUT} s (cluster.sync_timeout)")
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        ranks.close()
        _remove(group)
    assert no_workers_left()
