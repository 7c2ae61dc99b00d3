"""The trainer scores a vision-language model's samples as the engine did: tiny random models of
each family (`vision_models`) sample two groups of four in tidal's engine, one prompt with one
image and one with two (a group's samples share one list of images), and the trainer's log-probs
of the same tokens equal the engine's within 1e-4 in fp32. The vision tower stays frozen unless
`train.train_vision`, and one training step then moves only what trains."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import record_step_grads
from vision_models import FAMILIES, GROUP, engine_samples, image, placeholder_run, tiny_vlm, tokens_per_image

from tidal import moe, vision
from tidal.algo.options import AlgoConfig
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig
from tidal.types import Sample

pytestmark = pytest.mark.usefixtures("one_thread")


def actor(family: str, **train) -> Actor:
    cfg = TrainConfig(**{"micro_batch_size": 4, "global_batch_size": 8, "dtype": "float32", "lr": 1e-2, **train})
    return Actor(tiny_vlm(family), cfg, AlgoConfig(), temperature=1.0)


LAYOUTS = {  # how a micro-batch's rows are laid out -> the train options that give it
    "packed, shared prompts": {},
    "packed": {"share_prompts": False},
    "padded": {"packing": False},
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_trainer_scores_image_samples_as_the_engine_did(family, layout):
    samples = engine_samples(family)
    assert samples[0].images is samples[GROUP - 1].images  # a group's images: one list
    a = actor(family, **LAYOUTS[layout])
    packs = layout != "padded"
    assert a.fwd.packing == packs and a.fwd.share_prompts == (layout == "packed, shared prompts")
    batch = a.fwd.collate(samples[:4])
    if a.fwd.share_prompts:  # the group's prompt and its image stored once in the row
        prompt = len(samples[0].tokens) - samples[0].response_length
        assert batch["input_ids"].shape[1] == prompt + sum(s.response_length for s in samples[:4])
        assert len(batch["image_prompts"]) == 1 and len(batch["image_prompts"][0].tails) == 4
    lp = a.compute_log_probs(samples)
    for i, s in enumerate(samples):
        got = lp[i, : s.response_length]
        torch.testing.assert_close(got, torch.tensor(s.rollout_log_probs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_moe_vision_language_model_replays_the_engines_routing(layout):
    """Qwen3-VL-MoE with `algo.routing_replay`: the engine records each sample's experts, with the
    images, and the trainer routes every token as the engine did (its log-probs); replaying other
    experts changes them, so the record is what routes."""
    family = "qwen3_vl_moe"
    samples = engine_samples(family, routing=True)
    layers, top_k = 1, 2  # `vision_models`: one MoE layer of 4 experts, top-2
    for s in samples:
        assert moe.routing_tensor(s.routed_experts).shape == (len(s.tokens) - 1, layers, top_k)
    cfg = TrainConfig(micro_batch_size=4, global_batch_size=8, dtype="float32", **LAYOUTS[layout])
    a = Actor(tiny_vlm(family), cfg, AlgoConfig(routing_replay=True), temperature=1.0)
    lp = a.compute_log_probs(samples)
    for i, s in enumerate(samples):
        torch.testing.assert_close(lp[i, : s.response_length], torch.tensor(s.rollout_log_probs), atol=1e-4, rtol=0)
    other = [dataclasses.replace(s) for s in samples]
    for s in other:  # the experts the engine did not choose at every position
        chosen = moe.routing_tensor(s.routed_experts).long()
        rest = torch.stack(
            [torch.tensor([e for e in range(4) if e not in row]) for row in chosen.view(-1, top_k).tolist()]
        )
        s.set_routed_experts(moe.routing_record(rest.view(chosen.shape)))
    moved = a.compute_log_probs(other)
    assert (
        max(
            float((moved[i, : s.response_length] - lp[i, : s.response_length]).abs().max())
            for i, s in enumerate(samples)
        )
        > 1e-2
    )


@pytest.mark.parametrize("family", ["qwen3_vl", "llava"])
def test_the_same_tokens_with_another_image_are_another_prompt_in_a_packed_row(family):
    run = placeholder_run(family, tokens_per_image(family))
    ids = [1, 5, 9, *run, 33, 70]
    samples = engine_samples(family, [(ids, [image(family, 0)]), (ids, [image(family, 3)])])
    a = actor(family, micro_batch_size=8)
    batch = a.fwd.collate(samples)
    assert [len(span.tails) for span in batch["image_prompts"]] == [GROUP, GROUP]
    assert batch["input_ids"].shape[1] == 2 * len(ids) + sum(s.response_length for s in samples)
    # a token budget charges each picture's prompt once: one token less than the row splits it
    row = batch["input_ids"].shape[1]
    assert len(actor(family, max_tokens_per_micro_batch=row).fwd.plan(samples)) == 1
    assert len(actor(family, max_tokens_per_micro_batch=row - 1).fwd.plan(samples)) == 2
    lp = a.compute_log_probs(samples)
    for i, s in enumerate(samples):
        torch.testing.assert_close(lp[i, : s.response_length], torch.tensor(s.rollout_log_probs), atol=1e-4, rtol=0)
    # the picture matters: the second group's answers scored after the first group's picture differ
    swapped = [dataclasses.replace(s, images=samples[0].images) for s in samples]
    wrong = a.compute_log_probs(swapped)
    s = samples[GROUP]
    assert (wrong[GROUP, : s.response_length] - torch.tensor(s.rollout_log_probs)).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["qwen3_vl", "idefics3", "gemma3"])
def test_a_packed_step_moves_the_weights_as_a_padded_one(family):
    samples = engine_samples(family)
    advantages = torch.linspace(-1, 1, len(samples))
    steps = {}
    for layout in ("packed, shared prompts", "padded"):
        a = actor(family, train_vision=True, **LAYOUTS[layout])
        grads = record_step_grads(a)
        a.train_step(samples, advantages)
        steps[layout] = dict(grads)
    packed, padded = steps.values()
    assert packed.keys() == padded.keys() and any(n for n, _ in vision.tower(tiny_vlm(family)) if n in packed)
    for n in padded:
        torch.testing.assert_close(packed[n], padded[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("train_vision", [False, True])
def test_the_vision_tower_trains_only_when_asked(train_vision):
    family = "qwen2_5_vl"
    samples = engine_samples(family)
    a = actor(family, train_vision=train_vision)
    tower = {n for n, _ in vision.tower(a.model)}
    assert tower and all(p.requires_grad == train_vision for n, p in a.model.named_parameters() if n in tower)
    grads = record_step_grads(a)
    a.train_step(samples, torch.linspace(-1, 1, len(samples)))
    got = dict(grads)
    assert any(n in got for n in tower) == train_vision
    # the image changes the loss's gradient only through the tower's output: it has one when trained
    if train_vision:
        assert any(float(got[n].abs().sum()) > 0 for n in tower if n in got)
    assert any(float(g.abs().sum()) > 0 for n, g in got.items() if n not in tower)


def test_a_sample_with_images_round_trips_through_json_and_a_corrupt_one_is_named():
    import json

    s = Sample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_log_probs=[-0.5], images=[image("llava", 0)])
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    assert [im.digest for im in back.images] == [s.images[0].digest]
    assert all(torch.equal(back.images[0].tensors[k], v) for k, v in s.images[0].tensors.items())
    d = s.to_dict()
    d["images"][0]["digest"] = "0" * 64
    with pytest.raises(ValueError, match="image 000000000000: its tensors do not give its digest"):
        Sample.from_dict(d)


def test_lora_adapts_the_language_model_only_and_starts_from_the_engines_log_probs():
    family = "llava"
    samples = engine_samples(family)
    a = actor(family, lora_rank=4)
    adapted = {n.rpartition(".lora_")[0] for n, _ in a.model.named_parameters() if ".lora_" in n}
    language = {n for n, _ in a.model.get_decoder().named_modules(prefix="model.language_model")}
    assert adapted and adapted <= language  # q/k/v/o and MLP projections of the language model
    assert not any("vision_tower" in n or "projector" in n for n in adapted)
    lp = a.compute_log_probs(samples)  # B = 0: the base model's
    for i, s in enumerate(samples):
        torch.testing.assert_close(lp[i, : s.response_length], torch.tensor(s.rollout_log_probs), atol=1e-4, rtol=0)


def test_splitting_a_vision_language_models_rows_or_layers_is_refused_by_name():
    """FSDP2 ranks train one (tests/cluster/test_fsdp_vision.py); context and tensor parallel not."""
    from tidal.options import ConfigError
    from tidal.train.model import TrainedModel

    trained = TrainedModel(tiny_vlm("llava"), TrainConfig(dtype="float32"))
    for kw, what in (({"cp_group": object()}, "cluster.cp_size"), ({"tp_mesh": object()}, "cluster.tp_size")):
        with pytest.raises(ConfigError, match=rf"{what}: llava \(a vision-language model\) trains on FSDP2 ranks"):
            trained.shard(**kw)
