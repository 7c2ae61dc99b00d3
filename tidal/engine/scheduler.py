"""Continuous batching: which sequences run in the next forward pass.

Every step first gives each running sequence its decode token, then admits waiting sequences
(new or preempted) for prefill while the step's token budget, the sequence limit and the free KV
blocks allow. A finished sequence leaves at once and frees its blocks, so a waiting one takes its
place in the very next step. When a running sequence needs a new block and none is free, the most
recently admitted sequence is preempted: its blocks are freed and it waits at the head of the
queue; on readmission its tokens so far are prefilled again (recomputation) and it carries on.

Admissions with the same tokens as one admitted earlier in the step (the samples of a GRPO group)
are its twins: they share its full prompt blocks through the prefix cache, and the engine copies
the rest (the last, partial block's K/V and the next-token logits) rather than computing it, so
they take nothing from the token budget.
"""

from __future__ import annotations

from collections import deque

from tidal.engine.block_manager import BlockManager
from tidal.engine.sequence import SeqStatus, Sequence


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[Sequence]:
        """The sequences of the next forward pass: running ones (one new token each) first, then
        newly admitted ones (their uncached tokens). Each has the blocks its new tokens need."""
        decode: list[Sequence] = []
        # oldest first: under memory pressure the newest running sequence is the one preempted
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not self.blocks.can_append(seq):
                # the newest running sequence gives way; the loop goes oldest first, so it has not
                # been scheduled in this step yet, unless it is `seq` itself
                victim = max(self.running, key=lambda s: s.arrival)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            self.blocks.append_slot(seq)
            decode.append(seq)

        budget = self.max_num_batched_tokens - len(decode)
        prefill: list[Sequence] = []
        computed: dict[tuple[int, ...], Sequence] = {}  # this step's computed admissions by tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            key = tuple(seq.keys)  # an image's placeholders as its content key
            twin = computed.get(key)
            share = twin is not None  # a hybrid model's sequence shares blocks only as a twin
            if not self.blocks.can_allocate(seq, share):
                break  # wait for blocks to free up; order is kept (no starvation)
            new_tokens = 0 if twin else seq.num_tokens - self.blocks.cached_tokens(seq, share)
            if new_tokens > budget and (decode or prefill):
                break  # over this step's token budget: next step (a lone prompt always runs)
            self.blocks.allocate(seq, share)
            if seq.preemptions == 0:
                seq.prefix_hits = seq.num_cached
            # its twin's full blocks were registered at allocation, so this one found at least
            # the cached tokens its twin did: everything it lacks, the twin computes this step
            seq.twin = twin
            if twin is None:
                computed[key] = seq
                budget -= seq.num_new
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            prefill.append(seq)
        for seq in decode + prefill:
            if seq.twin is None:  # a hybrid model's states to keep at block boundaries it computes
                self.blocks.plan_snapshots(seq)
        return decode + prefill

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
