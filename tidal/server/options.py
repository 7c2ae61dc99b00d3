"""`tidal serve`'s options: its limits and its API key (`ServerConfig`).

Light (the standard library and the engine group's options only, no FastAPI, no torch): the CLI
reads its defaults for `tidal serve --help`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tidal.adapters.options import API_KEY_ENV


@dataclass
class ServerConfig:
    """`tidal serve`'s limits, which keep one client from starving the others, and its API key.

    A request may ask for at most `max_n` samples per prompt, `max_batch` prompts, and
    `max_request_tokens` tokens in all (prompts + every sample's new tokens); a body is at most
    `max_body_bytes` (`max_weights_body_bytes` for `/update_weights_from_tensor`). At most
    `max_tokenising_bytes` of request text is tokenised at once, server-wide (tokenising takes
    150-250 bytes of memory a byte of text); a request that would go over is answered 503. For
    `previous_response_id`, the items of at most `max_stored_responses` responses are kept, at
    most `max_stored_response_chars` characters of them (the oldest go first). The defaults
    protect a laptop."""

    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20
    # a weight update's chunk (tidal's wire format: a safetensors blob of up to 32 MiB of tensors, a
    # larger tensor in pieces, `tidal.adapters.client`; 4/3 of that as JSON's base64);
    # `tidal serve --max-weights-body-bytes`
    max_weights_body_bytes: int = 64 * 2**20
    max_n: int = 16
    max_batch: int = 256
    max_request_tokens: int = 262_144
    max_tokenising_bytes: int = 8 * 2**20
    # `/v1/responses`' `previous_response_id`: the items of the latest responses, kept in memory
    max_stored_responses: int = 1024
    max_stored_response_chars: int = 64 * 2**20

    @classmethod
    def from_env(cls, api_key: str | None = None, **kw: Any) -> ServerConfig:
        """With the key from `api_key`, else the TIDAL_API_KEY environment variable."""
        return cls(api_key=api_key or os.environ.get(API_KEY_ENV) or None, **kw)
