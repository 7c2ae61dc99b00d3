"""The app of `tidal serve` (`build_app`): every route family over one engine, the errors in
each family's shape, the API key and body limits (`Guard`), and running it (`serve`,
`BackgroundServer`). The package's docstring (`tidal.server`) says what it answers and how."""

from __future__ import annotations

import contextlib
import hmac
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tidal.adapters.async_engine import AsyncEngine
from tidal.chat.http_errors import add_error_handlers, error_for
from tidal.contracts import EngineUnavailable
from tidal.data.images import ImageReader
from tidal.server import anthropic, openai, responses, sglang, sglang_weights
from tidal.server.common import unavailable
from tidal.server.options import API_KEY_ENV, ServerConfig
from tidal.server.state import Served

log = logging.getLogger("tidal.server")

# The line `serve` prints to stdout once its port is bound, before the model's routes answer: with
# port 0 it is how a caller learns the port, with no window in which another process could take it.
LISTENING = "tidal serve: listening on "

OPEN_ROUTES = ("/health",)
WEIGHT_ROUTES = ("/update_weights_from_tensor",)  # chunks of weights: a limit of their own


def build_app(
    engine: AsyncEngine, model_name: str, config: ServerConfig | None = None, images: ImageReader | None = None
) -> FastAPI:
    """The FastAPI app serving `engine` under the name `model_name` (`images`: a vision-language
    model's processor, for chats with images)."""
    cfg = config or ServerConfig()
    app = FastAPI(title="tidal engine", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    app.add_exception_handler(EngineUnavailable, _on_unavailable)
    app.state.served = Served.create(engine, model_name, cfg, images)  # what every route reads (`State`)
    for family in (sglang, sglang_weights, openai, anthropic, responses):
        app.include_router(family.routes)
    app.add_middleware(Guard, cfg=cfg)
    return app


async def _on_unavailable(request: Request, exc: EngineUnavailable) -> JSONResponse:
    """An engine asleep, holding no weights or closed: 503 in the route's shape, saying what to do.
    Answered here rather than by the catch-all for `Exception`, which re-raises after answering
    (Starlette's way), so the server would log a traceback and close the keep-alive connection."""
    e = unavailable(exc)
    return error_for(request.url.path, e.status, str(e), e.kind, e.param)


class Guard:
    """ASGI middleware: the API key, and the body-size limit (a body with no Content-Length is
    read up to the limit, then handed on). Plain ASGI, so a route still sees the client go away."""

    def __init__(self, app, cfg: ServerConfig) -> None:
        self.app, self.cfg = app, cfg

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cfg = self.cfg
        headers = {k.decode().lower(): v.decode(errors="replace") for k, v in scope["headers"]}
        if cfg.api_key and scope["path"] not in OPEN_ROUTES:
            given = headers.get("authorization", "")
            given = given[7:] if given.lower().startswith("bearer ") else headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), cfg.api_key.encode()):
                response = error_for(
                    scope["path"], 401, "authorization: a valid API key is required", "authentication_error"
                )
                return await response(scope, receive, send)
        size = headers.get("content-length")
        weights = scope["path"] in WEIGHT_ROUTES
        limit = cfg.max_weights_body_bytes if weights else cfg.max_body_bytes
        flag = "--max-weights-body-bytes" if weights else "--max-body-bytes"  # what raises it
        if size is not None and size.isdigit() and int(size) > limit:
            why = f"body: {size} bytes; this server takes at most {limit} (tidal serve {flag})"
            response = error_for(scope["path"], 413, why)
            return await response(scope, receive, send)
        if size is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body, more = bytearray(), True  # grown in place: `bytes +=` would copy it whole for every piece
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > limit:
                    response = error_for(scope["path"], 413, f"body: more than {limit} bytes (tidal serve {flag})")
                    return await response(scope, receive, send)
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": bytes(body), "more_body": False}
                return await receive()

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


class BackgroundServer:
    """Serve an app with uvicorn on a thread (for tests and in-process use).

    `port=0` picks a free port; the socket is bound before the thread starts, so `url` is valid
    at once and the server accepts connections as soon as `start()` returns."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = url_of(self.sock)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        """Start serving; returns once the server accepts connections."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and free the port."""
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only."""
    return host in ("localhost", "::1") or host.startswith("127.")


def warn_if_open(host: str, cfg: ServerConfig) -> None:
    """Loud warning for a server reachable from other machines with no API key."""
    if not is_loopback(host) and not cfg.api_key:
        bar = "!" * 78
        log.warning(
            "%s\nserving on %s WITHOUT AN API KEY: anyone who can reach this address can generate, abort "
            "requests and replace the weights. Set --api-key or %s.\n%s",
            bar,
            host,
            API_KEY_ENV,
            bar,
        )


def _default_core(model_dir: str, **engine_kwargs: Any) -> Any:
    """tidal's LLMEngine with the model folder's tokenizer."""
    from transformers import AutoTokenizer

    from tidal.engine.llm_engine import LLMEngine

    return LLMEngine(model_dir, AutoTokenizer.from_pretrained(model_dir), **engine_kwargs)


def serve(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    config: ServerConfig | None = None,
    core: Any = None,
    core_factory: Callable[..., Any] | None = None,
    model_name: str | None = None,
    log_level: str = "info",
    **engine_kwargs: Any,
) -> None:
    """Load a core engine for `model_dir` and serve it until interrupted. Once the port is bound
    (`port=0`: a free one), prints `LISTENING` + its URL to stdout.

    The core is `core` if given, else `core_factory(model_dir, **engine_kwargs)`, by default
    `LLMEngine(model_dir, AutoTokenizer.from_pretrained(model_dir), **engine_kwargs)`."""
    import uvicorn

    cfg = config or ServerConfig.from_env()
    warn_if_open(host, cfg)
    if core is None:
        core = (core_factory or _default_core)(str(model_dir), **engine_kwargs)
    engine = AsyncEngine(core)
    try:
        with _sigterm_unwinds():
            images = ImageReader.for_model(model_dir, Path.cwd())  # a vision-language model's
            app = build_app(engine, model_name or str(model_dir), cfg, images)
            server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
            sock = server.config.bind_socket()  # exits naming the address where it cannot bind
            print(f"{LISTENING}{url_of(sock)}", flush=True)
            server.run(sockets=[sock])
            if not server.started:  # as uvicorn.run ends: the app's start-up failed, uvicorn said why
                raise SystemExit(3)
    finally:
        engine.close()


def url_of(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket ([HOST] for IPv6), the port the one it was given."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


def listening_url(output: str) -> str | None:
    """The URL in the `LISTENING` line of a `tidal serve`'s output; None before it is printed."""
    said = [line for line in output.splitlines() if line.startswith(LISTENING)]
    return said[0][len(LISTENING) :].strip() if said else None


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM as SystemExit(143) inside the block. uvicorn shuts down gracefully on SIGTERM, then
    sends it again to the process under the handler it found: the default one would end the
    process on the spot, and the callers' `finally` and `with` blocks (the engine's close, a
    merged LoRA model's temporary folder) would never run."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield
        return

    def unwind(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
