"""PPO's critic on the trainer ranks (`TrainerRank(critic=True)`): two FSDP2 ranks over gloo, each
holding the critic beside its actor, compute the values one process computes, take its value
update (loss, gradient norm, values after), and their checkpoint state resumes in one process;
the same with the two ranks splitting each row's tokens (context parallel)."""

import pytest
import torch
from conftest import fork_ranks, make_samples, rank_store

from tidal.algo.options import AlgoConfig
from tidal.train.critic import Critic
from tidal.train.options import TrainConfig
from tidal.train.update import Sums

TRAIN = TrainConfig(
    global_batch_size=4, max_tokens_per_micro_batch=24, packing=True, lr=1e-3, dtype="float32", max_grad_norm=1.0
)
ALGO = AlgoConfig(advantage="ppo", critic_lr=1e-2)


def batch():
    """8 samples, their returns and the values they were collected with (an earlier critic's)."""
    samples = make_samples(8, seed=5)
    width = max(s.response_length for s in samples)
    returns = torch.linspace(-1.0, 1.0, 8 * width).view(8, width)
    old = 0.1 * torch.cos(torch.arange(8 * width, dtype=torch.float32)).view(8, width)
    return samples, returns, old


def _rank_main(rank: int, world: int, init: str, model_dir: str, out: str, cp: int) -> None:
    from tidal.cluster.trainers import TrainerRank

    tr = TrainerRank(rank, world, init, TRAIN, ALGO, model_dir, model_dir, 0.8, 0, 16, 1, 60, critic=True, cp_size=cp)
    samples, returns, old = batch()
    values = tr.critic_values(samples)
    sums, extra = tr.critic_train_sums(samples, returns, old)
    after = tr.critic_values(samples)
    state = tr.critic_state_dict()
    if rank == 0:
        torch.save({"values": values, "extra": extra, "after": after, "state": state}, out)
    torch.save(sums, f"{out}.sums{rank}")  # each rank's metric sums over its share
    torch.distributed.barrier()
    tr.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp2", "cp2"])
def two_ranks(tiny_model_dir, tmp_path_factory, request):
    cp = request.param
    out = str(tmp_path_factory.mktemp("fsdp_critic") / "rank0.pt")
    store, init = rank_store()
    fork_ranks(_rank_main, 2, (2, init, str(tiny_model_dir), out, cp))
    del store
    result = torch.load(out, weights_only=False)
    result["sums"] = Sums()
    for r in range(2 // cp):  # as `RankCritic.train_step` adds them up: one rank of each dp group
        result["sums"].merge(torch.load(f"{out}.sums{r * cp}", weights_only=False))
    return result


def test_two_ranks_compute_the_values_and_take_the_update_of_one_process(two_ranks, tiny_model_dir):
    critic = Critic(str(tiny_model_dir), TRAIN, ALGO)
    samples, returns, old = batch()
    values = critic.values(samples)
    assert torch.equal(values, torch.zeros_like(values))  # a zero head: the first values are 0
    assert torch.allclose(two_ranks["values"], values, atol=1e-6)
    metrics = critic.train_step(samples, returns, old)
    ranks = {**two_ranks["sums"].mean(), **two_ranks["extra"]}
    for key in ("critic/loss", "critic/clip_frac", "critic/value_mean", "critic/grad_norm"):
        assert ranks[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    after = critic.values(samples)
    assert after.abs().max() > 1e-3  # the update moved the values
    assert torch.allclose(two_ranks["after"], after, atol=1e-6)


def test_the_ranks_critic_state_resumes_in_one_process(two_ranks, tiny_model_dir):
    state = two_ranks["state"]
    critic = Critic(str(tiny_model_dir), TRAIN, ALGO)
    assert set(state["model"]) == set(critic.module.state_dict())
    critic.load_state_dict(state)
    samples, _, _ = batch()
    assert torch.allclose(critic.values(samples), two_ranks["after"], atol=1e-6)
    # the optimizer state came along: one process saves the same keys
    assert set(state["optimizer"]["state"]) == set(critic.state_dict()["optimizer"]["state"])
