"""Chat formats, shared by `tidal serve` (`tidal.server`) and rollout (`tidal.rollout`): rendering
messages with the model's chat template (`render`), parsing and rendering tool calls (`tools`),
OpenAI's and Anthropic's request and answer shapes (`openai`, `anthropic`), request bodies that
warn about unknown fields (`body`), checking, tokenising and stop-trimming text (`text`), and the
errors a request is refused with (`errors`; as HTTP responses in each API's shape: `http_errors`).

Imports neither `tidal.server` nor `tidal.rollout`; FastAPI only in `http_errors`.
"""
