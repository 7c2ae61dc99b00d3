"""Tensor parallelism on trainer ranks (`cluster.tp_size`, `tidal.train.parallel`): two ranks that
split every layer (TP 2), and four as TP 2 × DP 2, take the step one process takes (losses with
the KL term, gradient norm, updated weights, the reference's and policy's log-probs), each rank
holding its part of each split matrix."""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import make_samples

from tidal.algo.options import AlgoConfig
from tidal.options import ConfigError
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig
from tidal.train.update import Sums

TRAIN = TrainConfig(
    global_batch_size=4, max_tokens_per_micro_batch=24, packing=True, lr=1e-3, dtype="float32", max_grad_norm=1.0
)
ALGO = AlgoConfig(kl_coef=0.1)
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copied(weights: dict | None) -> dict | None:
    """A copy: with one dp rank a whole tensor needs no gather and may be the parameter itself."""
    return None if weights is None else {k: v.clone() for k, v in weights.items()}


def _rank_main(rank: int, world: int, tp: int, init: str, model_dir: str, out: str) -> None:
    from tidal.cluster.trainers import TrainerRank

    tr = TrainerRank(rank, world, init, TRAIN, ALGO, model_dir, model_dir, 0.8, 0, 16, 1, 120, tp_size=tp)
    samples = make_samples(8, seed=3)
    sums, extra = tr.train_sums(samples, ADV, None, None)
    q = tr.actor.model.model.layers[0].self_attn.q_proj.weight
    head = tr.actor.model.lm_head
    # the last optimizer step's (clipped) gradients, gathered: a collective, every rank takes part
    grads = {n: p.grad.full_tensor() for n, p in tr.actor.model.named_parameters()}
    result = {
        "grads": grads,
        "sums": sums,
        "extra": extra,
        "policy": tr.compute_log_probs(samples, "policy"),
        "reference": tr.compute_log_probs(samples, "reference"),
        "weights": copied(tr.full_weights(None)),
        "q_held": q.to_local().numel(),
        "q_placements": [str(p) for p in q.placements],
        "vocab": (tr.actor.trained.vocab.start, tr.actor.trained.vocab.size),  # its slice of the logits
        "head_placements": len(head.weight.placements),
        "tied": head.weight is tr.actor.model.model.embed_tokens.weight,
        "state": tr.state_dict(),  # the optimizer state, full tensors by name (a collective)
    }
    tr.train_sums(samples, -ADV, None, None)  # the run continues on its mesh
    result["weights2"] = copied(tr.full_weights(None))
    torch.save(result, f"{out}.{rank}")
    torch.distributed.barrier()
    tr.close()


@pytest.fixture(scope="module")
def run_ranks(tmp_path_factory, tiny_model_dir):
    """`run_ranks(world, tp)`: each rank's results, the ranks run once per layout."""
    done: dict[tuple[int, int], list[dict]] = {}

    def run(world: int, tp: int) -> list[dict]:
        if (world, tp) not in done:
            out = str(tmp_path_factory.mktemp(f"tp{tp}x{world // tp}") / "rank")
            args = (world, tp, f"tcp://127.0.0.1:{_port()}", str(tiny_model_dir), out)
            mp.spawn(_rank_main, args=args, nprocs=world, join=True)
            done[world, tp] = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
        return done[world, tp]

    return run


@pytest.fixture(scope="module")
def single(tiny_model_dir):
    actor = Actor(str(tiny_model_dir), TRAIN, ALGO, 0.8, 0, str(tiny_model_dir), 16)
    samples = make_samples(8, seed=3)
    metrics = actor.train_step(samples, ADV)
    return {
        "metrics": metrics,
        "grads": {n: p.grad.clone() for n, p in actor.model.named_parameters()},
        "policy": actor.compute_log_probs(samples, "policy"),
        "reference": actor.compute_log_probs(samples, "reference"),
        "weights": dict(actor.named_weights()),
    }


@pytest.mark.parametrize(("world", "tp"), [(2, 2), (4, 2)], ids=["tp2", "tp2xdp2"])
def test_tensor_parallel_ranks_take_the_single_process_step(run_ranks, single, world, tp):
    ranks = run_ranks(world, tp)
    sums = Sums()
    for r in ranks[::tp]:  # one rank of each dp group: its tp ranks computed the same sums
        sums.merge(r["sums"])
    got = {**sums.mean(), **ranks[0]["extra"]}
    for key in ("loss/pg", "loss/kl", "actor/grad_norm"):
        assert got[key] == pytest.approx(single["metrics"][key], rel=1e-4, abs=1e-6), key
    for name, g in single["grads"].items():
        assert torch.allclose(ranks[0]["grads"][name], g, atol=1e-6, rtol=1e-5), name
    # AdamW divides each gradient by its own running scale, so where a gradient is near zero the
    # float-order noise of the split sums (1e-7 relative) reaches the update: up to 7.4e-6 of one
    # element at lr 1e-3
    for name, w in single["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][name], w, atol=1e-5, rtol=1e-5)
    for which in ("policy", "reference"):
        for r in ranks:
            assert torch.allclose(r[which], single[which], atol=1e-5), which
    # q_proj's rows (its heads) split over tp, then over dp by FSDP2
    whole = single["weights"]["model.layers.0.self_attn.q_proj.weight"].numel()
    assert all(r["q_held"] == whole // world for r in ranks)
    assert len(ranks[0]["q_placements"]) == 2  # one placement per mesh dimension: dp and tp
    # the output projection (tied to the embedding, still one parameter) split by vocabulary rows
    # over tp: a rank computes 160 of the 320 logits
    assert [r["vocab"] for r in ranks] == [(160 * (i % tp), 160) for i in range(world)]
    assert all(r["tied"] and r["head_placements"] == 2 for r in ranks)


def test_a_family_with_another_split_is_refused_naming_it():
    from families import tiny_model

    from tidal.train.parallel import tp_plan

    with pytest.raises(ConfigError) as e:
        tp_plan(tiny_model("qwen3"))
    assert str(e.value) == (
        "cluster.tp_size: qwen3's plan splits layers.*.self_attn.q_norm as 'replicated_with_grad_allreduce'; "
        "tidal's tensor parallelism runs colwise and rowwise splits only (Llama-like families)"
    )


def test_a_tp2_x_dp2_checkpoint_resumes_on_one_process(run_ranks, tiny_model_dir, tmp_path):
    """The state four ranks saved as TP 2 × DP 2 (weights and optimizer state as full tensors by
    name) continues in one process as the four ranks continued."""
    ranks = run_ranks(4, 2)
    step1 = tmp_path / "step1"
    base = Actor(str(tiny_model_dir), TRAIN, ALGO, 0.8, 0, str(tiny_model_dir), 16)
    base.model.load_state_dict(ranks[0]["weights"], strict=False)
    base.model.save_pretrained(step1)
    resumed = Actor(str(step1), TRAIN, ALGO, 0.8, 0, str(tiny_model_dir), 16)
    resumed.load_state_dict(ranks[0]["state"])
    resumed.train_step(make_samples(8, seed=3), -ADV)
    for name, p in resumed.model.named_parameters():
        torch.testing.assert_close(ranks[0]["weights2"][name], p.detach(), atol=1e-5, rtol=1e-5)


def _vocab_main(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from tidal.train.parallel import VocabSplit, vocab_log_probs_and_entropy

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(6, 40, generator=gen)
    labels = torch.tensor([0, 19, 20, 39, 7, 33])  # on either side of the split
    mine = logits[:, rank * 20 : (rank + 1) * 20].clone().requires_grad_(True)
    logp, ent = vocab_log_probs_and_entropy(mine, labels, VocabSplit(rank * 20, 20, dist.group.WORLD), 0.7)
    (logp * torch.arange(1.0, 7.0) + ent * torch.linspace(-1, 1, 6)).sum().backward()
    torch.save({"logp": logp.detach(), "ent": ent.detach(), "grad": mine.grad}, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def test_the_vocabulary_split_log_softmax_gives_the_whole_ones_values_and_gradient(tmp_path):
    from tidal.algo import log_probs_and_entropy

    out = str(tmp_path / "vocab")
    mp.spawn(_vocab_main, args=(2, f"tcp://127.0.0.1:{_port()}", out), nprocs=2, join=True)
    parts = [torch.load(f"{out}.{r}") for r in range(2)]
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(6, 40, generator=gen)).requires_grad_(True)
    logp, ent = log_probs_and_entropy(logits, torch.tensor([0, 19, 20, 39, 7, 33]), 0.7)
    (logp * torch.arange(1.0, 7.0) + ent * torch.linspace(-1, 1, 6)).sum().backward()
    for part in parts:
        assert torch.allclose(part["logp"], logp.detach(), atol=1e-6)
        assert torch.allclose(part["ent"], ent.detach(), atol=1e-6)
    assert torch.allclose(torch.cat([p["grad"] for p in parts], dim=1), logits.grad, atol=1e-6)
