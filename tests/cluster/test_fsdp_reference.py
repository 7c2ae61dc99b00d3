"""The reference and the teacher on trainer ranks are sharded like the policy (FSDP2): each of two
ranks holds half of their weights, and their log-probs (and the KL loss of a step) are one
process's."""

import pytest
import torch
from conftest import fork_ranks, make_model, make_samples, rank_store

from tidal.algo.options import AlgoConfig
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig

TRAIN = TrainConfig(
    global_batch_size=4, max_tokens_per_micro_batch=24, packing=True, lr=1e-2, dtype="float32", max_grad_norm=1.0
)
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])


def algo(teacher: str) -> AlgoConfig:
    return AlgoConfig(kl_coef=0.1, teacher=teacher)


def _rank_main(rank: int, world: int, init: str, model_dir: str, teacher: str, out: str) -> None:
    from tidal.cluster.trainers import TrainerRank

    tr = TrainerRank(rank, world, init, TRAIN, algo(teacher), model_dir, model_dir, 0.8, 0, 16, 1, 60)
    samples = make_samples(8, seed=3)
    sums, _ = tr.train_sums(samples, ADV, None, None)
    frozen = {"ref": tr.actor.ref, "teacher": tr.actor.teacher}
    result = {
        "sums": sums,
        "reference": tr.compute_log_probs(samples, "reference"),
        "teacher": tr.compute_log_probs(samples, "teacher"),
        "policy": tr.compute_log_probs(samples, "policy"),
        # parameters this rank holds of each frozen model
        "held": {k: sum(p.to_local().numel() for p in m.parameters()) for k, m in frozen.items()},
    }
    torch.save(result, f"{out}.{rank}")
    torch.distributed.barrier()
    tr.close()


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_ref")
    teacher = tmp / "teacher"
    make_model(seed=1).save_pretrained(teacher)
    out = str(tmp / "rank")
    store, init = rank_store()
    fork_ranks(_rank_main, 2, (2, init, str(tiny_model_dir), str(teacher), out))
    del store
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)], str(teacher)


def test_each_rank_holds_half_of_the_reference_and_the_teacher(two_ranks):
    ranks, _ = two_ranks
    whole = sum(p.numel() for p in make_model().parameters())
    for key in ("ref", "teacher"):
        held = [r["held"][key] for r in ranks]
        assert sum(held) == whole  # FSDP2 splits every tensor along its first dimension
        assert max(held) <= 0.55 * whole


def test_their_log_probs_and_the_kl_step_are_one_process(two_ranks, tiny_model_dir):
    ranks, teacher = two_ranks
    actor = Actor(str(tiny_model_dir), TRAIN, algo(teacher), 0.8, 0, str(tiny_model_dir), 16)
    samples = make_samples(8, seed=3)
    metrics = actor.train_step(samples, ADV)
    rank_metrics = ranks[0]["sums"]
    rank_metrics.merge(ranks[1]["sums"])
    assert rank_metrics.mean()["loss/kl"] == pytest.approx(metrics["loss/kl"], rel=1e-5, abs=1e-8)
    for which in ("reference", "teacher", "policy"):
        one = actor.compute_log_probs(samples, which)
        for r in ranks:  # every rank ends with the whole batch's
            assert torch.allclose(r[which], one, atol=1e-5), which
    # the step moved the policy away from the reference: the comparison is not of equal models
    assert (ranks[0]["policy"] - ranks[0]["reference"]).abs().max() > 1e-3
