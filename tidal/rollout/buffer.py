"""The data buffer of the overlapped loop: finished groups wait here until the trainer takes them.

A buffer filter chooses which groups train next: `filter(groups, n, step) -> indices` returns `n`
distinct indices into `groups` (every group there is young enough for `step`: the buffer has
already evicted those whose oldest trained token is more than `max_staleness` versions old).
Built in: `fifo` (the default: with admission control it never evicts anything), `newest_first`
and `reward_stratified`; any other by dotted path (`overlap.buffer_filter`). A buffer class of
your own (`overlap.buffer`) needs `add`, `get`, `__len__`, `state_dict` and `load_state_dict`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from tidal.types import Sample
from tidal.utils import load_object

Group = list[Sample]
BufferFilter = Callable[[list[Group], int, int], list[int]]


def oldest_version(group: Group) -> int | None:
    """The oldest weight version of any token the group trains on (None: nothing trained on)."""
    versions = [
        v
        for s in group
        for v, m in zip(s.token_versions or [s.weight_version] * s.response_length, s.loss_mask, strict=True)
        if m
    ]
    return min(versions) if versions else None


def fifo(groups: list[Group], n: int, step: int) -> list[int]:
    """The oldest groups first, in the order they were generated."""
    return list(range(n))


def newest_first(groups: list[Group], n: int, step: int) -> list[int]:
    """The groups sampled by the newest weights first (least off-policy)."""
    order = sorted(range(len(groups)), key=lambda i: (-(oldest_version(groups[i]) or 0), i))
    return order[:n]


def reward_stratified(groups: list[Group], n: int, step: int) -> list[int]:
    """An even spread over the groups' mean rewards: sort by mean reward, take `n` evenly spaced."""

    def mean_reward(g: Group) -> float:
        vals = [s.reward.get("score", 0.0) if isinstance(s.reward, dict) else (s.reward or 0.0) for s in g]
        return statistics.fmean(float(v) for v in vals)

    order = sorted(range(len(groups)), key=lambda i: (mean_reward(groups[i]), i))
    if n >= len(order):
        return order[:n]
    stride = len(order) / n
    return [order[int(k * stride)] for k in range(n)]


BUFFER_FILTERS: dict[str, BufferFilter] = {
    "fifo": fifo,
    "newest_first": newest_first,
    "reward_stratified": reward_stratified,
}


def load_buffer_filter(name: str) -> BufferFilter:
    if name in BUFFER_FILTERS:
        return BUFFER_FILTERS[name]
    try:
        return load_object(name, callable_required=True)
    except (ImportError, ValueError) as e:
        raise ValueError(f"overlap.buffer_filter: cannot load {name!r}: {e}") from e


class Buffer:
    """Finished groups in the order they were generated; `get` hands out `n` of them by the filter."""

    def __init__(self, filter_fn: BufferFilter = fifo, max_staleness: int | None = None) -> None:
        self.filter_fn = filter_fn
        self.max_staleness = max_staleness
        self.groups: list[Group] = []
        self.evicted = 0  # groups dropped as too stale (only a non-FIFO filter can cause it)

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, groups: list[Group]) -> None:
        self.groups.extend(groups)

    def get(self, n: int, step: int) -> list[Group] | None:
        """`n` groups to train at `step`, or None while fewer than `n` young enough ones are here."""
        if self.max_staleness is not None:
            keep = []
            for g in self.groups:
                v = oldest_version(g)
                if v is not None and step - v > self.max_staleness:
                    self.evicted += 1
                else:
                    keep.append(g)
            self.groups = keep
        if len(self.groups) < n:
            return None
        idx = list(self.filter_fn(self.groups, n, step))
        if len(idx) != n or len(set(idx)) != n or not all(0 <= i < len(self.groups) for i in idx):
            raise ValueError(f"buffer filter returned {idx}: expected {n} distinct indices below {len(self.groups)}")
        chosen = [self.groups[i] for i in idx]
        taken = set(idx)
        self.groups = [g for i, g in enumerate(self.groups) if i not in taken]
        return chosen

    def state_dict(self) -> dict:
        return {"groups": [[s.to_dict() for s in g] for g in self.groups], "evicted": self.evicted}

    def load_state_dict(self, state: dict) -> None:
        self.groups = [[Sample.from_dict(d) for d in g] for g in state["groups"]]
        self.evicted = int(state.get("evicted", 0))
