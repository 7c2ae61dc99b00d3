"""Text in and out of the model: request text checked and tokenised off the event loop, answers
cut at their stop strings and detokenised a few tokens at a time for a stream."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from tidal.chat.errors import BadRequest


def check_text(text: str, field: str) -> int:
    """The size of `text` in UTF-8 bytes; BadRequest unless it is valid Unicode (a lone surrogate
    cannot be tokenised)."""
    if text.isascii():
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise BadRequest(
            f"{field}: invalid character at position {e.start} (a lone surrogate); send valid UTF-8"
        ) from None


async def encode(tokenizer: Any, texts: Sequence[str], field: str) -> list[list[int]]:
    """Token ids of `texts` (no special tokens added), tokenised on a worker thread so a huge text
    never blocks the event loop. No limits: `tidal serve` tokenises through `tidal.server.common.Texts`."""
    if tokenizer is None:
        raise BadRequest(f"{field}: this engine has no tokenizer; send token ids")
    for i, t in enumerate(texts):
        check_text(t, field if len(texts) == 1 else f"{field}[{i}]")
    return await asyncio.to_thread(lambda: [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts])


def trim_stop(text: str, stops: Sequence[str]) -> str:
    """`text` cut before the first stop string it contains (the engine keeps the tokens)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


class TextStream:
    """Incremental detokenisation: the text each new batch of tokens adds. A trailing partial
    UTF-8 character is held back until the tokens that complete it arrive, and so is any tail
    that may be the start of a stop string (a stop string itself is never sent)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stops: Sequence[str] = ()) -> None:
        self.tokenizer, self.skip, self.stops = tokenizer, skip_special_tokens, list(stops)
        self.ids: list[int] = []
        self.sent = 0

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        """The text `ids` add (all that is left when `final`)."""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip) if self.tokenizer else ""
        if self.stops:
            cut = trim_stop(text, self.stops)
            if len(cut) < len(text):
                text, final = cut, True
            elif not final:
                text = text[: max(len(text) - (max(len(s) for s in self.stops) - 1), self.sent)]
        if not final and text.endswith("\ufffd"):
            text = text[:-1]
        delta, self.sent = text[self.sent :], max(len(text), self.sent)
        return delta
