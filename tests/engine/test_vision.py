"""LLMEngine on tiny random vision-language models (`vision_models`): prompts with one image,
two images and an image in a second turn give transformers' greedy tokens and log-probs; a
group's shared image is computed once and hit in the prefix cache, two different images of the
same size never share; preemption keeps the images; and what cannot run is refused by name."""

from __future__ import annotations

import functools

import pytest
import torch
from vision_models import (
    FAMILIES,
    IMAGE_TOKEN,
    hf_greedy,
    hf_logprobs,
    image,
    placeholder_run,
    tiny_vlm,
    tokens_per_image,
)

from tidal import vision
from tidal.contracts import SamplingParams
from tidal.engine import model_runner
from tidal.engine.llm_engine import LLMEngine

N_NEW = 10
pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def reference(family: str):
    return tiny_vlm(family)


def engine(family: str, **kw) -> LLMEngine:
    opts = {"dtype": "float32", "block_size": 4, "kv_cache_tokens": 1024, **kw}
    return LLMEngine(tiny_vlm(family), None, **opts)


def greedy(n: int = N_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def run(eng: LLMEngine, requests: list[tuple[list[int], list[vision.Image]]], params=None) -> list:
    for i, (ids, images) in enumerate(requests):
        eng.add_request(f"r{i}", ids, params or greedy(), images=images)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(requests))]


def prompt(family: str, *parts) -> list[int]:
    """Text token lists and image markers (an int n: the n-th image's placeholders) in order."""
    ids = []
    for part in parts:
        ids += placeholder_run(family, tokens_per_image(family)) if isinstance(part, int) else part
    return ids


def assert_matches(family: str, ids: list[int], images: list[vision.Image], out) -> None:
    ref = reference(family)
    assert out.token_ids == hf_greedy(ref, family, ids, images, N_NEW)
    expected = hf_logprobs(ref, family, ids, images, out.token_ids)
    torch.testing.assert_close(torch.tensor(out.log_probs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_and_two_images_give_transformers_tokens_and_log_probs(family):
    a, b = image(family, 0), image(family, 1)
    one = prompt(family, [5, 6, 7], 0, [8, 9, 10])
    two = prompt(family, [11], 0, [12, 13], 1, [14, 15, 16, 17])
    eng = engine(family)
    outs = run(eng, [(one, [a]), (two, [a, b])])
    assert_matches(family, one, [a], outs[0])
    assert_matches(family, two, [a, b], outs[1])
    # decode steps of a Llama- or Qwen-shaped language model take the engine's decode path (its first
    # step checked bit for bit against transformers' forward); Gemma 3 and an MoE run transformers'
    assert eng.runner.decode_path_checked == (family not in ("gemma3", "qwen3_vl_moe"))


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_in_a_second_turn_continues_the_first_from_the_prefix_cache(family):
    eng = engine(family)
    a, b = image(family, 0), image(family, 1)
    first = prompt(family, [5, 6, 7], 0, [8, 9, 10])
    (out,) = run(eng, [(first, [a])])
    second = first + out.token_ids + prompt(family, [20, 21], 1, [22, 23])
    (again,) = run(eng, [(second, [a, b])])
    # the first turn's blocks, image included, are hits (whole blocks of its prompt + answer)
    assert again.cached_tokens >= (len(first) + N_NEW - 1) // 4 * 4
    assert_matches(family, second, [a, b], again)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_group_computes_its_image_once_and_different_images_never_share(family, monkeypatch):
    eng = engine(family)
    calls = []
    real = vision.features
    monkeypatch.setattr(vision, "features", lambda *a: calls.append(1) or real(*a))
    ids = prompt(family, 0, [5, 6, 7, 8])  # the image from the first token: its blocks hold only it
    a, b = image(family, 0), image(family, 1)
    assert [len(a.tensors[k]) for k in a.tensors] == [len(b.tensors[k]) for k in b.tensors]  # same size
    group = run(eng, [(ids, [a])] * 4)
    assert len(calls) == 1  # one vision forward for the group's four samples
    assert eng.counters["prefill_tokens"] == len(ids)  # the prompt computed once: the others are its twins
    assert len({tuple(o.token_ids) for o in group}) == 1
    (other,) = run(eng, [(ids, [b])])
    assert other.cached_tokens == 0  # same token ids, another image: no block of the first is hit
    assert_matches(family, ids, [b], other)
    (same,) = run(eng, [(ids, [a])])
    assert same.cached_tokens == (len(ids) - 1) // 4 * 4 and same.token_ids == group[0].token_ids


def test_gemma3_image_tokens_after_a_cache_hit_still_see_the_whole_image():
    """Gemma 3's image tokens attend to their whole image: a prefix-cache hit that ends inside an
    image leaves queries whose image has keys before the hit (cached) and after it (this step)."""
    family = "gemma3"
    eng = engine(family)
    ids = prompt(family, [1], 0, [5])  # the image's tokens at 2-5: the hit's first block ends at 4
    (first,) = run(eng, [(ids, [image(family, 0)])])
    (again,) = run(eng, [(ids, [image(family, 0)])])
    assert again.cached_tokens == 4 and again.token_ids == first.token_ids
    assert_matches(family, ids, [image(family, 0)], again)


def test_preemption_recomputes_with_the_images():
    family = "qwen2_5_vl"
    eng = engine(family, kv_cache_tokens=64, max_num_seqs=4)
    reqs = [(prompt(family, [5 + i], 0, [8, 9, 10 + i]), [image(family, i)]) for i in range(4)]
    outs = run(eng, reqs, greedy(16))
    assert eng.stats()["preemptions"] > 0
    for (ids, images), out in zip(reqs, outs, strict=True):
        assert out.token_ids == hf_greedy(reference(family), family, ids, images, 16)


def test_placeholders_and_images_must_agree():
    family = "llava"
    eng = engine(family)
    ids = prompt(family, [5], 0, [6])
    with pytest.raises(
        ValueError, match=r"request r: the prompt has 4 image placeholder tokens; its 0 image\(s\) give 0"
    ):
        eng.add_request("r", ids, greedy())
    with pytest.raises(
        ValueError, match=r"request r: the prompt has 4 image placeholder tokens; its 2 image\(s\) give 8"
    ):
        eng.add_request("r", ids, greedy(), images=[image(family, 0), image(family, 1)])
    assert ids.count(IMAGE_TOKEN) == 4


def test_a_text_model_takes_no_images(tiny_model):
    eng = LLMEngine(tiny_model, None, dtype="float32", kv_cache_tokens=256)
    with pytest.raises(ValueError, match="request r: llama takes no images"):
        eng.add_request("r", [5, 6], greedy(), images=[image("llava", 0)])


def test_vision_families_not_run_are_refused_by_name():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("paligemma")
    with pytest.raises(
        model_runner.UnsupportedModelError,
        match=r"paligemma: a vision-language model; the families run with images are llava, idefics3, ",
    ):
        model_runner.check_supported(cfg)


def test_a_vision_language_folder_loads_whole(tmp_path):
    family = "qwen2_5_vl"
    reference(family).save_pretrained(tmp_path)
    eng = LLMEngine(tmp_path, None, dtype="float32", block_size=4, kv_cache_tokens=256)
    assert eng.vision is vision.FAMILIES[family] and eng.vocab_size == 320
    ids, images = prompt(family, [5], 0, [6, 7]), [image(family, 3)]
    (out,) = run(eng, [(ids, images)])
    assert out.token_ids == hf_greedy(reference(family), family, ids, images, N_NEW)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl", "qwen3_vl"])
def test_static_decode_buffers_run_a_vision_language_model_as_usual(family):
    """The GPU's decode steps (static buffers, here eager on the CPU) after a prefill with images;
    Qwen's rotary positions continue from the image's offset there too."""
    eng = engine(family, max_num_seqs=4)
    assert eng.runner.use_static_decode(4, eng.max_model_len, capture=False) is None
    reqs = [(prompt(family, [5 + i], 0, [8, 9]), [image(family, i)]) for i in range(3)]
    outs = run(eng, reqs)
    assert eng.stats()["overlapped_steps"] > 0  # decode steps ran over the static buffers
    for (ids, images), out in zip(reqs, outs, strict=True):
        assert out.token_ids == hf_greedy(reference(family), family, ids, images, N_NEW)
