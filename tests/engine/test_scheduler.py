"""Scheduler: FIFO admission, sequence and token limits, finishing, preemption and prefix reuse.

The engine is simulated: after each schedule() every scheduled sequence has all its tokens in
the cache and gains one output token, as LLMEngine.step does.
"""

from __future__ import annotations

import pytest

from tidal.contracts import SamplingParams
from tidal.engine.block_manager import BlockManager
from tidal.engine.scheduler import Scheduler
from tidal.engine.sequence import SeqStatus, Sequence


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=1024) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget)


class Seqs:
    """Hand-made sequences with increasing arrival; output tokens are unique per sequence."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, prompt) -> Sequence:
        s = Sequence(f"s{self.n}", list(prompt), SamplingParams(), arrival=self.n)
        self.n += 1
        return s


def step(sched: Scheduler) -> list[Sequence]:
    seqs = sched.schedule()
    for s in seqs:
        assert s.status is SeqStatus.RUNNING and s.block_table
        assert len(s.block_table) * sched.blocks.block_size >= s.num_tokens
        s.num_cached = s.num_tokens
        s.output_ids.append(1000 + 100 * s.arrival + len(s.output_ids))
    return seqs


def test_fifo_admission_and_max_num_seqs():
    sched, mk = make(max_num_seqs=2), Seqs()
    seqs = [mk([10 * i + 1, 10 * i + 2, 10 * i + 3]) for i in range(4)]
    for s in seqs:
        sched.add(s)
    assert sched.has_unfinished()
    assert step(sched) == seqs[:2]
    assert sched.running == seqs[:2] and list(sched.waiting) == seqs[2:]
    assert [s.status for s in seqs] == [SeqStatus.RUNNING] * 2 + [SeqStatus.WAITING] * 2
    assert step(sched) == seqs[:2]  # full: both decode, nobody admitted
    assert len(sched.running) == 2
    # a finished sequence frees its slot and blocks; the head of the queue runs the next step
    used = sched.blocks.num_used
    sched.finish(seqs[0], "stop")
    assert seqs[0].status is SeqStatus.FINISHED and seqs[0].finish_reason == "stop"
    assert seqs[0].block_table == [] and sched.blocks.num_used == used - 1
    assert step(sched) == [seqs[1], seqs[2]]  # decode first, then the admission
    assert list(sched.waiting) == [seqs[3]]
    # finishing a waiting sequence (an abort) takes it out of the queue
    sched.finish(seqs[3], "abort")
    assert not sched.waiting and seqs[3].status is SeqStatus.FINISHED
    sched.finish(seqs[1], "stop")
    sched.finish(seqs[2], "length")
    assert not sched.has_unfinished() and sched.blocks.num_used == 0
    assert step(sched) == []


def test_token_budget_admits_prompts_while_uncached_tokens_fit():
    sched, mk = make(budget=10), Seqs()
    a, b, c = mk(range(10, 14)), mk(range(20, 25)), mk(range(30, 33))  # 4, 5, 3 tokens
    for s in (a, b, c):
        sched.add(s)
    assert step(sched) == [a, b]  # 4 + 5 <= 10; 3 more would exceed it
    # two decodes cost 2, leaving 8 for c's 3 tokens
    assert step(sched) == [a, b, c]


def test_lone_over_budget_prompt_still_runs():
    sched, mk = make(budget=4), Seqs()
    big, small = mk(range(10, 19)), mk([5, 6])
    sched.add(big)
    sched.add(small)
    assert step(sched) == [big]  # 9 tokens > 4, but alone it runs; small waits for the next step
    assert step(sched) == [big, small]  # 1 decode + 2 tokens <= 4


def test_decodes_count_one_each_against_the_budget():
    sched, mk = make(budget=3), Seqs()
    s = [mk([i + 10]) for i in range(4)]
    for x in s[:3]:
        sched.add(x)
    assert step(sched) == s[:3]  # 1 + 1 + 1 = 3
    sched.add(s[3])
    assert step(sched) == s[:3]  # 3 decodes use the whole budget
    sched.finish(s[0], "stop")
    assert step(sched) == [s[1], s[2], s[3]]  # 2 decodes + 1 prompt token


def test_budget_counts_only_uncached_prompt_tokens():
    sched, mk = make(block_size=4, budget=4), Seqs()
    prompt = list(range(10, 19))  # 9 tokens, 8 of them in 2 full blocks
    a, b = mk(prompt), mk(prompt)
    sched.add(a)
    sched.add(b)
    assert step(sched) == [a]  # 9 > 4: a runs alone; b's 9 tokens do not fit what is left
    assert step(sched) == [a, b]  # a's decode (1) + b's one uncached token (1) <= 4
    assert b.prefix_hits == 8 and sched.blocks.hits == 2


def test_preemption_frees_the_newest_and_readmits_it_with_its_outputs():
    # 4 blocks of 2 tokens; a and b take 2 blocks each, c cannot get a slot (max_num_seqs 2)
    sched, mk = make(num_blocks=4, block_size=2, max_num_seqs=2), Seqs()
    a, b, c = mk([10, 11, 12]), mk([20, 21, 22]), mk([30])
    for s in (a, b, c):
        sched.add(s)
    assert step(sched) == [a, b]
    assert sched.blocks.num_free == 0
    assert step(sched) == [a, b]  # 4 tokens each: still fit in 2 blocks
    # both now hold 5 tokens and need a third block; none is free: b (newest) is preempted
    assert step(sched) == [a]
    assert b.status is SeqStatus.WAITING and b.block_table == [] and b.num_cached == 0
    assert list(sched.waiting) == [b, c]  # at the head, ahead of c
    assert sched.num_preemptions == 1 and b.preemptions == 1
    assert b.output_ids == [1100, 1101]  # kept: they are recomputed, not resampled
    assert sched.running == [a] and len(a.block_table) == 3
    # b cannot come back yet, and c does not jump the queue
    assert step(sched) == [a]
    sched.finish(a, "stop")
    out = step(sched)
    assert out == [b, c]
    # b's first block was still cached (its second was taken by a): 2 of its 5 tokens are hits
    assert b.num_cached == 5 and b.output_ids == [1100, 1101, 1102]
    assert b.prefix_hits == 0  # reported hits are those of the first admission only
    assert b.status is SeqStatus.RUNNING and sched.blocks.hits == 1


def test_preempted_sequence_readmits_with_cache_hits_counted():
    sched, mk = make(num_blocks=4, block_size=2, max_num_seqs=2), Seqs()
    a, b = mk([10, 11, 12]), mk([20, 21, 22])
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    step(sched)  # b preempted
    assert b.status is SeqStatus.WAITING
    sched.finish(a, "stop")
    bm = sched.blocks
    assert bm.cached_tokens(b) == 2
    seqs = sched.schedule()
    assert seqs == [b]
    assert b.num_cached == 2 and b.num_new == 3  # recompute tokens 2..4 only


def test_newest_sequence_needing_a_block_preempts_itself():
    sched, mk = make(num_blocks=4, block_size=2, max_num_seqs=2), Seqs()
    a, b = mk([10, 11, 12]), mk([20, 21, 22, 23])
    sched.add(a)
    sched.add(b)
    assert step(sched) == [a, b]
    # a (4 tokens) fits its 2 blocks; b (5 tokens) needs a third and none is free
    seqs = sched.schedule()
    assert seqs == [a]
    assert a.status is SeqStatus.RUNNING and len(a.block_table) == 2
    assert b.status is SeqStatus.WAITING and list(sched.waiting) == [b]
    assert all(s.block_table for s in seqs)


def test_sequence_that_cannot_grow_even_alone_waits():
    sched, mk = make(num_blocks=2, block_size=2), Seqs()
    a = mk([1, 2, 3])
    sched.add(a)
    step(sched)
    step(sched)  # 5 tokens now: needs 3 blocks, the cache has 2
    assert sched.schedule() == []
    assert a.status is SeqStatus.WAITING and a.block_table == [] and sched.num_preemptions == 1


def test_group_of_identical_prompts_shares_prefix_blocks_in_one_step():
    n, prompt = 4, list(range(10, 20))  # 10 tokens: 2 full blocks of 4 + 2 tokens
    sched, mk = make(block_size=4), Seqs()
    group = [mk(prompt) for _ in range(n)]
    for s in group:
        sched.add(s)
    seqs = sched.schedule()
    assert seqs == group
    assert [s.num_new for s in seqs] == [10] + [2] * (n - 1)
    assert [s.prefix_hits for s in seqs] == [0] + [8] * (n - 1)
    bm = sched.blocks
    assert bm.num_used == 2 + n
    assert bm.hits == (n - 1) * 2
    shared = group[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in group)
    assert len({s.block_table[2] for s in group}) == n
    assert [bm.ref[b] for b in shared] == [n, n]
    # the later ones are the first's twins (the engine copies their last block and logits)
    assert group[0].twin is None and all(s.twin is group[0] for s in group[1:])


def test_twins_are_same_tokens_admitted_in_one_step():
    sched, mk = make(block_size=4), Seqs()
    a, b, c = mk([5, 6, 7]), mk([5, 6, 7]), mk([5, 6, 8])
    for s in (a, b, c):
        sched.add(s)
    assert step(sched) == [a, b, c]
    assert (a.twin, b.twin, c.twin) == (None, a, None)
    d = mk([5, 6, 7])  # the same prompt a step later: a prefix-cache hit, computed
    sched.add(d)
    step(sched)
    assert d.twin is None


def test_bad_limits_rejected():
    with pytest.raises(ValueError, match="must be >= 1"):
        make(max_num_seqs=0)
    with pytest.raises(ValueError, match="must be >= 1"):
        make(budget=0)
