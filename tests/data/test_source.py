"""DataSource: epoch permutations, seeding and exact resume from a state dict."""

from __future__ import annotations

import json
import random

import pytest

from tidal.data.dataset import PromptRecord
from tidal.data.source import DataSource


def make_records(n: int) -> list[PromptRecord]:
    return [PromptRecord(index=i, prompt=f"p{i}", text=f"p{i}", input_ids=[i + 3]) for i in range(n)]


def indices(batch: list[PromptRecord]) -> list[int]:
    return [r.index for r in batch]


def take(source: DataSource, n_batches: int) -> list[list[int]]:
    return [indices(source.next_batch()) for _ in range(n_batches)]


def test_each_epoch_covers_every_record_once():
    src = DataSource(make_records(10), batch_size=5, seed=3)
    for epoch in range(4):
        assert src.epoch == epoch
        seen = indices(src.next_batch()) + indices(src.next_batch())
        assert sorted(seen) == list(range(10))
    assert src.samples_consumed == 40


def test_epoch_order_is_the_seeded_permutation():
    src = DataSource(make_records(7), batch_size=7, seed=11)
    for epoch in range(3):
        expected = list(range(7))
        random.Random(11 + epoch).shuffle(expected)
        assert indices(src.next_batch()) == expected


def test_no_shuffle_is_identity_and_batches_straddle_epochs():
    src = DataSource(make_records(5), batch_size=3, shuffle=False)
    assert take(src, 4) == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]
    assert (src.epoch, src.position, src.samples_consumed) == (2, 2, 12)


def test_batch_larger_than_dataset_spans_several_epochs():
    src = DataSource(make_records(2), batch_size=5, shuffle=False)
    assert indices(src.next_batch()) == [0, 1, 0, 1, 0]
    assert (src.epoch, src.position) == (2, 1)


def test_same_seed_same_order_different_seed_different_order():
    a = take(DataSource(make_records(20), batch_size=4, seed=1), 10)
    b = take(DataSource(make_records(20), batch_size=4, seed=1), 10)
    c = take(DataSource(make_records(20), batch_size=4, seed=2), 10)
    assert a == b
    assert a != c
    # Consecutive epochs are reshuffled, not repeated.
    assert a[:5] != a[5:]


def test_records_are_returned_not_copied():
    records = make_records(3)
    src = DataSource(records, batch_size=3, shuffle=False)
    assert all(x is y for x, y in zip(src.next_batch(), records, strict=True))


@pytest.mark.parametrize("consumed_batches", [0, 1, 2, 3, 5, 7])
def test_state_dict_round_trip_through_json(consumed_batches):
    # batch 3 of 10 records straddles epochs at batches 3, 6, ...; mid-epoch at the others.
    original = DataSource(make_records(10), batch_size=3, seed=5)
    take(original, consumed_batches)
    state = json.loads(json.dumps(original.state_dict()))

    restored = DataSource(make_records(10), batch_size=3, seed=5)
    restored.load_state_dict(state)
    assert (restored.epoch, restored.position, restored.samples_consumed) == (
        original.epoch,
        original.position,
        original.samples_consumed,
    )
    assert take(restored, 12) == take(original, 12)


def test_state_dict_contents():
    src = DataSource(make_records(4), batch_size=3, seed=9)
    take(src, 2)
    assert src.state_dict() == {
        "epoch": 1,
        "position": 2,
        "samples_consumed": 6,
        "seed": 9,
        "shuffle": True,
        "num_records": 4,
    }


def test_restore_adopts_checkpoint_seed_and_shuffle():
    original = DataSource(make_records(8), batch_size=3, seed=4)
    take(original, 3)
    restored = DataSource(make_records(8), batch_size=3, seed=999, shuffle=False)
    restored.load_state_dict(original.state_dict())
    assert take(restored, 6) == take(original, 6)


def test_restore_into_different_dataset_size_fails():
    state = DataSource(make_records(8), batch_size=2).state_dict()
    with pytest.raises(ValueError, match="checkpoint has 8 records, dataset has 9"):
        DataSource(make_records(9), batch_size=2).load_state_dict(state)


def test_empty_records_rejected():
    with pytest.raises(ValueError, match="empty dataset"):
        DataSource([], batch_size=1)


@pytest.mark.parametrize("batch_size", [0, -1])
def test_bad_batch_size_rejected(batch_size):
    with pytest.raises(ValueError, match=f"batch_size must be >= 1, got {batch_size}"):
        DataSource(make_records(3), batch_size=batch_size)
