"""What the routes of one app share (`Served`, kept in `app.state.served`), and how a route asks
for it: a parameter `s: State`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from tidal.adapters.async_engine import AsyncEngine
from tidal.chat.responses import ResponseStore
from tidal.data.images import ImageReader
from tidal.server.common import Runner, Texts
from tidal.server.options import ServerConfig
from tidal.server.weight_group import WeightReceiver


@dataclass
class Served:
    """One app's engine and the name it is served under, its limits, its one tokenising budget
    (shared by every route, so the limit on text tokenised at once holds server-wide), the runner
    of its requests, its weight-update groups and its stored responses."""

    engine: AsyncEngine
    model_name: str
    cfg: ServerConfig
    texts: Texts
    runner: Runner
    receiver: WeightReceiver
    stored: ResponseStore  # `/v1/responses`' stored responses, for `previous_response_id`
    images: ImageReader | None = None  # a vision-language model's processor: chats with images

    @classmethod
    def create(
        cls, engine: AsyncEngine, model_name: str, cfg: ServerConfig, images: ImageReader | None = None
    ) -> Served:
        """The state of a new app serving `engine` as `model_name` within `cfg`'s limits."""
        texts = Texts(engine.tokenizer, engine.max_model_len, cfg)
        stored = ResponseStore(cfg.max_stored_responses, cfg.max_stored_response_chars)
        return cls(engine, model_name, cfg, texts, Runner(engine), WeightReceiver(engine), stored, images)

    @property
    def tok(self) -> Any:
        """The engine's tokenizer (None for an engine that takes token ids only)."""
        return self.engine.tokenizer


async def served(request: Request) -> Served:
    """The state of the app a request came to (async: a plain function would run on a thread)."""
    return request.app.state.served


State = Annotated[Served, Depends(served)]
