"""A GRPO run of a vision-language model through `tidal.loop.train`: a tiny llava folder with its
processor, prompts whose messages hold image files, the embedded engine sampling with the images,
the trainer scoring the same tokens with them (the recorded engine/trainer log-prob gap stays at
fp32 rounding), weights synced to the engine every step, and the vision tower left as it was."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import loop_config
from safetensors.torch import load_file
from vision_models import picture, processor, tiny_vlm

import tidal.loop
from tidal import vision

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava")
    tiny_vlm("llava").save_pretrained(folder)
    processor("llava").save_pretrained(folder)
    return folder


def image_prompts(folder) -> str:
    """Six prompts, each a picture file and a question, as a JSONL file in `folder`/data."""
    (folder / "data").mkdir()
    rows = []
    for i in range(6):
        picture(i).save(folder / "data" / f"{i}.png")
        content = [{"type": "image", "image": f"{i}.png"}, {"type": "text", "text": f"what is {i}?"}]
        rows.append(json.dumps({"prompt": [{"role": "user", "content": content}], "label": str(i)}))
    (folder / "data" / "train.jsonl").write_text("\n".join(rows) + "\n")
    return str(folder / "data" / "train.jsonl")


def test_a_grpo_run_trains_a_vision_language_model_on_image_prompts(llava_dir, tmp_path):
    data = image_prompts(tmp_path)
    # one optimizer step per rollout: the trainer scores with the weights that sampled
    over = {"data.path": data, "train.num_steps": 2, "rollout.max_new_tokens": 6, "train.global_batch_size": 16}
    # an eval set of image prompts too: read with the processor, scored on the engine
    held = {"name": "held", "path": data, "n": 1, "temperature": 0.0, "max_new_tokens": 4}
    over |= {"eval.interval": 2, "eval.datasets": [held]}
    rows = tidal.loop.train(loop_config(llava_dir, tmp_path / "run", **over))
    assert [h["step"] for h in rows] == [0, 1, 2]  # the eval before any training, then the steps
    assert "eval/held/mean_reward" in rows[0] and "eval/held/mean_reward" in rows[2]
    history = rows[1:]
    assert all(
        h["actor/rollout_logprob_abs_diff"] < 1e-5 for h in history
    )  # scored with the images  # scored with the images
    assert all(h["actor/grad_norm"] > 0 for h in history)
    before = load_file(llava_dir / "model.safetensors")
    after = load_file(tmp_path / "run" / "checkpoints" / "step_2" / "model.safetensors")
    tower = {n for n, _ in vision.tower(tiny_vlm("llava"))}
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and not moved & tower  # the language model trained; the vision tower is frozen
    # the checkpoint carries the processor: an engine and the data path read images with it
    from tidal.data.images import ImageReader

    reader = ImageReader.for_model(tmp_path / "run" / "checkpoints" / "step_2", tmp_path / "data")
    assert reader is not None and reader.processor.tokenizer.convert_tokens_to_ids("<image>") == 300
    # `tidal export` writes the whole model with its processor: transformers and the engine load it
    from transformers import AutoModelForImageTextToText

    from tidal.engine.llm_engine import LLMEngine
    from tidal.train.checkpoint import export_checkpoint

    out = export_checkpoint(tmp_path / "run", tmp_path / "export")
    assert type(AutoModelForImageTextToText.from_pretrained(out)).__name__ == "LlavaForConditionalGeneration"
    assert ImageReader.for_model(out, tmp_path) is not None
    assert LLMEngine(out, None, dtype="float32", kv_cache_tokens=256).vision is vision.FAMILIES["llava"]


def test_ray_trainer_ranks_and_an_engine_actor_train_it_like_one_process(ray_session, llava_dir, tmp_path):
    """Two FSDP2 trainer ranks and one engine actor on Ray: the actor reads its folder's processor
    and samples with the images the rollout sends it, and the first step (the same weights, the
    same seeds) is the in-process run's."""
    data = image_prompts(tmp_path)
    over = {"data.path": data, "train.num_steps": 1, "rollout.max_new_tokens": 6, "train.global_batch_size": 16}
    local = tidal.loop.train(loop_config(llava_dir, tmp_path / "local", **over))
    layout = {"cluster.trainers": 2, "cluster.engines": 1}
    ray = tidal.loop.train(loop_config(llava_dir, tmp_path / "ray", **over, **layout))
    assert [h["step"] for h in ray] == [1]
    # (not actor/tokens: the rows each rank computes, where a group split over two ranks stores its
    # prompt twice)
    for key in ("reward/mean", "response/length_mean", "loss/pg"):
        assert ray[0][key] == pytest.approx(local[0][key], rel=1e-5, abs=1e-6), key
    assert ray[0]["actor/grad_norm"] == pytest.approx(local[0]["actor/grad_norm"], rel=1e-4)
    assert ray[0]["actor/rollout_logprob_abs_diff"] < 1e-5  # the ranks scored the actor's samples with the images
