"""Prompt datasets: read rows from JSONL / JSON / Parquet and turn them into tokenized prompts.

Reading and building are split so that anything yielding `(row number, row dict)` pairs (files,
the built-in environments in `tidal.data.envs`) goes through the same prompt construction and
the same error messages.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.types import InputError

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")


class DataError(InputError):
    """A data file, row or env that cannot become prompts or samples. The message names the file
    and line (or row) and what was expected; `tidal train` prints it without a traceback."""


@dataclass
class PromptRecord:
    """One prompt ready for generation.

    `prompt` is the raw input (a string or a list of `{"role", "content"}` messages), `text` the
    exact string that was tokenized (after the chat template when one was applied) and `index`
    the row's 0-based position among the rows of the source. `messages` is the conversation the
    chat template rendered (the system prompt included), None when no template was applied.
    `images`: the images of its messages as the model's processor made them (`tidal.data.images`).
    """

    index: int
    prompt: str | list[dict]
    text: str
    input_ids: list[int]
    label: Any = None
    metadata: dict = field(default_factory=dict)
    messages: list[dict] | None = None
    # a vision-language prompt's images (`tidal.vision.Image`), in the order of their placeholders
    images: list = field(default_factory=list)


def _json_type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def parse_json_line(line: str | bytes, path: str | Path, lineno: int) -> dict | None:
    """One JSON Lines row as a dict, None for a blank line; errors name `path:lineno`."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{path}:{lineno}: not UTF-8: {err}") from None
    if not line.strip():
        return None
    try:
        # Without the newline a truncated line is reported at its own column, not "line 2".
        row = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{lineno}: invalid JSON: {err}") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {_json_type_name(row)}")
    return row


def _iter_json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    # bytes, decoded line by line in parse_json_line: a bad byte is then named by path:line, where
    # a text-mode file would raise a UnicodeDecodeError naming neither
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            row = parse_json_line(line, path, lineno)
            if row is not None:
                yield lineno, row


def _iter_json(path: Path) -> Iterator[tuple[int, dict]]:
    # `.json` files in the wild are either one array of objects or JSON Lines under the wrong
    # extension; try the whole document first and fall back to line-by-line parsing.
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 ({err})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        yield from _iter_json_lines(path)
        return
    if isinstance(doc, dict):
        # A single object is also a valid one-line JSON Lines file.
        yield from _iter_json_lines(path)
        return
    if not isinstance(doc, list):
        raise DataError(f"{path}: expected a JSON array of objects or JSON Lines, got {_json_type_name(doc)}")
    for number, row in enumerate(doc, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {_json_type_name(row)}")
        yield number, row


def _iter_parquet(path: Path) -> Iterator[tuple[int, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except pa.ArrowInvalid as e:  # pyarrow alone says "magic bytes not found" and names no file
        raise DataError(
            f"{path}: not a Parquet file ({e}); a .parquet file must hold Parquet, as pandas.DataFrame.to_parquet "
            "or pyarrow.parquet.write_table write it (JSON Lines go in a .jsonl file)"
        ) from None
    # Batches keep memory bounded on large files; row numbers run across batches.
    number = 0
    for batch in parquet.iter_batches():
        for row in batch.to_pylist():
            number += 1
            yield number, row


def read_rows(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield `(number, row)` for every row of a `.jsonl`, `.json` or `.parquet` file.

    `number` is the 1-based line for JSON Lines (blank lines are skipped but still counted, so it
    matches what an editor shows), the 1-based element for a JSON array and the 1-based row for
    Parquet. Errors name `path:number`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _iter_json_lines(path)
    if suffix == ".json":
        return _iter_json(path)
    if suffix == ".parquet":
        return _iter_parquet(path)
    raise DataError(
        f"{path}: unsupported file extension {suffix or '(none)'!r}; supported: {', '.join(SUPPORTED_EXTENSIONS)}"
    )


IMAGE_TYPES = ("image", "image_url")  # content parts that are images (`tidal.data.images`)


def has_images(messages: Any) -> bool:
    """Whether a list of chat messages holds an image part."""
    if not isinstance(messages, list):
        return False
    return any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in IMAGE_TYPES for p in m["content"])
        for m in messages
    )


def _check_messages(messages: list, where: str) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {i} must be an object with 'role' and 'content'")


def check_prompt_options(
    apply_chat_template: bool = True, system_prompt: str | None = None, max_prompt_length: int | None = None, **_: Any
) -> None:
    """Raise ValueError for prompt options that contradict each other (see `build_prompt`)."""
    if system_prompt is not None and not apply_chat_template:
        # Without a template there is no place to put a system message; fail rather than drop it.
        raise DataError("system_prompt needs apply_chat_template=True")
    if max_prompt_length is not None and max_prompt_length < 1:
        raise DataError(f"max_prompt_length must be >= 1 or None, got {max_prompt_length}")


def build_prompt(
    index: int,
    row: dict,
    tokenizer: Any,
    *,
    where: str,
    input_key: str = "prompt",
    label_key: str = "label",
    metadata_key: str = "metadata",
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
    max_prompt_length: int | None = None,
    images: Any = None,
) -> PromptRecord | None:
    """One row as a tokenized `PromptRecord` (`index`: its 0-based position in the source), or
    None when it has more than `max_prompt_length` prompt tokens. Errors name `where`.
    `images`: a vision-language model's `tidal.data.images.ImageReader`, for messages with images."""
    if input_key not in row:
        raise DataError(f"{where}: missing key {input_key!r} (set data.input_key to the field that holds the prompt)")
    prompt = row[input_key]
    metadata = row.get(metadata_key)
    # Parquet fills a missing struct with None, so None means "no metadata" rather than an error.
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise DataError(f"{where}: {metadata_key!r} must be an object, got {_json_type_name(metadata)}")

    messages, pictures, input_ids = None, [], None
    if isinstance(prompt, list) and apply_chat_template and (images is not None or has_images(prompt)):
        if images is None:
            raise DataError(f"{where}: {input_key!r} holds images; the model takes none (a text-only model)")
        _check_messages(prompt, where)
        prompt, text, input_ids, pictures = images.prompt(prompt, f"{where}: {input_key!r}")
        messages = prompt
    elif isinstance(prompt, str):
        if apply_chat_template:
            messages = [{"role": "user", "content": prompt}]
            if system_prompt is not None:
                messages.insert(0, {"role": "system", "content": system_prompt})
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = prompt
    elif isinstance(prompt, list):
        if not apply_chat_template:
            raise DataError(f"{where}: {input_key!r} is a list of messages, which needs apply_chat_template=True")
        _check_messages(prompt, where)
        messages = prompt
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    else:
        raise DataError(f"{where}: {input_key!r} must be a string or a list of messages, got {_json_type_name(prompt)}")

    # The template already carries any special tokens the model expects; adding a BOS again
    # would make prompts differ from what the engine sees.
    if input_ids is None:
        input_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if max_prompt_length is not None and len(input_ids) > max_prompt_length:
        return None
    return PromptRecord(
        index=index,
        prompt=prompt,
        text=text,
        input_ids=input_ids,
        label=row.get(label_key),
        metadata=dict(metadata),
        messages=messages,
        images=pictures,
    )


def build_prompts(
    rows: Iterable[tuple[int, dict]], tokenizer: Any, *, source: str, **options: Any
) -> tuple[list[PromptRecord], int]:
    """Turn `(number, row)` pairs into tokenized `PromptRecord`s; `options` are `build_prompt`'s
    (input_key, label_key, metadata_key, apply_chat_template, system_prompt, max_prompt_length).

    Returns the records and how many rows were dropped for having more than `max_prompt_length`
    prompt tokens. `source` is only used to name `source:number` in error messages.
    """
    check_prompt_options(**options)
    records: list[PromptRecord] = []
    dropped = 0
    for index, (number, row) in enumerate(rows):
        record = build_prompt(index, row, tokenizer, where=f"{source}:{number}", **options)
        if record is None:
            dropped += 1
        else:
            records.append(record)
    return records, dropped


def load_prompts(path: str | Path, tokenizer: Any, **options: Any) -> tuple[list[PromptRecord], int]:
    """Read a data file and build its prompts; `options` are `build_prompts`' keyword arguments."""
    return build_prompts(read_rows(path), tokenizer, source=str(path), **options)
