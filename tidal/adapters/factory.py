"""The engine `engine.kind` names, built from its `tidal.backends` record: an in-process core (the
record's `core`) behind `AsyncEngine`, or running servers behind `HttpEngine`; both meet
`tidal.contracts.Engine`. Nothing here compares a kind's name."""

from __future__ import annotations

import os
from pathlib import Path

from tidal.adapters.options import API_KEY_ENV, EngineConfig
from tidal.backends import EngineKind, engine_kind
from tidal.contracts import Engine, EngineCore
from tidal.hardware import CPU
from tidal.rollout.options import RolloutConfig
from tidal.utils import load_object

MAX_AUTO_KV_TOKENS = 32768
BLOCK_SIZE = 16


def kv_cache_tokens(
    engine: EngineConfig, rollout: RolloutConfig, max_prompt_length: int, prompts: int | None = None
) -> int:
    """`engine.kv_cache_tokens`, or when it is 0 the KV slots one rollout call needs: each of
    `prompts` (default `rollout_batch_size`) prompts once, since its group shares its blocks, plus
    `n_samples_per_prompt` responses, plus a block of rounding per sequence; at most 32768. A
    bigger call still runs: requests wait for blocks or are preempted, never dropped."""
    if engine.kv_cache_tokens:
        return engine.kv_cache_tokens
    prompts = prompts or rollout.rollout_batch_size
    n = rollout.n_samples_per_prompt
    need = prompts * (max_prompt_length + n * rollout.response_budget) + prompts * (n + 1) * BLOCK_SIZE
    return min(need, MAX_AUTO_KV_TOKENS)


def core_options(
    engine: EngineConfig, rollout: RolloutConfig, max_prompt_length: int = 1024, prompts: int | None = None
) -> dict:
    """Every option an in-process core may take (`EngineKind.core_options` says which it does),
    but the device, which each process resolves for itself."""
    return {
        "dtype": engine.dtype,
        "block_size": BLOCK_SIZE,
        "kv_cache_tokens": kv_cache_tokens(engine, rollout, max_prompt_length, prompts),
        "max_num_seqs": engine.max_num_seqs,
        "quantization": engine.quantization,
        "pack_weights": engine.pack_weights,
    }


def build_core(kind: EngineKind, model_dir: str | Path, tokenizer, options: dict, device: str = CPU) -> EngineCore:
    """The kind's step-based core over `model_dir`, given the options it takes (of `options`, and
    `device` where it places itself on one)."""
    if not kind.core:
        raise ValueError(f"engine.kind {kind.name}: runs as servers, not as a core in this process")
    options = {**options, "device": device}
    return load_object(kind.core)(model_dir, tokenizer, **{k: options[k] for k in kind.core_options if k in options})


def make_core(
    engine: EngineConfig,
    rollout: RolloutConfig,
    model_dir: str | Path,
    tokenizer,
    max_prompt_length: int = 1024,
    prompts: int | None = None,
    device: str = CPU,
) -> EngineCore:
    """The core of an in-process engine of `engine.kind` (tidal's by default; `hf`: transformers'
    forward, for architectures tidal's engine does not run; `vllm`: vLLM's in-process engine).
    KV caches are sized by `kv_cache_tokens`; `device` (resolved: `tidal.hardware.resolve_device`)
    places the kinds that take one."""
    options = core_options(engine, rollout, max_prompt_length, prompts)
    return build_core(engine_kind(engine.kind), model_dir, tokenizer, options, device)


def make_engine(
    engine: EngineConfig,
    rollout: RolloutConfig,
    model_dir: str | Path,
    tokenizer,
    max_prompt_length: int = 1024,
    prompts: int | None = None,
    device: str = CPU,
) -> Engine:
    """Servers attached at `engine.urls` (a kind with `servers: attach`) behind `HttpEngine`;
    otherwise `make_core`'s core on a thread of its own (`AsyncEngine`)."""
    kind = engine_kind(engine.kind)
    if kind.servers:
        from tidal.adapters.client import HttpEngine

        if not engine.urls:
            raise ValueError(f"engine.urls: engine.kind {kind.name} here needs the URLs of running servers")
        key = engine.api_key or os.environ.get(API_KEY_ENV) or None
        return HttpEngine(engine.urls, timeout=engine.request_timeout, api_key=key)
    from tidal.adapters.async_engine import AsyncEngine

    return AsyncEngine(make_core(engine, rollout, model_dir, tokenizer, max_prompt_length, prompts, device))
