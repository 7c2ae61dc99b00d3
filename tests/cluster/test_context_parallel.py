"""Context parallelism on trainer ranks (`cluster.cp_size`, `tidal.train.context`): two ranks that
split each packed micro-batch's tokens (CP 2), and four as CP 2 × DP 2, take the step one process
takes (losses with the KL term, gradient norm, gradients, updated weights, the policy's and
reference's log-probs), on rows whose samples run across the split: a tiny Llama (a group's prompt
stored once in the row), a tiny Gemma-2 (sliding-window layers of 4 tokens and soft-capping), and
a tiny Qwen3-MoE replaying recorded routing (each rank's tokens replay their own records)."""

import dataclasses
import functools

import pytest
import torch
from conftest import (
    assert_first_step_close,
    assert_ranks_match,
    make_moe_model,
    record_step_grads,
    single_process_step,
    spawn_ranks,
)

from tidal.algo.options import AlgoConfig
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig

# 8 samples in one optimizer step, micro-batches of up to 64 tokens: rows of 2-3 samples
TRAIN = TrainConfig(
    global_batch_size=8, max_tokens_per_micro_batch=64, packing=True, lr=1e-3, dtype="float32", max_grad_norm=1.0
)
ALGO = AlgoConfig(kl_coef=0.1)
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])


def long_samples(routing: tuple[int, int, int] | None = None):
    """8 samples in groups of 2 (a group shares its prompt), 15-34 tokens each, some responses
    with masked spans: each packed row is longer than a rank's part of it. `routing` (experts,
    MoE layers, top-k): each sample also carries a recorded choice of distinct experts for each
    of its positions, random, as an engine's record for routing replay."""
    import random

    from tidal.moe import routing_record
    from tidal.types import Sample

    rng = random.Random(7)
    out = []
    for i in range(8):
        if i % 2 == 0:
            prompt = [1] + [rng.randrange(3, 300) for _ in range(rng.randrange(6, 20))]
        r = rng.randrange(6, 20)
        mask = [1] * r
        if i % 3 == 0:
            mask[2:5] = [0, 0, 0]
        resp = [rng.randrange(3, 300) for _ in range(r)]
        sample = Sample(tokens=prompt + resp, response_length=r, loss_mask=mask, rollout_log_probs=[-1.0] * r, index=i)
        if routing is not None:
            experts, layers, k = routing
            gen = torch.Generator().manual_seed(i)
            picks = [torch.randperm(experts, generator=gen)[:k] for _ in range((len(sample.tokens) - 1) * layers)]
            sample.routed_experts = routing_record(torch.stack(picks).view(len(sample.tokens) - 1, layers, k))
        out.append(sample)
    return out


# the tiny Qwen3-MoE's routing (8 experts, 2 MoE layers, top-2), replayed from the samples' records
ROUTING = (8, 2, 2)
REPLAY = dataclasses.replace(ALGO, routing_replay=True)


def _rank_main(rank: int, world: int, init: str, out: str, cp: int, tp: int, model_dir: str, replay: bool) -> None:
    from tidal.cluster.trainers import TrainerRank

    algo = REPLAY if replay else ALGO
    tr = TrainerRank(rank, world, init, TRAIN, algo, model_dir, model_dir, 0.8, 0, 40, 1, 120, cp_size=cp, tp_size=tp)
    samples = long_samples(ROUTING if replay else None)
    seen: list[int] = []  # the tokens each forward of this rank ran on
    hook = tr.actor.model.model.embed_tokens.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    grads = record_step_grads(tr.actor)
    sums, extra = tr.train_sums(samples, ADV, None, None)
    hook.remove()
    result = {
        "sums": sums,
        "extra": extra,
        "grads": dict(grads),  # this step's: the dict follows later steps
        "seen": seen,
        "policy": tr.compute_log_probs(samples, "policy"),
        "reference": tr.compute_log_probs(samples, "reference"),
        "weights": {k: v.clone() for k, v in (tr.full_weights(None) or {}).items()},
    }
    torch.save(result, f"{out}.{rank}")
    torch.distributed.barrier()
    tr.close()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_model_dir, tokenizer):
    from families import tiny_model

    gemma = tmp_path_factory.mktemp("gemma2")
    model = tiny_model("gemma2")
    model.config.sliding_window = 4  # shorter than the samples: the window's mask matters
    model.save_pretrained(gemma)
    tokenizer.save_pretrained(gemma)
    moe = tmp_path_factory.mktemp("qwen3_moe")
    make_moe_model("qwen3_moe").save_pretrained(moe)
    tokenizer.save_pretrained(moe)
    return {"llama": tiny_model_dir, "gemma2": gemma, "qwen3_moe": moe}


@pytest.fixture(scope="module")
def run_ranks(tmp_path_factory, model_dirs):
    @functools.cache
    def run(world: int, cp: int, tp: int, model: str) -> list[dict]:
        out = str(tmp_path_factory.mktemp(f"{model}-cp{cp}-tp{tp}-{world}") / "rank")
        replay = model == "qwen3_moe"
        return spawn_ranks(_rank_main, world, out, cp, tp, str(model_dirs[model]), replay)

    return run


@pytest.fixture(scope="module")
def single(model_dirs):
    @functools.cache
    def run(model: str) -> dict:
        path = str(model_dirs[model])
        replay = model == "qwen3_moe"
        actor = Actor(path, TRAIN, REPLAY if replay else ALGO, 0.8, 0, path, 40)
        samples = long_samples(ROUTING if replay else None)
        # each micro-batch's packed row (a group's prompt stored once)
        rows = [actor.fwd.collate([samples[i] for i in idx])["input_ids"].shape[1] for idx in actor.fwd.plan(samples)]
        return {"rows": rows, **single_process_step(actor, samples, ADV)}

    return run


@pytest.mark.parametrize(
    ("model", "world", "cp", "tp"),
    [
        ("llama", 2, 2, 1),
        ("llama", 4, 2, 1),
        ("gemma2", 2, 2, 1),
        ("qwen3_moe", 2, 2, 1),
        ("llama", 4, 2, 2),
        ("qwen3_moe", 4, 2, 2),
    ],
    ids=["llama-cp2", "llama-cp2xdp2", "gemma2-cp2", "qwen3_moe-replay-cp2", "llama-cp2xtp2", "qwen3_moe-cp2xtp2"],
)
def test_context_parallel_ranks_take_the_single_process_step(run_ranks, single, model, world, cp, tp):
    """With `tp` 2 the four ranks form a cp x tp mesh: each layer split over two ranks (the
    output projection by vocabulary, the MoE experts whole), each row's tokens over the other two."""
    ranks, base = run_ranks(world, cp, tp, model), single(model)
    # the MoE model's weights of std 0.2 (the Llama's: 0.02) make gradients up to 10x larger
    assert_ranks_match(ranks, base, cp * tp, grad_atol=3e-6 if model == "qwen3_moe" else 1e-6)
    assert_first_step_close(ranks[0]["weights"], base["weights"], base["grads"], TRAIN.lr)
    # each rank ran its rows' halves: a row of S tokens padded to a multiple of 4, then cut in two
    if world == cp:
        want = [-(-s // 4) * 2 for s in base["rows"]]
        assert all(set(r["seen"]) == set(want) for r in ranks), (ranks[0]["seen"], base["rows"])
        assert min(base["rows"]) > 30  # every row runs across the split (samples of 15-34 tokens)


def test_zigzag_gives_each_rank_two_chunks_from_either_end():
    from tidal.train.context import zigzag

    padded, parts = zigzag(10, 2)  # 10 tokens -> 12, chunks of 3
    assert padded == 12
    assert [p.tolist() for p in parts] == [[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]]
