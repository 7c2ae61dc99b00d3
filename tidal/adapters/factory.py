"""The engine `engine.kind` names, built from its `tidal.backends` record: an in-process core (the
record's `core`) behind `AsyncEngine`, or running servers behind `HttpEngine`; both meet
`tidal.contracts.Engine`. Nothing here compares a kind's name."""

from __future__ import annotations

import os
from pathlib import Path

from tidal.adapters.options import API_KEY_ENV, BLOCK_SIZE, EngineConfig
from tidal.backends import EngineKind, engine_kind
from tidal.contracts import Engine, EngineCore
from tidal.hardware import CPU
from tidal.utils import load_object


def core_options(engine: EngineConfig, kv_cache_tokens: int) -> dict:
    """Every option an in-process core may take (`EngineKind.core_options` says which it does),
    but the device, which each process resolves for itself; `kv_cache_tokens` as sized by
    `EngineConfig.cache_tokens`."""
    return {
        "dtype": engine.dtype,
        "block_size": BLOCK_SIZE,
        "kv_cache_tokens": kv_cache_tokens,
        "max_num_seqs": engine.max_num_seqs,
        "quantization": engine.quantization,
        "pack_weights": engine.pack_weights,
        "cuda_graphs": engine.cuda_graphs,
        "state_snapshots": engine.state_snapshots,
        "batch_invariant": engine.batch_invariant,
    }


def build_core(kind: EngineKind, model_dir: str | Path, tokenizer, options: dict, device: str = CPU) -> EngineCore:
    """The kind's step-based core over `model_dir`, given the options it takes (of `options`, and
    `device` where it places itself on one)."""
    if not kind.core:
        raise ValueError(f"engine.kind {kind.name}: runs as servers, not as a core in this process")
    options = {**options, "device": device}
    return load_object(kind.core)(model_dir, tokenizer, **{k: options[k] for k in kind.core_options if k in options})


def make_core(
    engine: EngineConfig, model_dir: str | Path, tokenizer, kv_cache_tokens: int, device: str = CPU
) -> EngineCore:
    """The core of an in-process engine of `engine.kind` (tidal's by default; `hf`: transformers'
    forward, for architectures tidal's engine does not run; `vllm`: vLLM's in-process engine).
    `device` (resolved: `tidal.hardware.resolve_device`) places the kinds that take one."""
    return build_core(engine_kind(engine.kind), model_dir, tokenizer, core_options(engine, kv_cache_tokens), device)


def make_engine(
    engine: EngineConfig, model_dir: str | Path, tokenizer, kv_cache_tokens: int, device: str = CPU
) -> Engine:
    """Servers attached at `engine.urls` (a kind with servers) behind `HttpEngine`; otherwise
    `make_core`'s core on a thread of its own (`AsyncEngine`)."""
    kind = engine_kind(engine.kind)
    if kind.servers:
        from tidal.adapters.client import HttpEngine

        if not engine.urls:
            raise ValueError(f"engine.urls: engine.kind {kind.name} here needs the URLs of running servers")
        key = engine.api_key or os.environ.get(API_KEY_ENV) or None
        return HttpEngine(engine.urls, timeout=engine.request_timeout, api_key=key)
    from tidal.adapters.async_engine import AsyncEngine

    return AsyncEngine(make_core(engine, model_dir, tokenizer, kv_cache_tokens, device))
