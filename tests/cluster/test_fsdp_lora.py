"""LoRA on two FSDP2 trainer ranks over gloo takes the step one process takes: the same merged
weights, gradient norm and reference (adapters off) log-probs, and the same saved adapter."""

import dataclasses

import pytest
import torch
from conftest import fork_ranks, make_samples, rank_store
from safetensors.torch import load_file
from test_fsdp_ranks import ADV, TRAIN

from tidal.algo.options import AlgoConfig
from tidal.train.actor import Actor
from tidal.train.update import Sums

LORA = dataclasses.replace(TRAIN, lora_rank=4, lora_alpha=8.0, lr=1e-2)
ALGO = AlgoConfig(kl_coef=0.1)


def _rank_main(rank: int, world: int, init: str, model_dir: str, out: str) -> None:
    from tidal.cluster.trainers import TrainerRank

    tr = TrainerRank(rank, world, init, LORA, ALGO, model_dir, model_dir, 0.8, 0, 16, 1, 60)
    samples = make_samples(8, seed=3)
    sums, extra = tr.train_sums(samples, ADV, None, None)
    ref = tr.compute_log_probs(samples, "reference")
    weights = tr.full_weights(None)
    changed = tr.full_weights(None, changed_only=True)
    shapes = tr.weight_shapes()
    tr.save_model(f"{out}.adapter")
    torch.save(sums, f"{out}.sums{rank}")  # each rank's share of the metric sums
    if rank == 0:
        torch.save({"sums": sums, "extra": extra, "ref": ref, "w": weights, "changed": changed, "shapes": shapes}, out)
    torch.distributed.barrier()
    tr.close()


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp_lora") / "rank0.pt")
    store, init = rank_store()
    fork_ranks(_rank_main, 2, (2, init, str(tiny_model_dir), out))
    del store
    sums = [torch.load(f"{out}.sums{r}", weights_only=False) for r in range(2)]
    return {**torch.load(out, weights_only=False), "adapter": f"{out}.adapter", "rank_sums": sums}


def test_lora_on_two_ranks_is_the_single_process_step(two_ranks, tiny_model_dir):
    actor = Actor(str(tiny_model_dir), LORA, ALGO, 0.8, 0, str(tiny_model_dir), 16)
    samples = make_samples(8, seed=3)
    base_lp = actor.compute_log_probs(samples, "reference")
    metrics = actor.train_step(samples, ADV)
    want = dict(actor.named_weights())
    got = two_ranks["w"]
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, atol=2e-6, rtol=1e-5)
    assert two_ranks["changed"].keys() == dict(actor.named_weights(changed_only=True)).keys()
    assert [n for n, _ in two_ranks["shapes"]] == list(want)
    assert all(tuple(want[n].shape) == s for n, s in two_ranks["shapes"])
    merged = Sums()
    for s in two_ranks["rank_sums"]:  # as the trainer group adds up its ranks' sums
        merged.merge(s)
    dist = {**merged.mean(), **two_ranks["extra"]}
    assert dist["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    # the KL to the adapters-off reference, over both ranks' tokens: the single process's
    assert dist["loss/kl"] == pytest.approx(metrics["loss/kl"], rel=1e-4) and metrics["loss/kl"] > 0
    # after the step, the reference is still the base model
    torch.testing.assert_close(two_ranks["ref"], actor.compute_log_probs(samples, "reference"), atol=1e-6, rtol=0)
    torch.testing.assert_close(two_ranks["ref"], base_lp, atol=1e-6, rtol=0)
    saved = load_file(f"{two_ranks['adapter']}/adapter_model.safetensors")
    from tidal.train.lora import adapter_state

    mine = adapter_state(actor.model)
    assert saved.keys() == mine.keys()
    for k, v in mine.items():
        torch.testing.assert_close(saved[k], v, atol=2e-6, rtol=1e-5)
