"""A chat's prompt: messages and tools through the tokenizer's chat template, tokenised."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from tidal.chat.errors import BadRequest
from tidal.chat.text import encode
from tidal.chat.tools import render_messages, template_takes_tools
from tidal.data.dataset import DataError
from tidal.data.images import ImageReader
from tidal.vision import Image


class TextEncoder(Protocol):
    """What tokenises request text within a server's limits (`tidal.server.common.Texts`)."""

    async def encode(self, texts: Sequence[str], field: str) -> list[list[int]]:
        """Token ids of `texts`; errors name `field`."""
        ...


async def render_prompt(
    tok: Any, raw: list[dict], tools: list[dict] | None, tool_choice: Any, texts: TextEncoder | None = None
) -> list[int]:
    """The prompt ids of chat messages (OpenAI's form, as dicts) and tools: what every chat route
    (OpenAI's, Anthropic's, the agent door's) renders, so one conversation is one prompt whichever
    API it came through."""
    ids, _ = await render_chat(tok, raw, tools, tool_choice, texts)
    return ids


async def render_chat(
    tok: Any,
    raw: list[dict],
    tools: list[dict] | None,
    tool_choice: Any,
    texts: TextEncoder | None = None,
    images: ImageReader | None = None,
) -> tuple[list[int], list[Image]]:
    """`render_prompt`, and for a vision-language model (`images`, its processor's reader) the
    images of the user messages' image parts (`data:` URIs): the processor's template renders
    them and expands each into its placeholder tokens; (ids, the images in order)."""
    if tok is None:
        raise BadRequest("messages: this engine has no tokenizer to apply a chat template")
    found: list | None = [] if images is not None else None
    try:
        messages, tools = render_messages(raw, tools, tool_choice, template_takes_tools(tok), found)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    template = images.processor if found else tok
    try:
        text = template.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:
        raise BadRequest(f"messages: the chat template failed: {type(e).__name__}: {e}") from None
    if found:
        return await render_images(images, text, found, "messages")
    if texts is not None:  # `tidal serve`'s limits on text to tokenise
        return (await texts.encode([text], "messages"))[0], []
    return (await encode(tok, [text], "messages"))[0], []


async def render_images(
    reader: ImageReader, text: str | None, values: list, field: str
) -> tuple[list[int] | None, list[Image]]:
    """The images of `values` (data: URIs; a server reads no file and fetches no URL for a
    client) and, given the prompt's `text`, its ids with each image marker expanded by the
    processor; BadRequest naming `field` for an image that is not one."""
    for i, v in enumerate(values):
        if not (isinstance(v, str) and v.startswith("data:")):
            raise BadRequest(f"{field}: image {i}: give the image as a data: URI (data:image/png;base64,...)")
    return await asyncio.to_thread(_read_images, reader, text, values, field)


def _read_images(reader: ImageReader, text: str | None, values: list, field: str):
    try:
        opened = [reader.open(v, f"image {i}") for i, v in enumerate(values)]
    except DataError as e:
        raise BadRequest(f"{field}: {e}") from None
    ids = reader.ids(text, [picture for picture, _ in opened]) if text is not None else None
    return ids, [reader.one(picture, raw) for picture, raw in opened]
