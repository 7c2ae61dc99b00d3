"""A chat's prompt: messages and tools through the tokenizer's chat template, tokenised."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tidal.chat.errors import BadRequest
from tidal.chat.text import encode
from tidal.chat.tools import render_messages, template_takes_tools


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
    if tok is None:
        raise BadRequest("messages: this engine has no tokenizer to apply a chat template")
    try:
        messages, tools = render_messages(raw, tools, tool_choice, template_takes_tools(tok))
    except ValueError as e:
        raise BadRequest(str(e)) from None
    try:
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:
        raise BadRequest(f"messages: the chat template failed: {type(e).__name__}: {e}") from None
    if texts is not None:  # `tidal serve`'s limits on text to tokenise
        return (await texts.encode([text], "messages"))[0]
    return (await encode(tok, [text], "messages"))[0]
