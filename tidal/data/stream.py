"""Prompts streamed from a file bigger than memory (`data.streaming`): a JSONL or Parquet file
is read row by row as batches are asked for, through a shuffle buffer, with a cursor that
resumes exactly.

Epoch `e` reads the file from the start into a buffer of `shuffle_buffer` rows; each prompt is
drawn from the buffer at random (`random.Random(seed + e)`) and its place refilled from the
file. Every row is drawn exactly once per epoch. A buffer shuffles locally: a row can move at
most about `shuffle_buffer` places earlier, so a file sorted by topic should be shuffled once on
disk (a bigger buffer mixes more and costs memory and resume time).

The state holds the file cursor, the RNG state and a reference to each buffered row (its byte
offset or row number, not its text), so a checkpoint stays small; a resume re-reads those rows.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tidal.data.dataset import DataError, PromptRecord, build_prompt, check_prompt_options, parse_json_line

log = logging.getLogger("tidal")

# A buffered row: (ordinal in the epoch, its reference in the file, its 1-based number, the row)
Entry = tuple[int, list[int], int, dict]


class JsonlRows:
    """Rows of a JSON Lines file from a byte offset; a row's reference is [offset, line]."""

    start = [0, 1]  # cursor at the first line: byte offset 0, line 1

    def __init__(self, path: Path) -> None:
        self.path = path

    def rows(self, cursor: list[int]) -> Iterator[tuple[list[int], int, dict, list[int]]]:
        """Yield (reference, line number, row, cursor after it) from `cursor` on."""
        offset, lineno = cursor
        with self.path.open("rb") as f:
            f.seek(offset)
            for line in f:
                row = parse_json_line(line, self.path, lineno)
                ref = [offset, lineno]
                offset, lineno = offset + len(line), lineno + 1
                if row is not None:
                    yield ref, ref[1], row, [offset, lineno]

    def read(self, refs: list[list[int]]) -> list[dict]:
        """The rows at `refs`, in that order."""
        out = []
        with self.path.open("rb") as f:
            for offset, lineno in refs:
                f.seek(offset)
                row = parse_json_line(f.readline(), self.path, lineno)
                if row is None:
                    raise DataError(f"{self.path}:{lineno}: the line a checkpoint refers to is now blank")
                out.append(row)
        return out


class ParquetRows:
    """Rows of a Parquet file from a row index, a row group at a time; a reference is [row]."""

    start = [0]

    def __init__(self, path: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path = path
        try:
            self.file = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{path}: not a Parquet file ({e})") from None
        meta = self.file.metadata
        self.group_starts = [0]
        for g in range(meta.num_row_groups):
            self.group_starts.append(self.group_starts[-1] + meta.row_group(g).num_rows)

    def _group_of(self, row: int) -> int:
        import bisect

        return bisect.bisect_right(self.group_starts, row) - 1

    def rows(self, cursor: list[int]) -> Iterator[tuple[list[int], int, dict, list[int]]]:
        (row,) = cursor
        groups = self.group_starts[:-1]
        g = self._group_of(row)
        if g >= len(groups):
            return
        skip = row - self.group_starts[g]
        for batch in self.file.iter_batches(batch_size=1024, row_groups=range(g, len(groups))):
            rows = batch.to_pylist()[skip:]
            skip = max(0, skip - batch.num_rows)
            for r in rows:
                yield [row], row + 1, r, [row + 1]
                row += 1

    def read(self, refs: list[list[int]]) -> list[dict]:
        by_group: dict[int, list[int]] = {}
        for (row,) in refs:
            by_group.setdefault(self._group_of(row), []).append(row)
        found = {}
        for g, rows in by_group.items():
            table = self.file.read_row_group(g).take([r - self.group_starts[g] for r in rows])
            found.update(zip(rows, table.to_pylist(), strict=True))
        return [found[row] for (row,) in refs]


class StreamingSource:
    """`DataSource`'s interface (`next_batch`, `epoch`, `state_dict` / `load_state_dict`) over a
    file read lazily; `options` are `build_prompt`'s (input_key, max_prompt_length, ...)."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Any,
        batch_size: int,
        options: dict,
        shuffle: bool = True,
        seed: int = 0,
        buffer_size: int = 10000,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"data file not found: {self.path}")
        suffix = self.path.suffix.lower()
        if suffix not in (".jsonl", ".parquet"):
            raise DataError(f"{self.path}: streaming reads .jsonl or .parquet files, got {suffix or '(none)'!r}")
        if batch_size < 1 or buffer_size < 1:
            raise ValueError(f"batch_size and buffer_size must be >= 1, got {batch_size} and {buffer_size}")
        check_prompt_options(**options)
        self.reader = JsonlRows(self.path) if suffix == ".jsonl" else ParquetRows(self.path)
        self.tokenizer, self.options = tokenizer, options
        self.batch_size, self.shuffle, self.seed, self.buffer_size = batch_size, shuffle, seed, buffer_size
        self.samples_consumed = 0
        self._start_epoch(0)

    # -- the stream ---------------------------------------------------------------------------

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.rng = random.Random(self.seed + epoch)
        self.cursor = list(self.reader.start)
        self.ordinal = 0  # rows read into the buffer this epoch: the next row's PromptRecord.index
        self.kept = self.dropped = 0
        self.buffer: list[Entry] = []
        self._rows = self.reader.rows(self.cursor)
        self._fill()
        if not self.buffer:
            raise DataError(f"data.path {self.path}: the file is empty: it holds no prompts")

    def _fill(self) -> None:
        # without shuffling a one-row buffer hands out the file in order
        size = self.buffer_size if self.shuffle else 1
        while len(self.buffer) < size and self._rows is not None:
            item = next(self._rows, None)
            if item is None:
                self._rows = None  # the file is read to its end for this epoch
                break
            ref, number, row, self.cursor = item
            self.buffer.append((self.ordinal, ref, number, row))
            self.ordinal += 1

    def _next_record(self) -> PromptRecord:
        while True:
            j = self.rng.randrange(len(self.buffer)) if self.shuffle else 0
            ordinal, _, number, row = self.buffer[j]
            self.buffer[j] = self.buffer[-1]
            self.buffer.pop()
            self._fill()
            record = build_prompt(ordinal, row, self.tokenizer, where=f"{self.path}:{number}", **self.options)
            if record is None:
                self.dropped += 1
            else:
                self.kept += 1
            if not self.buffer:  # roll over now, so `epoch` names the epoch of the next record
                if not self.kept:
                    limit = self.options.get("max_prompt_length")
                    raise DataError(
                        f"data.path {self.path}: all {self.dropped} prompts are longer than data.max_prompt_length "
                        f"({limit} tokens); raise data.max_prompt_length or shorten them"
                    )
                log.info(
                    "data: epoch %d streamed %d prompts, %d dropped as too long", self.epoch, self.kept, self.dropped
                )
                self._start_epoch(self.epoch + 1)
            if record is not None:
                return record

    def next_batch(self, n: int | None = None) -> list[PromptRecord]:
        """The next `n` prompts (default `batch_size`); a batch may straddle two epochs."""
        batch = [self._next_record() for _ in range(self.batch_size if n is None else n)]
        self.samples_consumed += len(batch)
        return batch

    # -- resume -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """JSON-serializable: the cursor, the RNG, and where each buffered row is in the file."""
        version, internal, gauss = self.rng.getstate()
        return {
            "streaming": True,
            "file_size": self.path.stat().st_size,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "ordinal": self.ordinal,
            "at_end": self._rows is None,
            "kept": self.kept,
            "dropped": self.dropped,
            "buffer": [[ordinal, number, *ref] for ordinal, ref, number, _ in self.buffer],
            "rng": [version, list(internal), gauss],
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "buffer_size": self.buffer_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state_dict` was taken. The checkpoint's seed, shuffle and buffer
        size win over the constructor's, since they define the order being resumed."""
        if not state.get("streaming"):
            raise DataError("cannot resume a streamed data source from a checkpoint of an in-memory one")
        size = self.path.stat().st_size
        if size != state["file_size"]:
            raise DataError(
                f"cannot resume data source: {self.path} has {size} bytes, the checkpoint's file had "
                f"{state['file_size']}; the rows it points at may have moved"
            )
        self.seed, self.shuffle, self.buffer_size = (
            int(state["seed"]),
            bool(state["shuffle"]),
            int(state["buffer_size"]),
        )
        self.epoch, self.ordinal = int(state["epoch"]), int(state["ordinal"])
        self.cursor, self.kept, self.dropped = list(state["cursor"]), int(state["kept"]), int(state["dropped"])
        self.samples_consumed = int(state["samples_consumed"])
        version, internal, gauss = state["rng"]
        self.rng = random.Random()
        self.rng.setstate((version, tuple(internal), gauss))
        entries = state["buffer"]
        rows = self.reader.read([e[2:] for e in entries])
        self.buffer = [(e[0], e[2:], e[1], row) for e, row in zip(entries, rows, strict=True)]
        self._rows = None if state["at_end"] else self.reader.rows(self.cursor)
