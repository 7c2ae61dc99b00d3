"""The broadcast sender streams: it takes the trainer's weights one tensor at a time (as trainer
ranks gather them from their shards), sends each bucket as soon as it is full, and fingerprints
what it sent as the engines will (`weights_checksum`), without ever holding the whole set."""

import os
import random
import zlib

import torch

from tidal.engine.weights import StreamingChecksum, crc32_combine, weights_checksum
from tidal.sync.broadcast import _buckets, send_weights


class _Done:
    def wait(self) -> None:
        pass


class RecordingGroup:
    """A process group that keeps what rank 0 broadcasts and how many tensors had been produced."""

    def __init__(self, produced: list[int]) -> None:
        self.produced = produced
        self.sent: list[tuple[torch.Tensor, int]] = []

    def broadcast(self, flat: torch.Tensor, src: int) -> _Done:
        assert src == 0
        self.sent.append((flat.clone(), self.produced[0]))
        return _Done()


def test_buckets_go_out_as_they_fill_with_the_receivers_grouping_and_checksum():
    gen = torch.Generator().manual_seed(0)
    tensors = [(f"layer.{i}.w", torch.randn(int(n), 8, generator=gen)) for i, n in enumerate([3, 40, 7, 120, 1, 9, 30])]
    produced = [0]

    def lazily():
        for name, t in tensors:
            produced[0] += 1
            yield name, t

    group = RecordingGroup(produced)
    bucket_bytes = 50 * 8 * 4  # 50 rows of fp32
    checksum = send_weights(group, lazily(), bucket_bytes)
    want = _buckets([(n, tuple(t.shape)) for n, t in tensors], 4, bucket_bytes)
    assert len(group.sent) == len(want) == 3  # [3, 40, 7] rows, [120] alone, [1, 9, 30]
    for (flat, seen), idx in zip(group.sent, want, strict=True):
        assert torch.equal(flat, torch.cat([tensors[i][1].reshape(-1) for i in idx]))
        # sent once the next tensor did not fit (or the stream ended): one tensor past the bucket at most
        assert seen <= idx[-1] + 2
    assert checksum == weights_checksum(tensors)


def test_crc32_combine_chains_crcs_as_zlib_does_and_the_streaming_checksum_ignores_order():
    rng = random.Random(3)
    for _ in range(100):
        a, b = os.urandom(rng.randrange(0, 200)), os.urandom(rng.randrange(0, 20_000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    named = [(f"w{i}", torch.randn(i + 1, 3)) for i in range(12)]
    check = StreamingChecksum()
    for n, t in reversed(named):
        check.add(n, t)
    assert check.hexdigest() == weights_checksum(named)
