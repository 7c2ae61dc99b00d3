"""The rollout config's engine, built in-process."""

from __future__ import annotations

from pathlib import Path

from tidal.config import RolloutConfig
from tidal.engine.base import Engine

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
    }


def make_engine(
    cfg: RolloutConfig, model_dir: str | Path, tokenizer, max_prompt_length: int = 1024, prompts: int | None = None
) -> Engine:
    """`rollout.engine: tidal` (the default), `hf` (transformers forward, for architectures the
    tidal engine does not run), `vllm` (vLLM in this process: a `VLLMCore`, the step-based core
    for `AsyncEngine`) or `remote` (HTTP servers at `rollout.engine_urls`). The tidal and vLLM
    engines' KV caches are sized by `kv_cache_tokens`."""
    if cfg.engine == "remote":
        import os

        from tidal.engine.client import RemoteEngine

        key = cfg.api_key or os.environ.get("TIDAL_API_KEY") or None
        return RemoteEngine(cfg.engine_urls, timeout=cfg.request_timeout, api_key=key)
    if cfg.engine == "vllm":
        # the core only: the caller wraps it in tidal.engine.async_engine.AsyncEngine
        from tidal.engine.vllm_core import VLLMCore

        opts = engine_options(cfg, max_prompt_length, prompts)
        del opts["block_size"]  # vLLM's own (128 tokens on CPU, 16 on GPU)
        return VLLMCore(model_dir, tokenizer, **opts)
    if cfg.engine == "hf":
        from tidal.engine.hf_engine import HFEngine

        return HFEngine(model_dir, tokenizer, dtype=cfg.dtype)
    from tidal.engine.llm_engine import LLMEngine

    return LLMEngine(model_dir, tokenizer, **engine_options(cfg, max_prompt_length, prompts))
