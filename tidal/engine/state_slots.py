"""Which slot of the recurrent-state pool holds what (hybrid models; `tidal.engine.states`).

Slots 0 .. running-1 are the running sequences' own (one each, handed out at admission and back
when the sequence leaves the cache). Slots running .. running+snapshots-1 are snapshots: the
states after the first b tokens of some sequence, taken at every b that is a multiple of `every`
tokens (a multiple of the block size), kept under the hash of the block that ends at b, least
recently used first out. A later sequence whose first b tokens hit the prefix cache starts from
that snapshot instead of computing them again (`BlockManager`), as K/V hits do for attention.

A snapshot becomes visible once the step that computed it has finished (`commit`): a sequence
admitted in the same step could not start from states not yet computed. New weights make every
snapshot stale (`clear`, with the prefix cache).
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlots:
    def __init__(self, running: int, snapshots: int = 0, every: int = 64) -> None:
        if running < 1 or snapshots < 0 or every < 1:
            raise ValueError(
                f"state slots: need running >= 1, snapshots >= 0, every >= 1; got {running, snapshots, every}"
            )
        self.running = running
        self.snapshots = snapshots
        self.every = every
        self.free = list(range(running - 1, -1, -1))  # popped from the end: slot 0 first
        self.free_snaps = list(range(running + snapshots - 1, running - 1, -1))
        self.snap: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recently used first

    @property
    def total(self) -> int:
        return self.running + self.snapshots

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("no free recurrent-state slot: more sequences than max_num_seqs")
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def has(self, h: int) -> bool:
        return h in self.snap

    def use(self, h: int) -> int:
        """The snapshot slot kept under `h`, now the most recently used."""
        self.snap.move_to_end(h)
        return self.snap[h]

    def reserve(self) -> int | None:
        """A slot for a new snapshot: a free one, else the least recently used one's; None when
        snapshots are off."""
        if self.free_snaps:
            return self.free_snaps.pop()
        if self.snap:
            return self.snap.popitem(last=False)[1]
        return None

    def commit(self, h: int, slot: int) -> None:
        """Keep the states now in `slot` under `h` (a duplicate of one kept already is let go)."""
        if h in self.snap:
            self.free_snaps.append(slot)
        else:
            self.snap[h] = slot

    def release(self, slot: int) -> None:
        self.free_snaps.append(slot)

    def clear(self) -> None:
        self.free_snaps.extend(self.snap.values())
        self.snap.clear()
