"""FSDP2 trainer ranks train a vision-language model as one process does: two ranks over gloo
score the engine's samples with images (packed rows, a group's prompt and pictures stored once)
and take the single process's step, the vision tower trained too. Qwen3-VL (3-D positions and
deepstack features), llava (a CLIP tower and a projector) and Gemma 3 (images attended both
ways)."""

import pytest
import torch
from conftest import assert_first_step_close, record_step_grads, spawn_ranks
from vision_models import engine_samples, prompts, tiny_vlm

from tidal import vision
from tidal.algo.options import AlgoConfig
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig

# packing with shared prompts, fp32, one optimizer step of two micro-batches, the tower trained
TRAIN = TrainConfig(
    global_batch_size=8, micro_batch_size=4, lr=1e-3, dtype="float32", max_grad_norm=1.0, train_vision=True
)
ALGO = AlgoConfig()
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])


def _rank_main(rank: int, world: int, init: str, out: str, model_dir: str, samples_file: str) -> None:
    from tidal.cluster.trainers import TrainerRank

    tr = TrainerRank(rank, world, init, TRAIN, ALGO, model_dir, model_dir, 1.0, 0, 16, 1, 60)
    samples = torch.load(samples_file, weights_only=False)
    before = tr.compute_log_probs(samples, "policy")
    grads = record_step_grads(tr.actor)  # the step's (clipped) gradients, gathered whole
    sums, extra = tr.train_sums(samples, ADV, None, None)
    result = {
        "before": before,
        "sums": sums,
        "extra": extra,
        "grads": dict(grads),
        "policy": tr.compute_log_probs(samples, "policy"),
        "weights": tr.full_weights(None),
    }
    torch.save(result, f"{out}.{rank}")
    torch.distributed.barrier()  # no rank tears gloo down while the other still uses it
    tr.close()


@pytest.fixture(scope="module", params=["qwen3_vl", "llava", "gemma3"])
def ranks(request, tmp_path_factory):
    family = request.param
    folder = tmp_path_factory.mktemp(f"vlm_{family}")
    tiny_vlm(family).save_pretrained(folder)
    # llava: a group with a picture and one without, so that one rank's micro-batch has no image
    groups = [prompts(family)[0], ([7, 17, 250, 99, 3], [])] if family == "llava" else None
    samples = engine_samples(family, groups)
    torch.save(samples, folder / "samples.pt")
    got = spawn_ranks(_rank_main, 2, str(folder / "rank"), str(folder), str(folder / "samples.pt"))[0]
    return family, folder, samples, got


def test_two_ranks_score_the_engines_samples_and_take_the_single_process_step(ranks):
    family, folder, samples, got = ranks
    for i, s in enumerate(samples):  # every rank ends with the whole batch's log-probs
        torch.testing.assert_close(
            got["before"][i, : s.response_length], torch.tensor(s.rollout_log_probs), atol=1e-4, rtol=0
        )
    actor = Actor(str(folder), TRAIN, ALGO, 1.0, 0, str(folder), 16)
    grads = record_step_grads(actor)
    metrics = actor.train_step(samples, ADV)
    dist = {**got["sums"].mean(), **got["extra"]}
    assert dist["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
    assert dist["actor/updates"] == 1
    tower = {n for n, _ in vision.tower(actor.model)}
    assert tower <= grads.keys() and max(float(grads[n].abs().max()) for n in tower) > 1e-3  # it trains
    for name, g in grads.items():
        torch.testing.assert_close(got["grads"][name], g, atol=1e-6, rtol=1e-5, msg=name)
    want = {n: p.detach() for n, p in actor.model.named_parameters()}
    assert_first_step_close(got["weights"], want, grads, TRAIN.lr)
    # after the step: near-zero gradients' noise moves weights by up to lr either way (above), which
    # these std-0.2 models turn into log-prob differences of up to 1e-3, a tenth of the step's own
    after = actor.compute_log_probs(samples)
    assert float((after - got["before"]).abs().max()) > 1e-2
    torch.testing.assert_close(got["policy"], after, atol=1e-3, rtol=0)
