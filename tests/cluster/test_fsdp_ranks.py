"""Trainer ranks with FSDP2 over gloo take exactly the step one process takes, and their
checkpoint state resumes on another number of ranks (two processes, a tiny model)."""

from pathlib import Path

import pytest
import torch
from conftest import fork_ranks, make_samples, rank_store

from tidal.algo.options import AlgoConfig
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig

# packing with a token budget and shared prompts, fp32, two optimizer steps per train_step
TRAIN = TrainConfig(
    global_batch_size=4,
    max_tokens_per_micro_batch=24,
    packing=True,
    lr=1e-3,
    dtype="float32",
    max_grad_norm=1.0,
)
ALGO = AlgoConfig()
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])


def _rank_main(rank: int, world: int, init: str, model_dir: str, out: str) -> None:
    from tidal.cluster.trainers import TrainerRank

    tr = TrainerRank(rank, world, init, TRAIN, ALGO, model_dir, model_dir, 0.8, 0, 16, 1, 60)
    samples = make_samples(8, seed=3)
    sums, extra = tr.train_sums(samples, ADV, None, None)
    logp = tr.compute_log_probs(samples, "policy")
    weights = tr.full_weights(None)
    state = tr.state_dict()
    # the weights as the driver streams them: buckets of about 60 KB (the tiny model's embedding,
    # 80 KB, alone), each rank gathering a bucket's tensors at a time, in bf16
    buckets, first, last = [], True, False
    while not last:
        bucket, last = tr.weights_bucket(torch.bfloat16, False, 60_000, first)
        buckets.append(bucket)
        first = False
    from tidal.cluster import trainers

    trainers.WEIGHT_BUCKET_BYTES = 60_000  # the tiny model's folder in several shards
    tr.save_model(f"{out}.model")  # a collective: every rank gathers each shard's tensors
    sums2, extra2 = tr.train_sums(samples, -ADV, None, None)
    weights2 = tr.full_weights(None)
    if rank == 0:
        result = {"sums": sums, "extra": extra, "logp": logp, "w1": weights, "state": state, "w2": weights2}
        torch.save({**result, "buckets": buckets}, out)
    torch.save(logp, f"{out}.logp{rank}")  # every rank ends with the whole batch's
    torch.distributed.barrier()  # no rank tears gloo down while the other still uses it
    tr.close()


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp") / "rank0.pt")
    store, init = rank_store()
    fork_ranks(_rank_main, 2, (2, init, str(tiny_model_dir), out))
    del store
    result = torch.load(out, weights_only=False)
    result["folder"] = Path(f"{out}.model")
    result["logp_parts"] = [torch.load(f"{out}.logp{r}") for r in range(2)]
    return result


def single(model_dir):
    return Actor(str(model_dir), TRAIN, ALGO, 0.8, 0, str(model_dir), 16)


def test_two_ranks_take_the_single_process_step(two_ranks, tiny_model_dir):
    actor = single(tiny_model_dir)
    samples = make_samples(8, seed=3)
    metrics = actor.train_step(samples, ADV)
    got = two_ranks["w1"]
    # weights move ~2e-3 in these two AdamW steps; 1e-5 leaves room for AdamW's view of float-order
    # noise where a weight's two gradients nearly cancel (one that moved 3.4e-5 differed by 6e-6)
    for name, p in actor.model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), atol=1e-5, rtol=1e-5)
    initial = single(tiny_model_dir).model.named_parameters()
    moved = sum(float((got[n] - w.detach()).abs().max()) for n, w in initial)
    assert moved > 1e-3  # the step really changed the weights
    dist_metrics = {**two_ranks["sums"].mean(), **two_ranks["extra"]}
    assert dist_metrics["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    assert dist_metrics["actor/updates"] == 2
    # the ranks' sums cover every token once; rank 0's alone is its share
    assert two_ranks["extra"]["actor/tokens"] < metrics["actor/tokens"]


def test_the_ranks_hand_over_the_whole_weights_a_bucket_at_a_time(two_ranks):
    """`TrainerRank.weights_bucket`, what `TrainerGroup.named_weights` streams: rank 0's buckets
    hold every whole tensor once, in order, cast to the dtype asked for, each bucket stopping at
    the first tensor that takes it to 60 KB."""
    buckets, whole = two_ranks["buckets"], two_ranks["w1"]
    streamed = [item for b in buckets for item in b]
    assert [n for n, _ in streamed] == list(whole)
    for name, t in streamed:
        assert t.dtype == torch.bfloat16 and torch.equal(t, whole[name].to(torch.bfloat16)), name
    sizes = [[t.numel() * 2 for _, t in b] for b in buckets]
    assert len(buckets) > 2
    for b in sizes[:-1]:
        assert sum(b) >= 60_000 and sum(b) - b[-1] < 60_000  # full, and full only with its last tensor
    assert sum(sizes[-1]) > 0


def test_the_ranks_write_the_model_shard_by_shard(two_ranks, tmp_path):
    """`TrainerRank.save_model`: a Hugging Face folder of safetensors shards with their index,
    written a bucket at a time, that transformers loads as the ranks' weights."""
    from transformers import AutoModelForCausalLM

    folder = two_ranks["folder"]
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == "model-00001.safetensors"
    assert (folder / "model.safetensors.index.json").is_file() and (folder / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), two_ranks["w1"][name]), name


def test_ranks_score_shares_that_add_up_to_the_batch(two_ranks, tiny_model_dir):
    from tidal.cluster.trainers import balanced_share

    samples = make_samples(8, seed=3)
    shares = [balanced_share(samples, list(range(8)), r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(8)) and shares[0] and shares[1]
    for share in shares:  # a group's samples (same prompt) stay on one rank
        groups = {samples[i].group_index for i in share}
        assert all(samples[i].group_index in groups for i in range(8) if i in share)
    actor = single(tiny_model_dir)
    actor.train_step(samples, ADV)
    want = actor.compute_log_probs(samples)
    for logp in two_ranks["logp_parts"]:
        torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)


def test_a_two_rank_checkpoint_resumes_on_one_process(two_ranks, tiny_model_dir, tmp_path):
    """The optimizer state the ranks saved (full tensors by parameter name) continues on one
    process exactly as the two ranks continued."""
    model_dir = tmp_path / "step1"
    base = single(tiny_model_dir)
    base.model.load_state_dict(two_ranks["w1"], strict=False)
    base.model.save_pretrained(model_dir)
    resumed = Actor(str(model_dir), TRAIN, ALGO, 0.8, 0, str(tiny_model_dir), 16)
    resumed.load_state_dict(two_ranks["state"])
    resumed.train_step(make_samples(8, seed=3), -ADV)
    for name, p in resumed.model.named_parameters():
        torch.testing.assert_close(two_ranks["w2"][name], p.detach(), atol=5e-6, rtol=1e-5)


def _bad_step_main(rank: int, world: int, init: str, model_dir: str, out: str) -> None:
    from tidal.cluster.trainers import TrainerRank

    tr = TrainerRank(rank, world, init, TRAIN, ALGO, model_dir, model_dir, 0.8, 0, 16, 1, 60)
    samples = make_samples(8, seed=3)
    before = tr.full_weights(None)
    adv = ADV.clone()
    adv[5] = float("nan")  # one sample: its loss is NaN on the one rank whose share holds it
    _, extra = tr.train_sums(samples, adv, None, None)
    after = tr.full_weights(None)
    torch.save({"extra": extra, "before": before, "after": after}, f"{out}.{rank}")
    torch.distributed.barrier()  # no rank tears gloo down while the other still uses it
    tr.close()


def test_a_bad_step_is_skipped_by_every_rank(tiny_model_dir, tmp_path):
    """Both ranks skip the same optimizer step (the first of two: samples 0-3 hold none of the NaN,
    4-7 do), so they take the good one and stay in step."""
    out = str(tmp_path / "bad")
    store, init = rank_store()
    fork_ranks(_bad_step_main, 2, (2, init, str(tiny_model_dir), out))
    del store
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    assert [r["extra"]["actor/bad_steps"] for r in ranks] == [1.0, 1.0]
    # the single process's first step alone (samples 0-3) gives the same weights
    actor = single(tiny_model_dir)
    samples = make_samples(8, seed=3)
    adv = ADV.clone()
    adv[5] = float("nan")
    m = actor.train_step(samples, adv)
    assert m["actor/bad_steps"] == 1.0
    got = ranks[0]["after"]
    # weights move ~2e-3 in these two AdamW steps; 1e-5 leaves room for AdamW's view of float-order
    # noise where a weight's two gradients nearly cancel (one that moved 3.4e-5 differed by 6e-6)
    for name, p in actor.model.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), atol=1e-5, rtol=1e-5)
    assert any(not torch.equal(got[n], ranks[0]["before"][n]) for n in got)
