"""The rollout config's engine, built in this process: an in-process core behind `AsyncEngine`, or
HTTP servers behind `HttpEngine`; both meet `tidal.contracts.Engine`."""

from __future__ import annotations

from pathlib import Path

from tidal.config import RolloutConfig
from tidal.contracts import Engine, EngineCore
from tidal.hardware import CPU

MAX_AUTO_KV_TOKENS = 32768
BLOCK_SIZE = 16


def kv_cache_tokens(cfg: RolloutConfig, max_prompt_length: int, prompts: int | None = None) -> int:
    """`rollout.kv_cache_tokens`, or when it is 0 the KV slots one rollout call needs: each of
    `prompts` (default `rollout_batch_size`) prompts once, since its group shares its blocks, plus
    `n_samples_per_prompt` responses, plus a block of rounding per sequence; at most 32768. A
    bigger call still runs: requests wait for blocks or are preempted, never dropped."""
    if cfg.kv_cache_tokens:
        return cfg.kv_cache_tokens
    prompts = prompts or cfg.rollout_batch_size
    n = cfg.n_samples_per_prompt
    need = prompts * (max_prompt_length + n * cfg.response_budget) + prompts * (n + 1) * BLOCK_SIZE
    return min(need, MAX_AUTO_KV_TOKENS)


def engine_options(cfg: RolloutConfig, max_prompt_length: int = 1024, prompts: int | None = None) -> dict:
    """Keyword options of the tidal engine (`LLMEngine`) for the rollout config."""
    return {
        "dtype": cfg.dtype,
        "block_size": BLOCK_SIZE,
        "kv_cache_tokens": kv_cache_tokens(cfg, max_prompt_length, prompts),
        "max_num_seqs": cfg.max_num_seqs,
        "quantization": cfg.quantization,
        "pack_weights": cfg.pack_weights,
    }


def vllm_options(options: dict) -> dict:
    """`engine_options` for `VLLMCore`: vLLM picks its own block size (128 tokens on CPU, 16 on GPU)."""
    return {k: v for k, v in options.items() if k not in ("block_size", "quantization", "pack_weights")}


def make_core(
    cfg: RolloutConfig,
    model_dir: str | Path,
    tokenizer,
    max_prompt_length: int = 1024,
    prompts: int | None = None,
    device: str = CPU,
) -> EngineCore:
    """The step-based core of an in-process engine: `rollout.engine: tidal` (the default), `hf`
    (transformers forward, for architectures the tidal engine does not run) or `vllm` (vLLM's
    in-process engine, `VLLMCore`). The tidal and vLLM engines' KV caches are sized by
    `kv_cache_tokens`. `device` (resolved: `tidal.hardware.resolve_device`) places the tidal and
    hf engines; vLLM places itself."""
    if cfg.engine == "vllm":
        from tidal.adapters.vllm_core import VLLMCore

        return VLLMCore(model_dir, tokenizer, **vllm_options(engine_options(cfg, max_prompt_length, prompts)))
    if cfg.engine == "hf":
        from tidal.adapters.hf_engine import HFEngine

        return HFEngine(model_dir, tokenizer, dtype=cfg.dtype, device=device)
    from tidal.engine.llm_engine import LLMEngine

    return LLMEngine(model_dir, tokenizer, **engine_options(cfg, max_prompt_length, prompts), device=device)


def make_engine(
    cfg: RolloutConfig,
    model_dir: str | Path,
    tokenizer,
    max_prompt_length: int = 1024,
    prompts: int | None = None,
    device: str = CPU,
) -> Engine:
    """`rollout.engine: remote`: the HTTP servers at `rollout.engine_urls`; otherwise `make_core`'s
    core on a thread of its own (`AsyncEngine`)."""
    if cfg.engine == "remote":
        import os

        from tidal.adapters.client import HttpEngine

        key = cfg.api_key or os.environ.get("TIDAL_API_KEY") or None
        return HttpEngine(cfg.engine_urls, timeout=cfg.request_timeout, api_key=key)
    from tidal.adapters.async_engine import AsyncEngine

    return AsyncEngine(make_core(cfg, model_dir, tokenizer, max_prompt_length, prompts, device))
