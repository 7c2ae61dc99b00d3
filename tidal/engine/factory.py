"""The rollout config's engine, built in-process."""

from __future__ import annotations

from pathlib import Path

from tidal.config import RolloutConfig
from tidal.engine.base import Engine


def make_engine(cfg: RolloutConfig, model_dir: str | Path, tokenizer) -> Engine:
    """`rollout.engine: tidal` (the default), `hf` (transformers forward, for architectures the
    tidal engine does not run) or `remote` (HTTP servers at `rollout.engine_urls`)."""
    if cfg.engine == "remote":
        from tidal.engine.client import RemoteEngine

        return RemoteEngine(cfg.engine_urls)
    if cfg.engine == "hf":
        from tidal.engine.hf_engine import HFEngine

        return HFEngine(model_dir, tokenizer, dtype=cfg.dtype)
    from tidal.engine.llm_engine import LLMEngine

    return LLMEngine(
        model_dir, tokenizer, dtype=cfg.dtype, kv_cache_tokens=cfg.kv_cache_tokens, max_num_seqs=cfg.max_num_seqs
    )
