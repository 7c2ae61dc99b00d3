"""An endless, resumable stream of prompt batches."""

from __future__ import annotations

import random

from tidal.data.dataset import DataError, PromptRecord


class DataSource:
    """Hands out `batch_size` records at a time, epoch after epoch, forever.

    Epoch `e` visits the records in the order of a permutation drawn from `random.Random(seed + e)`
    (the identity when `shuffle` is False). Orders are a pure function of (seed, epoch), so a
    checkpoint only needs the cursor, not the RNG state. A batch may straddle an epoch boundary.
    """

    def __init__(self, records: list[PromptRecord], batch_size: int, shuffle: bool = True, seed: int = 0):
        if not records:
            raise ValueError("DataSource needs at least one record, got an empty dataset")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.records = records
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0  # index into the current epoch's order of the next record to hand out
        self.samples_consumed = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self, n: int | None = None) -> list[PromptRecord]:
        """Return the next `n` records (default `batch_size`)."""
        batch = []
        for _ in range(self.batch_size if n is None else n):
            batch.append(self.records[self._order[self.position]])
            self.position += 1
            # Roll over eagerly so `epoch`/`position` always point at the next record to serve.
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
        self.samples_consumed += len(batch)
        return batch

    def state_dict(self) -> dict:
        """JSON-serializable cursor; `load_state_dict` on it resumes with the same batches."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_records": len(self.records),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a cursor saved by `state_dict`.

        The checkpoint's `seed` and `shuffle` win over the constructor's because they define the
        order being resumed. `batch_size` is not restored: the cursor counts records, not batches.
        """
        if state.get("streaming"):
            raise DataError("cannot resume an in-memory data source from a checkpoint of a streamed one")
        n = int(state["num_records"])
        if n != len(self.records):
            # A different dataset would silently remap every index; refuse rather than mislead.
            raise DataError(f"cannot resume data source: checkpoint has {n} records, dataset has {len(self.records)}")
        position = int(state["position"])
        if not 0 <= position < n:
            raise DataError(f"cannot resume data source: position {position} outside 0..{n - 1}")
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self.position = position
        self.samples_consumed = int(state["samples_consumed"])
        self._order = self._epoch_order(self.epoch)
