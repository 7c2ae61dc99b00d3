"""The HTTP server of the engine (`tidal serve`): SGLang's native API (`tidal.server.sglang`),
OpenAI's (`tidal.server.openai`; its Responses API: `tidal.server.responses`) and Anthropic's
Messages API (`tidal.server.anthropic`) over one `AsyncEngine`.

- **Errors** have one shape everywhere: `{"error": {"message", "type", "param", "code"}}`, but
  Anthropic's `{"type": "error", "error": {"type", "message"}}` on its route, `/v1/messages`.
- **Auth**: with an API key (`--api-key` or `TIDAL_API_KEY`), every route but `/health` needs
  `Authorization: Bearer <key>` (or `X-API-Key`); a server bound to a non-loopback address
  without one warns loudly at start.
- **Limits** (`ServerConfig`): bodies over `max_body_bytes` are refused before they are read
  whole; `n`, prompts per request and tokens per request are capped. A text too long to fit the
  token limits is refused before it is tokenised, and at most `max_tokenising_bytes` of text is
  tokenised at once (503 beyond: `tidal.server.common.Texts`). Tokenising runs on a worker
  thread, so `/health` and other requests are never blocked by one client's text: `/health`
  answers within a few milliseconds whatever runs, and a new request joins the running batch at
  the next engine step.
- **Streams** whose client goes away are aborted in the engine at once (`EventStream`).

The app is built by `tidal.server.app.build_app`; `tidal serve` runs `tidal.server.app.serve`.
"""
