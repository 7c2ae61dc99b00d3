"""Tiny random vision-language models of the families `tidal.vision` runs, built from each
family's transformers config (nothing downloaded), with image processors sized for them, and
transformers' own greedy tokens and log-probs of prompts with images to compare an engine with.

Language models as in `families`: vocabulary 320, hidden 64, 2 layers, weights redrawn from a
seeded normal with std 0.2 (well separated greedy choices). Vision towers: 2 layers of width 32.
Placeholder token 300 for every family; Qwen's vision start/end tokens 302/303, Gemma 3's
begin/end of image 304/305. Images of 60x50 pixels become 4 placeholders (Qwen: a 4x4 patch grid
merged 2x2; llava: a 28-pixel crop in 14-pixel patches; Gemma 3: resized to 28x28, 2x2 patches)
or 20 (Idefics3 / SmolVLM: 4 tiles and a global view of 4 tokens each).
"""

from __future__ import annotations

import numpy as np
import torch
from families import _BASE, _reinit

from tidal import moe, vision
from tidal.contracts import SamplingParams
from tidal.engine.llm_engine import LLMEngine
from tidal.types import Sample

IMAGE_TOKEN = 300
VISION_START, VISION_END = 302, 303
GEMMA_BOI, GEMMA_EOI = 304, 305  # Gemma 3's begin/end of image
_TEXT = {k: v for k, v in _BASE.items() if k != "tie_word_embeddings"}  # `families`' language models
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
_QWEN_IDS = dict(
    image_token_id=IMAGE_TOKEN,
    video_token_id=301,
    vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
    tie_word_embeddings=False,
)
# llava's CLIP and Gemma 3's SigLIP: 28-pixel images in 14-pixel patches, 4 patches
_SMALL_TOWER = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14
)
_IDEFICS_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "idefics3", "smolvlm", "gemma3")


def tiny_config(family: str):
    from transformers import AutoConfig

    if family.startswith("qwen"):
        merge = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        sizes = dict(hidden_size=32, intermediate_size=64, out_hidden_size=64)
        text = {**_TEXT, "rope_parameters": _MROPE}
        if family.startswith("qwen3_vl"):  # interleaved 3-D rotary, q/k norms; layer 0's vision features join layer 0
            vis = {**merge, **sizes, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}
            text = {**_TEXT, "rope_parameters": {**_MROPE, "mrope_interleaved": True}, "head_dim": 16}
            if family == "qwen3_vl_moe":  # layer 1: 4 experts, top-2 (layer 0 a dense MLP)
                text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0])
        elif family == "qwen2_5_vl":  # windowed attention in one of its two layers
            vis = {**merge, **sizes, "window_size": 56, "fullatt_block_indexes": [1]}
        else:
            vis = {**merge, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}
        return AutoConfig.for_model(family, text_config=text, vision_config=vis, **_QWEN_IDS)
    if family == "llava":
        vis = {"model_type": "clip_vision_model", **_SMALL_TOWER, "projection_dim": 32}
        return AutoConfig.for_model(
            family,
            text_config={"model_type": "llama", **_TEXT},
            vision_config=vis,
            image_token_id=IMAGE_TOKEN,
            vision_feature_layer=-1,
            image_seq_length=4,
        )
    if family in ("idefics3", "smolvlm"):
        return AutoConfig.for_model(
            family,
            text_config={"model_type": "llama", **_TEXT},
            vision_config=_IDEFICS_VISION,
            image_token_id=IMAGE_TOKEN,
            scale_factor=2,
        )
    if family == "gemma3":  # families' Gemma 3 language model (sliding window 6); 4 tokens an image
        from families import _CONFIGS, WINDOW

        text = {**_TEXT, **_CONFIGS["gemma3_text"], "sliding_window": WINDOW}
        return AutoConfig.for_model(
            family,
            text_config={"model_type": "gemma3_text", **text},
            vision_config={"model_type": "siglip_vision_model", **_SMALL_TOWER},
            mm_tokens_per_image=4,
            boi_token_index=GEMMA_BOI,
            eoi_token_index=GEMMA_EOI,
            image_token_index=IMAGE_TOKEN,
            tie_word_embeddings=False,
        )
    raise KeyError(f"unknown vision family {family!r}; known: {', '.join(FAMILIES)}")


def tiny_vlm(family: str, seed: int = 0):
    """A tiny random fp32 vision-language model of `family`, in eval mode; same seed, same weights."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_config(family), dtype=torch.float32)
    _reinit(model, seed)
    return model.eval()


def image_processor(family: str):
    """The family's image processor, sized for `tiny_config`'s vision tower."""
    import transformers

    if family.startswith("qwen"):
        return transformers.Qwen2VLImageProcessorPil(
            min_pixels=56 * 56, max_pixels=4 * 56 * 56, patch_size=14, merge_size=2
        )
    if family == "gemma3":
        return transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    if family == "llava":
        return transformers.CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    sizes = dict(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    if family == "idefics3":
        return transformers.Idefics3ImageProcessorPil(**sizes)
    return transformers.SmolVLMImageProcessorPil(**sizes)


def picture(seed: int, size: tuple[int, int] = (60, 50)):
    """A PIL image of random pixels (height, width), the same for the same seed."""
    from PIL import Image as PILImage

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return PILImage.fromarray(pixels)


def image(family: str, seed: int) -> vision.Image:
    """`picture(seed)` as `family`'s processor makes it."""
    out = image_processor(family)(images=[picture(seed)], return_tensors="pt")
    return vision.Image.of({k: v for k, v in out.items() if k in vision.FAMILIES[family].inputs})


def placeholder_run(family: str, count: int) -> list[int]:
    """An image's tokens in a prompt: `count` placeholders (within Qwen's start/end tokens)."""
    if family.startswith("qwen"):
        return [VISION_START, *[IMAGE_TOKEN] * count, VISION_END]
    if family == "gemma3":
        return [GEMMA_BOI, *[IMAGE_TOKEN] * count, GEMMA_EOI]
    return [IMAGE_TOKEN] * count


def tokens_per_image(family: str) -> int:
    return 20 if family in ("idefics3", "smolvlm") else 4


def _inputs(model, family: str, ids: list[int], images: list[vision.Image]) -> dict:
    kw = dict(vision.batch(images, vision.FAMILIES[family].inputs)) if images else {}
    t = torch.tensor([ids])
    if vision.FAMILIES[family].mrope:
        kw["mm_token_type_ids"] = (t == IMAGE_TOKEN).int()
    if vision.FAMILIES[family].bidirectional:  # which tokens attend within their image both ways
        kw["token_type_ids"] = (t == IMAGE_TOKEN).long()
    return {"input_ids": t, **kw}


@torch.no_grad()
def hf_greedy(model, family: str, ids: list[int], images: list[vision.Image], n: int) -> list[int]:
    """transformers' greedy continuation (exactly n tokens) of a prompt with images."""
    kw = _inputs(model, family, ids, images)
    out = model.generate(**kw, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


@torch.no_grad()
def hf_logprobs(model, family: str, ids: list[int], images: list[vision.Image], response: list[int]) -> torch.Tensor:
    """Log-probs of `response` after the prompt from one transformers forward over both."""
    kw = _inputs(model, family, ids + response, images)
    logits = model(**kw).logits[0, len(ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


# the byte tokenizer's specials from id 259: fillers up to the families' placeholder ids
_QWEN_SPECIALS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
_IDEFICS_SPECIALS = ["<image>", "<unused>", "<fake_token_around_image>", "<global-img>"]
_GEMMA_SPECIALS = ["<image_soft_token>", "<unused0>", "<unused1>", "<unused2>", "<start_of_image>", "<end_of_image>"]
_PARTS = "{% for p in m['content'] %}{% if p['type'] == 'image' %}IMAGE{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}" + _PARTS + "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def processor(family: str):
    """The family's transformers processor over conftest's byte tokenizer, its placeholder token at
    `IMAGE_TOKEN` as `tiny_config` has it, and a ChatML template that renders image parts as the
    family's marker. (llava, Idefics3 and Gemma 3 only: the Qwen and SmolVLM processors need
    torchvision or num2words, which tidal does not install.)"""
    import transformers
    from conftest import make_tokenizer

    tok = make_tokenizer()
    specials = {"llava": _IDEFICS_SPECIALS, "idefics3": _IDEFICS_SPECIALS, "gemma3": _GEMMA_SPECIALS}[family]
    fillers = [f"<|filler_{i}|>" for i in range(IMAGE_TOKEN - len(tok))]
    tok.add_special_tokens({"additional_special_tokens": fillers + specials})
    assert tok.convert_tokens_to_ids(specials[0]) == IMAGE_TOKEN
    template = _TEMPLATE.replace("IMAGE", "<image>")
    if family == "gemma3":  # its processor reads these names off the tokenizer
        names = {"image_token": specials[0], "boi_token": specials[4], "eoi_token": specials[5]}
        tok._set_model_specific_special_tokens(special_tokens=names)
        assert tok.boi_token_id == GEMMA_BOI and tok.eoi_token_id == GEMMA_EOI
        return transformers.Gemma3Processor(
            image_processor=image_processor(family),
            tokenizer=tok,
            chat_template=_TEMPLATE.replace("IMAGE", names["boi_token"]),
            image_seq_length=4,
        )
    if family == "llava":
        return transformers.LlavaProcessor(
            image_processor=image_processor(family),
            tokenizer=tok,
            chat_template=template,
            patch_size=14,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
        )
    return transformers.Idefics3Processor(
        image_processor=image_processor(family), tokenizer=tok, chat_template=template, image_seq_len=4
    )


GROUP = 4  # samples per prompt in `engine_samples`


def prompts(family: str) -> list[tuple[list[int], list[vision.Image]]]:
    """Two prompts: one with one image, one with two."""
    run = placeholder_run(family, tokens_per_image(family))
    return [
        ([1, 5, 9, *run, 33, 70], [image(family, 0)]),
        ([7, *run, 17, 250, *run, 99, 3], [image(family, 1), image(family, 2)]),
    ]


def engine_samples(family: str, groups: list | None = None, routing: bool = False) -> list[Sample]:
    """Four samples of each (ids, images) of `groups` (default `prompts(family)`) from the engine;
    `routing`: with the engine's record of an MoE model's experts (`algo.routing_replay`)."""
    engine = LLMEngine(tiny_vlm(family), None, dtype="float32", block_size=4, kv_cache_tokens=1024)
    samples = []
    for g, (ids, images) in enumerate(prompts(family) if groups is None else groups):
        for j in range(GROUP):
            i = g * GROUP + j
            params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=i, return_routed_experts=routing)
            engine.add_request(str(i), ids, params, images=images)
            samples.append(Sample(tokens=list(ids), group_index=g, index=i, images=images))
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    for i, s in enumerate(samples):
        o = outs[str(i)]
        n = len(o.token_ids)
        s.tokens += o.token_ids
        s.response_length, s.loss_mask, s.rollout_log_probs = n, [1] * n, list(o.log_probs)
        if routing:
            s.set_routed_experts(moe.routing_record(o.routed_experts))
    return samples
