"""Build the example's vision-language model and its data, here, from what the repo installs.

The model is a llava (transformers' `LlavaForConditionalGeneration`): SmolLM2-135M-Instruct (the
bundled GGUF, converted) as its language model, a small CLIP vision tower (2 layers, width 128,
patches of 8 pixels of a 32 x 32 image: 16 image tokens) with random weights drawn from a seed,
and a two-layer projector into SmolLM2's width. Its tokenizer is SmolLM2's plus one `<image>`
token; its processor is transformers' `LlavaProcessor` (CLIP's image processor, no torchvision).

Why it can learn the task: the answer (the colour of the one shape drawn) changes the pixels,
so it changes the random tower's features through fixed, deterministic maps; the language model
already answers with colour words; GRPO then rewards the answers that match the picture, and
the language model and the projector (`train.train_vision: true`; the tower's own layers stay as
drawn) learn to read the features. No pretrained vision weights are involved: the reward rises
only because the policy learns to look.

    python examples/vision_shapes/build.py [OUT]     # OUT: examples/vision_shapes/work
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 220)}
SHAPES = ("circle", "square", "triangle")
SIZE = 32
# the colours are listed in a random order per prompt, so that the order (the model's first guess
# is the first one listed) says nothing about the answer
QUESTION = "What colour is the shape in the picture? Answer with one word: {}, {} or {}."
# ChatML as SmolLM2's own template, rendering a list of parts (text, and <image> for an image)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>\n{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def draw(colour: str, shape: str, rng: random.Random):
    """A 32 x 32 picture: one shape of `colour` at a random place and size on a light background."""
    from PIL import Image, ImageDraw

    grey = rng.randint(200, 250)
    image = Image.new("RGB", (SIZE, SIZE), (grey, grey, grey))
    pen = ImageDraw.Draw(image)
    r = rng.randint(9, 13)
    x, y = rng.randint(r, SIZE - r), rng.randint(r, SIZE - r)
    box = (x - r, y - r, x + r, y + r)
    if shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    else:
        pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=COLOURS[colour])
    return image


def write_data(out: Path, n: int, seed: int) -> Path:
    """`n` prompts (pictures in out/pictures) as JSON Lines; the label is the colour."""
    rng = random.Random(seed)
    (out / "pictures").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        draw(colour, shape, rng).save(out / "pictures" / f"{seed}-{i}.png")
        question = QUESTION.format(*rng.sample(sorted(COLOURS), 3))
        content = [{"type": "image", "image": f"pictures/{seed}-{i}.png"}, {"type": "text", "text": question}]
        rows.append({"prompt": [{"role": "user", "content": content}], "label": colour, "metadata": {"shape": shape}})
    path = out / f"shapes-{seed}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_model(out: Path, seed: int = 0) -> Path:
    """The llava folder (weights, tokenizer, processor) at out/model."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaForCausalLM,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from tidal.convert import ensure_model

    lm_dir = ensure_model("smollm2")
    tok = AutoTokenizer.from_pretrained(lm_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    lm = LlamaForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    text = lm.config
    sizes = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4}
    vision_cfg = CLIPVisionConfig(**sizes, image_size=SIZE, patch_size=8)
    config = LlavaConfig(
        vision_config=vision_cfg,
        text_config=text.to_dict(),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=(SIZE // 8) ** 2,
        tie_word_embeddings=text.tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).float()
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.resize_token_embeddings(len(tok))  # the <image> row: never read (its embedding is replaced)
    if not text.tie_word_embeddings:
        model.lm_head.load_state_dict(lm.lm_head.state_dict(), strict=False)
    model.tie_weights()
    # the projector's output at the scale of SmolLM2's token embeddings, so the image tokens
    # neither drown nor vanish in the first layer's norm
    with torch.no_grad():
        emb_std = float(lm.model.embed_tokens.weight.std())
        proj = model.model.multi_modal_projector
        for layer in (proj.linear_1, proj.linear_2):
            layer.weight.normal_(0, layer.in_features**-0.5)
            layer.bias.zero_()
        proj.linear_2.weight.mul_(emb_std)
    folder = out / "model"
    model.save_pretrained(folder)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}, do_convert_rgb=True
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=TEMPLATE,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(folder)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "work"
    print("model:", build_model(out))
    print("train:", write_data(out, 512, seed=1))
    print("held out:", write_data(out, 128, seed=2))
