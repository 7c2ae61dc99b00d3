"""Prompts and SFT samples from the data config: files or built-in envs, over-long ones dropped
and counted. A source that leaves nothing to train on is a DataError saying why (an empty file,
or every row over the length limit)."""

from __future__ import annotations

import logging
from pathlib import Path

from tidal.data.dataset import DataError, PromptRecord, build_prompts, load_prompts
from tidal.data.envs import make_env_rows
from tidal.data.images import ImageReader
from tidal.data.options import DataConfig
from tidal.data.sft import load_sft_samples
from tidal.data.source import DataSource
from tidal.data.stream import StreamingSource
from tidal.types import Sample

log = logging.getLogger("tidal")


def image_reader(cfg: DataConfig, model_dir: str | Path) -> ImageReader | None:
    """For a vision-language model, what reads its prompts' images (relative paths from the data
    file's folder); None for a text-only model."""
    base = Path(cfg.path).parent if not cfg.path.startswith("env:") else Path.cwd()
    return ImageReader.for_model(model_dir, base, cfg.max_image_pixels)


def prompt_options(cfg: DataConfig, images: ImageReader | None = None) -> dict:
    """The data group's keyword options of `build_prompt` (how a row becomes a prompt), with a
    vision-language model's image reader."""
    return dict(
        images=images,
        input_key=cfg.input_key,
        label_key=cfg.label_key,
        metadata_key=cfg.metadata_key,
        apply_chat_template=cfg.apply_chat_template,
        system_prompt=cfg.system_prompt,
        max_prompt_length=cfg.max_prompt_length,
    )


def prompt_source(
    cfg: DataConfig, tokenizer, batch_size: int, images: ImageReader | None = None
) -> DataSource | StreamingSource:
    """The run's prompt stream: the whole file or env in memory, or with `data.streaming` a file
    read lazily through a shuffle buffer. Both hand out `batch_size` prompts at a time and resume.
    `images`: a vision-language model's (`image_reader`)."""
    if cfg.streaming:
        return StreamingSource(
            cfg.path, tokenizer, batch_size, prompt_options(cfg, images), cfg.shuffle, cfg.seed, cfg.shuffle_buffer
        )
    return DataSource(load_data(cfg, tokenizer, images), batch_size, cfg.shuffle, cfg.seed)


def load_data(cfg: DataConfig, tokenizer, images: ImageReader | None = None) -> list[PromptRecord]:
    """Prompt records from a file or a built-in env, with over-long prompts dropped (and counted)."""
    kw = prompt_options(cfg, images)
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
        raise DataError(_nothing_left(cfg.path, "prompts", dropped, "data.max_prompt_length", cfg.max_prompt_length))
    return records


def _nothing_left(path: str, what: str, dropped: int, limit_field: str, limit: int) -> str:
    """Why a source gave nothing to train on: it had no rows at all, or every row was too long."""
    if dropped:
        return (
            f"data.path {path}: all {dropped} {what} are longer than {limit_field} ({limit} tokens); "
            f"raise {limit_field} or shorten them"
        )
    if path.startswith("env:"):
        return f"data.path {path}: the env made no {what}; check data.env_args"
    return f"data.path {path}: the file is empty: it holds no {what}"


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
        raise DataError(_nothing_left(cfg.path, "sft samples", dropped, "data.max_length", cfg.max_length))
    return samples
