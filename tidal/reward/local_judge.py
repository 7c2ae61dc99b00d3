"""A judge model tidal serves itself (`judge.path`): the LLM judge without a separate server.

The judge's requests take the same road as with a remote judge (`judge.url`): `JudgeReward`
renders `judge.prompt_template`, posts it greedily to ``/v1/chat/completions``, retries, bounds
its concurrency and reads the score. Only the server is tidal's own: `tidal serve`'s app
(`build_app`) over tidal's engine (`LLMEngine` on a thread of its own, `AsyncEngine`), on a
loopback port picked free (`BackgroundServer`), behind a random API key so no other local user
can use it. Going through the server rather than calling the engine keeps one code path for the
prompt's chat rendering, the answer's decoding and the failures, tested once for both kinds.

Where it runs: the judge reward is asynchronous and bounds its own calls (``own_limits``), so it
scores on the rollout's event loop in the process that rolls out (the driver), never in the
`reward.workers` processes, which run sync user rewards only. One engine per (folder, device,
dtype, context length, cache) serves every `JudgeReward` of the process (the rollout's and each
evaluation set's): `acquire` starts it for the first, `release` stops it after the last, so
nothing (port, engine thread, server thread) outlives the run.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from tidal.hardware import resolve_device, resolve_dtype
from tidal.reward.options import JudgeConfig

__all__ = ["LocalJudge", "acquire", "release", "running"]

log = logging.getLogger(__name__)


@dataclass
class LocalJudge:
    """A started judge server: its base URL (ending in ``/v1``) and the key it asks for."""

    key: tuple
    url: str
    api_key: str
    engine: Any
    server: Any
    users: int = field(default=0)

    def stop(self) -> None:
        """Stop serving (the port is freed), then stop the engine thread."""
        try:
            self.server.stop()
        finally:
            self.engine.close()


_RUNNING: dict[tuple, LocalJudge] = {}
_LOCK = threading.Lock()


def _key(cfg: JudgeConfig) -> tuple:
    device = resolve_device(cfg.device, "judge.device").device
    dtype = resolve_dtype(cfg.dtype, "judge.dtype", device).dtype
    return (cfg.path, device, dtype, cfg.max_model_len, cfg.kv_cache_tokens, cfg.model)


def _start(key: tuple) -> LocalJudge:
    from tidal.adapters.async_engine import AsyncEngine
    from tidal.convert import ensure_model, load_tokenizer
    from tidal.engine.llm_engine import LLMEngine
    from tidal.server.app import BackgroundServer, build_app
    from tidal.server.options import ServerConfig

    path, device, dtype, max_model_len, kv_cache_tokens, name = key
    model_dir = ensure_model(path)  # a folder, or `smollm2` for the bundled model
    tokenizer = load_tokenizer(model_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"judge.path: {path!r} has no chat template; the judge is asked through chat completions "
            "(an instruct model's folder with its tokenizer)"
        )
    core = LLMEngine(
        model_dir,
        tokenizer,
        dtype=dtype,
        device=device,
        kv_cache_tokens=kv_cache_tokens,
        max_model_len=max_model_len or None,
    )
    engine = AsyncEngine(core)
    api_key = secrets.token_urlsafe(24)
    try:
        server = BackgroundServer(build_app(engine, name, ServerConfig(api_key=api_key))).start()
    except BaseException:
        engine.close()
        raise
    log.info("judge: %s served by tidal on %s (%s, %s)", path, server.url, device, dtype)
    return LocalJudge(key, f"{server.url}/v1", api_key, engine, server)


def acquire(cfg: JudgeConfig) -> LocalJudge:
    """The process's judge server for `cfg.path` and its engine options, started on the first call
    (loading the model: seconds to minutes); every call is matched by one `release`."""
    key = _key(cfg)
    with _LOCK:
        judge = _RUNNING.get(key)
        if judge is None:
            judge = _RUNNING[key] = _start(key)
        judge.users += 1
        return judge


def release(judge: LocalJudge) -> None:
    """Give back one `acquire`; the last one stops the server and its engine."""
    with _LOCK:
        judge.users -= 1
        if judge.users > 0:
            return
        _RUNNING.pop(judge.key, None)
    judge.stop()


def running() -> list[LocalJudge]:
    """The judge servers this process runs now (none once every user has released its own)."""
    with _LOCK:
        return list(_RUNNING.values())
