"""`tidal serve` of a vision-language model (a tiny llava with its processor) through the real
`openai` and `anthropic` clients: a chat with an image (OpenAI's `image_url` part with a data: URI,
Anthropic's base64 image block) gives the tokens the in-process engine gives for the same
conversation read by the model's processor, streamed or whole; a file path or URL, images in an
assistant message and bytes that are not an image are refused naming the field."""

from __future__ import annotations

import base64
import io

import anthropic
import openai
import pytest
from vision_models import picture, processor, tiny_vlm

from tidal import vision
from tidal.adapters.async_engine import AsyncEngine
from tidal.contracts import SamplingParams
from tidal.data.images import ImageReader
from tidal.engine.llm_engine import LLMEngine
from tidal.server.app import BackgroundServer, build_app

FAMILY = "llava"
pytestmark = pytest.mark.usefixtures("one_thread")


def png_b64(seed: int) -> str:
    buf = io.BytesIO()
    picture(seed).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


class Served:
    def __init__(self) -> None:
        self.reader = ImageReader(processor(FAMILY), vision.FAMILIES[FAMILY], base_dir=None)
        tok = self.reader.processor.tokenizer
        self.core = LLMEngine(tiny_vlm(FAMILY), tok, dtype="float32", block_size=4, kv_cache_tokens=1024)
        self.engine = AsyncEngine(self.core)
        self.server = BackgroundServer(build_app(self.engine, "tiny", None, self.reader)).start()
        self.openai = openai.OpenAI(base_url=self.server.url + "/v1", api_key="none")
        self.anthropic = anthropic.Anthropic(base_url=self.server.url, api_key="none")

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


@pytest.fixture(scope="module")
def served():
    s = Served()
    yield s
    s.close()


def in_process(s: Served, content: list, n: int) -> list[int]:
    """The engine's greedy tokens for a user message of `content` (text, and ints: the picture of
    that seed), rendered by the data path (`ImageReader.prompt`), in a second engine of the same
    weights."""
    parts = [
        {"type": "image", "image": f"data:image/png;base64,{png_b64(p)}"}
        if isinstance(p, int)
        else {"type": "text", "text": p}
        for p in content
    ]
    _, _, ids, images = s.reader.prompt([{"role": "user", "content": parts}], "t")
    engine = LLMEngine(tiny_vlm(FAMILY), None, dtype="float32", block_size=4, kv_cache_tokens=1024)
    (out,) = engine.generate_batch(
        [ids], [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)], [images]
    )
    return out.token_ids


def test_openai_image_parts_give_the_in_process_tokens_whole_and_streamed(served):
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64(0)}"}},
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64(1)}"}},
    ]
    kw = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
    whole = served.openai.chat.completions.create(**kw)
    expected = in_process(served, [0, "what is it?", 1], 8)
    tok = served.reader.processor.tokenizer
    assert whole.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
    assert whole.usage.completion_tokens == 8
    chunks = served.openai.chat.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_anthropic_image_blocks_give_the_in_process_tokens(served):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_b64(2)}}
    msg = served.anthropic.messages.create(
        model="tiny",
        max_tokens=8,
        extra_body={"temperature": 0},  # greedy (this client takes no temperature argument)
        messages=[{"role": "user", "content": [image, {"type": "text", "text": "colour?"}]}],
    )
    tok = served.reader.processor.tokenizer
    assert msg.content[0].text == tok.decode(in_process(served, [2, "colour?"], 8), skip_special_tokens=True)
    assert msg.usage.output_tokens == 8


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([{"type": "image_url", "image_url": {"url": "/etc/passwd"}}], "image 0: give the image as a data: URI"),
        ([{"type": "image_url", "image_url": {"url": "https://x/y.png"}}], "image 0: give the image as a data: URI"),
        (
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}],
            "image 0: the image bytes is not an image",
        ),
    ],
)
def test_bad_images_are_refused_naming_them(served, content, message):
    with pytest.raises(openai.BadRequestError, match=message):
        served.openai.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=2
        )


def test_an_image_in_an_assistant_message_is_refused(served):
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64(0)}"}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [image]}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]: images are taken in user messages only"):
        served.openai.chat.completions.create(model="tiny", messages=messages, max_tokens=2)


def pictures_prompt(s: Served, seeds: list[int], question: str) -> tuple[str, list[int], list]:
    """(the processor's text, its ids, the images) of a user message of the pictures and `question`."""
    parts = [{"type": "image", "image": f"data:image/png;base64,{png_b64(i)}"} for i in seeds]
    _, text, ids, images = s.reader.prompt(
        [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}], "t"
    )
    return text, ids, images


def test_sglang_generate_takes_image_data_with_ids_or_text(served):
    import httpx

    text, ids, images = pictures_prompt(served, [3, 4], "and now?")
    greedy = {"temperature": 0, "max_new_tokens": 6}
    expected = in_process(served, [3, 4, "and now?"], 6)
    uris = [f"data:image/png;base64,{png_b64(3)}", png_b64(4)]  # a data: URI, and bare base64 as SGLang takes
    for prompt in ({"input_ids": ids}, {"text": text}):
        body = {**prompt, "image_data": uris, "sampling_params": greedy}
        r = httpx.post(served.server.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == expected
    r = httpx.post(served.server.url + "/generate", json={"input_ids": ids, "sampling_params": greedy}, timeout=60)
    assert r.status_code == 400 and "its 0 image(s) give 0" in r.text  # placeholders without their images


def test_the_rollouts_http_engine_sends_a_samples_images(served):
    """What a rollout against served engines does: `HttpEngine.generate(ids, images=...)`, the
    images sent as the files they were read from."""
    import asyncio

    from tidal.adapters.client import HttpEngine

    _, ids, images = pictures_prompt(served, [5], "which?")
    assert all(im.source for im in images)

    async def ask():
        remote = HttpEngine([served.server.url], timeout=60)
        try:
            params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
            return await remote.generate(ids, params, images=images)
        finally:
            await remote.aclose()

    out = asyncio.run(ask())
    assert out.token_ids == in_process(served, [5, "which?"], 6)
