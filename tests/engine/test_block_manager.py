"""BlockManager: paged KV blocks, reference counts, the chained-hash prefix cache and its LRU reuse."""

from __future__ import annotations

import itertools

import pytest

from tidal.contracts import SamplingParams
from tidal.engine.block_manager import BlockManager
from tidal.engine.sequence import Sequence

BS = 4
_ids = itertools.count()


def seq(prompt) -> Sequence:
    n = next(_ids)
    return Sequence(f"s{n}", list(prompt), SamplingParams(), arrival=n)


def decode_one(bm: BlockManager, s: Sequence, token: int) -> None:
    """What the engine does per decode: the step fed everything so far, then a token is appended;
    the next schedule() makes room for that token with append_slot."""
    s.num_cached = s.num_tokens
    s.output_ids.append(token)
    bm.append_slot(s)


def test_fresh_sequence_gets_ceil_blocks_and_no_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = seq(range(10, 20))  # 10 tokens -> 3 blocks (2 full + 2 tokens)
    assert bm.cached_tokens(s) == 0 and bm.blocks_needed(s) == 3
    bm.allocate(s)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert s.num_cached == 0
    assert [bm.ref[b] for b in s.block_table] == [1, 1, 1]
    assert bm.num_free == 5 and bm.num_used == 3
    assert bm.hits == 0 and bm.misses == 3
    with pytest.raises(RuntimeError, match="already has blocks"):
        bm.allocate(s)


@pytest.mark.parametrize("n_tokens,blocks", [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_block_count_is_ceil(n_tokens, blocks):
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = seq(range(100, 100 + n_tokens))
    bm.allocate(s)
    assert len(s.block_table) == blocks


def test_same_prompt_shares_full_blocks_and_gets_private_last_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    a, b = seq(prompt), seq(prompt)
    bm.allocate(a)
    assert bm.cached_tokens(b) == 8
    assert bm.blocks_needed(b) == 1  # shared blocks are in use: only the private tail is new
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.ref[x] for x in a.block_table] == [2, 2, 1]
    assert bm.ref[b.block_table[2]] == 1
    assert bm.hits == 2 and b.num_cached == 2 * BS
    assert bm.num_used == 4
    c = seq(prompt)
    bm.allocate(c)
    assert bm.hits == 4 and [bm.ref[x] for x in a.block_table[:2]] == [3, 3]


def test_exact_multiple_prompt_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(10, 18))  # exactly 2 full blocks
    a, b = seq(prompt), seq(prompt)
    bm.allocate(a)
    assert bm.cached_tokens(b) == BS  # not 8: the last token must be computed for its logits
    bm.allocate(b)
    assert b.num_cached == BS and b.num_new == BS
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    assert bm.hits == 1
    # a one-block prompt: nothing can be reused at all
    one = list(range(50, 54))
    c, d = seq(one), seq(one)
    bm.allocate(c)
    bm.allocate(d)
    assert d.num_cached == 0 and d.block_table != c.block_table and bm.hits == 1


def test_hash_is_chained_over_the_prefix():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    # same second block, different first block: no hit at all
    other_head = seq([9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert bm.cached_tokens(other_head) == 0
    bm.allocate(other_head)
    assert bm.hits == 0 and other_head.block_table[1] != a.block_table[1]
    # same first block, different second: only the first block is a hit
    other_tail = seq([1, 2, 3, 4, 5, 6, 7, 0, 9])
    bm.allocate(other_tail)
    assert other_tail.num_cached == BS and bm.hits == 1
    assert other_tail.block_table[0] == a.block_table[0]
    assert other_tail.block_table[1] != a.block_table[1]


def test_freed_blocks_stay_hits_until_reused_lru_tail_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(10, 19))  # 9 tokens: 2 full blocks + 1 token
    a = seq(prompt)
    bm.allocate(a)
    full = a.block_table[:2]
    bm.free_seq(a)
    assert a.block_table == [] and a.num_cached == 0
    assert bm.num_free == 4 and bm.ref == [0, 0, 0, 0]
    # the freed blocks are still in the prefix cache: an identical prompt takes them back
    b = seq(prompt)
    assert bm.cached_tokens(b) == 8
    assert bm.blocks_needed(b) == 3  # the cached blocks are free, so taking them costs free blocks
    bm.allocate(b)
    assert b.block_table[:2] == full and b.num_cached == 8 and bm.hits == 2
    assert bm.num_free == 1
    bm.free_seq(b)
    # other data takes the least recently freed blocks first; the prompt's tail is freed first,
    # so the head of the cached prefix survives longest
    x = seq(range(200, 205))  # 2 blocks: the never-used block and the unregistered tail block
    bm.allocate(x)
    assert not set(x.block_table) & set(full)
    assert bm.cached_tokens(seq(prompt)) == 8
    bm.free_seq(x)
    y = seq(range(300, 303))  # 1 block: evicts the prompt's second full block
    bm.allocate(y)
    assert y.block_table == [full[1]]
    assert bm.cached_tokens(seq(prompt)) == BS
    z = seq(range(400, 403))
    bm.allocate(z)
    assert z.block_table == [full[0]]
    c = seq(prompt)
    assert bm.cached_tokens(c) == 0
    bm.free_seq(y)
    bm.free_seq(z)
    hits = bm.hits
    bm.allocate(c)
    assert c.num_cached == 0 and bm.hits == hits


def test_append_slot_grows_at_block_boundaries_and_registers_full_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = seq([10, 11, 12, 13, 14, 15])  # 6 tokens: 2 blocks, the second half full
    bm.allocate(s)
    assert len(s.block_table) == 2
    decode_one(bm, s, 16)  # token 7 goes to slot 6 of block 1
    assert len(s.block_table) == 2
    # the second block is not full yet (its last slot is written by the next decode): no hit
    assert bm.cached_tokens(seq(s.tokens + [50, 51])) == BS
    decode_one(bm, s, 17)  # 8 tokens: this decode writes slot 7, completing block 1
    assert len(s.block_table) == 2
    assert bm.cached_tokens(seq(s.tokens + [50, 51])) == 2 * BS
    decode_one(bm, s, 18)  # 9 tokens: slot 8 needs a third block
    assert len(s.block_table) == 3 and bm.num_used == 3
    for t in (19, 20, 21):
        decode_one(bm, s, t)
        assert len(s.block_table) == 3  # 10..12 tokens fit in 3 blocks
    decode_one(bm, s, 22)
    assert len(s.block_table) == 4
    # multi-turn: the next turn's prompt is prompt + response + new text, and hits the blocks
    # completed during decoding
    turn2 = seq(s.tokens + [60, 61, 62])
    bm.allocate(turn2)
    assert turn2.num_cached == 3 * BS
    assert turn2.block_table[:3] == s.block_table[:3]
    assert bm.hits == 3


def test_append_slot_after_cached_prefix_registers_continuation():
    """A sequence that itself started from a cache hit registers its later blocks too."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = [1, 2, 3, 4, 5, 6]
    a, b = seq(prompt), seq(prompt)
    bm.allocate(a)
    bm.allocate(b)
    assert b.num_cached == BS
    decode_one(bm, b, 7)
    decode_one(bm, b, 8)
    c = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.cached_tokens(c) == 2 * BS


def test_reset_prefix_cache_stops_all_hits():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(10, 19))
    a = seq(prompt)
    bm.allocate(a)
    bm.free_seq(a)
    b = seq(prompt)
    bm.allocate(b)  # running holder of the cached blocks
    assert bm.hits == 2
    bm.reset_prefix_cache()
    c = seq(prompt)
    assert bm.cached_tokens(c) == 0
    bm.allocate(c)
    assert c.num_cached == 0 and bm.hits == 2
    assert not set(c.block_table) & set(b.block_table)
    # the reset only forgets hashes: running sequences keep their blocks
    assert [bm.ref[x] for x in b.block_table] == [1, 1, 1]
    # new prompts register again after a reset
    d = seq(prompt)
    bm.allocate(d)
    assert d.num_cached == 8 and d.block_table[:2] == c.block_table[:2]


def test_reset_prefix_cache_does_not_register_blocks_filled_before_the_reset():
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = seq([10, 11])  # prefilled with the old weights
    bm.allocate(s)
    decode_one(bm, s, 12)
    bm.reset_prefix_cache()  # weight update: K/V of tokens 10, 11, 12 are stale
    decode_one(bm, s, 13)  # completes block 0 (slot of 13 written with the new weights)
    assert bm.cached_tokens(seq([10, 11, 12, 13, 14])) == 0


def test_can_allocate_counts_free_blocks():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = seq(range(10, 18))  # 2 full blocks
    bm.allocate(a)
    assert bm.num_free == 1
    assert not bm.can_allocate(seq(range(100, 105)))  # needs 2, has 1
    assert bm.can_allocate(seq(range(100, 104)))
    # a continuation of `a` hits both of its (in-use) blocks and needs only one new block
    cont = seq(list(range(10, 18)) + [99])
    assert bm.blocks_needed(cont) == 1 and bm.can_allocate(cont)
    bm.allocate(cont)
    assert bm.num_free == 0
    blocked = seq([7])
    assert not bm.can_allocate(blocked) and bm.blocks_needed(blocked) == 1
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.allocate(blocked)
    assert blocked.block_table == []
    # a copy of `a`'s prompt (an exact block multiple) still needs a private last block
    assert not bm.can_allocate(seq(range(10, 18)))
    bm.free_seq(cont)
    assert bm.can_allocate(blocked)


def test_can_append():
    bm = BlockManager(num_blocks=2, block_size=BS)
    s = seq([1, 2, 3, 4, 5, 6, 7])
    bm.allocate(s)
    assert bm.num_free == 0
    s.num_cached = 7
    s.output_ids.append(8)  # 8 tokens fit the 2 blocks
    assert bm.can_append(s)
    bm.append_slot(s)
    s.num_cached = 8
    s.output_ids.append(9)  # a 9th token needs a block and none is free
    assert not bm.can_append(s)


def test_bad_sizes_rejected():
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size >= 1"):
        BlockManager(4, 0)


def test_keys_between_is_a_slice_of_the_keys():
    from tidal.engine.sequence import SeqImages

    seq = Sequence("r", [1, 2, 3, 4, 5], SamplingParams())
    seq.output_ids = [6, 7, 8]
    spans = [(0, 8), (0, 5), (2, 4), (3, 7), (5, 8), (6, 7), (5, 5), (4, 6)]
    for a, b in spans:
        assert seq.keys_between(a, b) == seq.keys[a:b], (a, b)
    seq.images = SeqImages([], [1, 2], None, [1, -9, -9, 4, 5])  # an image's key stands for its placeholders
    for a, b in spans:
        assert seq.keys_between(a, b) == seq.keys[a:b], (a, b)
