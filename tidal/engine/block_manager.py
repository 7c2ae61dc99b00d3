"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts and a prefix cache.

The cache is `num_blocks` blocks of `block_size` token slots. A sequence owns a block table (the
blocks holding its tokens in order). A *full* block is identified by a hash chained over every
token before and in it, so two sequences whose first k blocks of tokens agree share those blocks:
the n samples of a GRPO group prefill their prompt once, and a multi-turn continuation reuses the
blocks of the turn before. A block whose last user leaves goes back to the free list but keeps its
hash, so a later request with the same prefix can still hit it until the block is reused.

A hybrid model's sequences also hold a slot of recurrent states while they hold blocks
(`states`, `tidal.engine.state_slots`). A cached block is of use to them only together with the
states at its end: a hit reaches as far as the last block whose states a snapshot kept, and the
sequence starts from that snapshot; where the caller says the states come anyway (`share`: a
twin, whose states are copied from its lead) the hit is whole.
"""

from __future__ import annotations

from collections import OrderedDict

from tidal.engine.sequence import Sequence
from tidal.engine.state_slots import StateSlots

_ROOT = 0x5EED


def block_hash(prev: int, tokens: list[int] | tuple[int, ...]) -> int:
    """Hash of a full block given the hash of the block before it (chained over the prefix)."""
    return hash((prev, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, states: StateSlots | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        if states is not None and states.every % block_size:
            raise ValueError(
                f"state snapshots every {states.every} tokens: not a multiple of the block size {block_size}"
            )
        self.states = states
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.hash = [-1] * num_blocks  # -1: not a registered full block
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # free blocks in LRU order (oldest first); blocks with a hash are still prefix-cache hits
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.hits = 0  # prefix-cache hits (blocks), for stats and tests
        self.misses = 0
        self.peak_used = 0
        # bumped by reset_prefix_cache: blocks of sequences admitted before it hold K/V from older
        # weights and must never become shareable
        self.epoch = 0  # most blocks referenced at once: the KV memory a workload really needs

    # ---------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def _chain(self, tokens: list[int]) -> list[int]:
        """Hashes of the full blocks of `tokens`."""
        out, h, bs = [], _ROOT, self.block_size
        for i in range(len(tokens) // bs):
            h = block_hash(h, tokens[i * bs : (i + 1) * bs])
            out.append(h)
        return out

    def _lookup(self, tokens: list[int], share: bool = True) -> list[int]:
        """Block ids of the longest cached prefix of `tokens`, in whole blocks, always leaving at
        least one token to compute (the forward pass needs it to produce the next logits); for a
        hybrid model's sequence, unless `share`, only as far as a snapshot of states reaches."""
        bs = self.block_size
        found = []
        chain = self._chain(tokens)
        for i, h in enumerate(chain):
            b = self.cached.get(h)
            # the token check guards against a hash collision silently mixing two prompts
            if b is None or self.tokens[b] != tuple(tokens[i * bs : (i + 1) * bs]):
                break
            found.append(b)
        if found and len(found) * bs >= len(tokens):
            found.pop()
        if self.states is not None and not share:
            while found and not self.states.has(chain[len(found) - 1]):
                found.pop()
        return found

    def cached_tokens(self, seq: Sequence, share: bool = True) -> int:
        """Tokens of `seq` that `allocate` would find in the prefix cache now."""
        return len(self._lookup(seq.keys, share)) * self.block_size

    def blocks_needed(self, seq: Sequence, share: bool = True) -> int:
        """Free blocks `allocate(seq)` would take now."""
        hits = self._lookup(seq.keys, share)
        total = -(-seq.num_tokens // self.block_size)
        # a hit on a free (unreferenced) block takes it off the free list too
        return total - len(hits) + sum(1 for b in hits if self.ref[b] == 0)

    def can_allocate(self, seq: Sequence, share: bool = True) -> bool:
        if self.states is not None and not self.states.free:
            return False
        return self.blocks_needed(seq, share) <= self.num_free

    # ---------------------------------------------------------------- allocation
    def _take_free(self) -> int:
        b, _ = self.free.popitem(last=False)  # the least recently freed block
        if self.hash[b] != -1:
            if self.cached.get(self.hash[b]) == b:
                del self.cached[self.hash[b]]
            self.hash[b] = -1
            self.tokens[b] = None
        self.ref[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return b

    def _register(self, b: int, h: int, tokens: list[int]) -> None:
        self.hash[b] = h
        self.tokens[b] = tuple(tokens)
        self.cached[h] = b

    def allocate(self, seq: Sequence, share: bool = True) -> None:
        """Give `seq` a block table covering all its tokens, reusing cached prefix blocks. Sets
        `seq.num_cached` to the tokens found in the cache; the rest must be computed this step.

        Full blocks are registered in the prefix cache right away: the engine writes every new
        K/V of a step before any attention reads the cache, so a second sequence admitted in the
        same step may already share them."""
        if seq.block_table:
            raise RuntimeError(f"request {seq.request_id} already has blocks")
        if not self.can_allocate(seq, share):
            raise RuntimeError(f"request {seq.request_id}: not enough free KV blocks")
        tokens, bs = seq.keys, self.block_size
        hits = self._lookup(tokens, share)
        for b in hits:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
        self.hits += len(hits)
        table = list(hits)
        chain = self._chain(tokens)
        for i in range(len(hits), -(-len(tokens) // bs)):
            b = self._take_free()
            self.misses += 1
            if i < len(chain):
                self._register(b, chain[i], tokens[i * bs : (i + 1) * bs])
            table.append(b)
        seq.block_table = table
        seq.num_cached = len(hits) * bs
        seq.cache_epoch = self.epoch
        if self.states is not None:
            seq.state_slot = self.states.take()
            if hits and not share:  # its states start from the snapshot at the hit's end
                seq.state_from = self.states.use(chain[len(hits) - 1])

    def can_append(self, seq: Sequence) -> bool:
        """Whether the slot for the sequence's last token (written by the next decode) exists or
        a free block can provide it."""
        return len(seq.block_table) * self.block_size >= seq.num_tokens or self.num_free > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the last token's K/V, and register the block before it once it is full."""
        self.grow(seq, seq.num_tokens)
        self.register_full(seq)

    def grow(self, seq: Sequence, length: int) -> None:
        """Give `seq` the block for position `length - 1` if its table ends before it."""
        if len(seq.block_table) * self.block_size < length:
            seq.block_table.append(self._take_free())

    def register_full(self, seq: Sequence) -> None:
        """Register the block holding the sequence's last token once that token fills it (its
        K/V are written by the decode that feeds it): the block becomes a prefix-cache hit."""
        bs = self.block_size
        n = seq.num_tokens
        if n % bs == 0 and seq.cache_epoch == self.epoch:
            i = n // bs - 1
            b = seq.block_table[i]
            if self.hash[b] == -1:
                prev = self.hash[seq.block_table[i - 1]] if i > 0 else _ROOT
                if prev != -1:
                    keys = seq.keys_between(i * bs, n)
                    h = block_hash(prev, keys)
                    if h not in self.cached:
                        self._register(b, h, keys)

    def free_seq(self, seq: Sequence) -> None:
        """Release the sequence's blocks, last block first: the free list hands out the oldest
        entries first, so the tail of a prefix is recycled before its head, which more requests share."""
        for b in reversed(seq.block_table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        seq.block_table = []
        seq.num_cached = 0
        if seq.state_slot >= 0:
            self.states.give(seq.state_slot)
            seq.state_slot = seq.state_from = -1

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash: after a weight update the cached K/V are stale, so no new
        request may share them (running requests keep reading their own blocks). State snapshots
        go with them."""
        self.hash = [-1] * self.num_blocks
        self.tokens = [None] * self.num_blocks
        self.cached = {}
        self.epoch += 1
        if self.states is not None:
            self.states.clear()

    # ---------------------------------------------------------------- state snapshots
    def plan_snapshots(self, seq: Sequence) -> None:
        """Reserve snapshot slots for the states `seq` reaches in this step at every multiple of
        `states.every` tokens it computes (`seq.snapshots_due`), where none is kept yet."""
        if self.states is None or not self.states.snapshots or seq.cache_epoch != self.epoch:
            return
        every, start, end = self.states.every, seq.num_cached, seq.num_tokens
        points = range((start // every + 1) * every, end + 1, every)
        if not points:
            return
        chain = self._chain(seq.keys[: points[-1]])
        for b in points:
            h = chain[b // self.block_size - 1]
            if self.states.has(h):
                continue
            slot = self.states.reserve()
            if slot is None:
                return
            seq.snapshots_due.append((b, slot, h))

    def end_step(self, seqs: list[Sequence], ok: bool) -> None:
        """After a step: keep the snapshots it computed (`ok`), or let their slots go."""
        if self.states is None:
            return
        for seq in seqs:
            for _, slot, h in seq.snapshots_due:
                if ok:
                    self.states.commit(h, slot)
                else:
                    self.states.release(slot)
            seq.snapshots_due = []
