"""Prompts and SFT samples from the data config: files or built-in envs, over-long ones dropped
and counted."""

from __future__ import annotations

import logging

from tidal.config import DataConfig
from tidal.data.dataset import PromptRecord, build_prompts, load_prompts
from tidal.data.envs import make_env_rows
from tidal.data.sft import load_sft_samples
from tidal.data.source import DataSource
from tidal.data.stream import StreamingSource
from tidal.types import Sample

log = logging.getLogger("tidal")


def prompt_options(cfg: DataConfig) -> dict:
    """The data group's keyword options of `build_prompt` (how a row becomes a prompt)."""
    return dict(
        input_key=cfg.input_key,
        label_key=cfg.label_key,
        metadata_key=cfg.metadata_key,
        apply_chat_template=cfg.apply_chat_template,
        system_prompt=cfg.system_prompt,
        max_prompt_length=cfg.max_prompt_length,
    )


def prompt_source(cfg: DataConfig, tokenizer, batch_size: int) -> DataSource | StreamingSource:
    """The run's prompt stream: the whole file or env in memory, or with `data.streaming` a file
    read lazily through a shuffle buffer. Both hand out `batch_size` prompts at a time and resume."""
    if cfg.streaming:
        return StreamingSource(
            cfg.path, tokenizer, batch_size, prompt_options(cfg), cfg.shuffle, cfg.seed, cfg.shuffle_buffer
        )
    return DataSource(load_data(cfg, tokenizer), batch_size, cfg.shuffle, cfg.seed)


def load_data(cfg: DataConfig, tokenizer) -> list[PromptRecord]:
    """Prompt records from a file or a built-in env, with over-long prompts dropped (and counted)."""
    kw = prompt_options(cfg)
    if cfg.path.startswith("env:"):
        name = cfg.path[len("env:") :]
        records, dropped = build_prompts(make_env_rows(name, **cfg.env_args), tokenizer, source=cfg.path, **kw)
    else:
        records, dropped = load_prompts(cfg.path, tokenizer, **kw)
    log.info(
        "data: %d prompts from %s, %d dropped as longer than %d tokens",
        len(records),
        cfg.path,
        dropped,
        cfg.max_prompt_length,
    )
    if not records:
        raise ValueError(f"data.path {cfg.path}: no prompts left after dropping {dropped} over-long ones")
    return records


def load_sft_data(cfg: DataConfig, tokenizer) -> list[Sample]:
    """SFT samples from `data.path` (chats or prompt/response pairs), over-long ones dropped and counted."""
    samples, dropped = load_sft_samples(
        cfg.path,
        tokenizer,
        messages_key=cfg.messages_key,
        prompt_key=cfg.input_key,
        response_key=cfg.response_key,
        max_length=cfg.max_length,
        apply_chat_template=cfg.apply_chat_template,
        system_prompt=cfg.system_prompt,
    )
    log.info(
        "data: %d sft samples from %s, %d dropped as longer than %d tokens",
        len(samples),
        cfg.path,
        dropped,
        cfg.max_length,
    )
    if not samples:
        raise ValueError(f"data.path {cfg.path}: no sft samples left after dropping {dropped} over-long ones")
    return samples
