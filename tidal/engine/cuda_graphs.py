"""Decode steps replayed from CUDA graphs: one launch for a whole forward pass.

A pure decode step of a small model is hundreds of small kernels (a dozen per layer); launched one
by one from Python, the GPU waits on the host for most of the step. `DecodeGraphs` captures the
decode path's forward (`tidal.engine.decode_path`: embedding, every layer with the paged
attention kernel reading block tables on the device, final norm, output head) once per
batch-size bucket into a CUDA graph over static buffers, and a step only fills those buffers and
replays the graph of the smallest bucket that holds the batch.

Per step the host writes five things for each sequence into one pinned staging area: its last
token, that token's position and cache slot, its context length and its block table row; two
copies take them to the device (one for the four vectors, one for the used columns of the
table). Rows past the batch in the bucket are padding: token 0 at position 0 writing its key and
value to a slot no sequence owns (the runner's extra padding block), reading a context of that
one slot; their logits are never read.

A graph replays the addresses it was captured with: the weights', the KV cache's and the
buffers'. `check` compares those addresses (the parameters' and caches' storage, and what the
engine says moved: a quantized copy re-made, the cache re-allocated after sleep) with the
captured ones and drops stale graphs, which are captured again on their next use. Weight
updates copy into the parameters in place, so an RL run captures once.

`DecodeGraphs(..., capture=False)` runs the same static-buffer path eagerly: on a CPU for tests,
and on a GPU where capture failed (the reason is logged once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from tidal.engine.sequence import Sequence
from tidal.hardware import CPU, is_cuda

log = logging.getLogger(__name__)


def bucket_sizes(max_seqs: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, 16, then every multiple of 16 up to 64 and
    of 32 beyond, up to `max_seqs` (which is always one). A batch pads to the next size: at most
    31 idle rows, which cost little next to a launch per kernel."""
    sizes = {1, 2, 4, 8, *range(16, 65, 16), *range(96, max_seqs + 1, 32), max_seqs}
    return sorted(s for s in sizes if s <= max_seqs)


class DecodeGraphs:
    """See the module docstring. `forward(plan)` is the decode path (logits [B, V] of a
    `BatchPlan` with device block tables); `plan_of(buffers)` makes that plan from static
    views; `bindings()` lists the addresses a captured graph depends on."""

    def __init__(
        self,
        forward: Callable,
        plan_of: Callable,
        bindings: Callable[[], tuple[int, ...]],
        device: torch.device,
        max_seqs: int,
        width: int,
        block_size: int,
        pad_block: int,
        capture: bool,
        rope_offsets: Callable[[list[Sequence]], list[int]] | None = None,
    ) -> None:
        self.forward, self.plan_of, self.bindings = forward, plan_of, bindings
        # Qwen's vision-language models: each sequence's rotary position is its position plus an
        # offset its images set (`vision.rope_positions`); fed as row 4 of the buffers
        self.rope_offsets = rope_offsets
        self.device, self.block_size, self.pad_block = device, block_size, pad_block
        self.sizes = bucket_sizes(max_seqs)
        n = self.sizes[-1]
        pin = self.pinned = is_cuda(device)
        # the host writes the pinned buffers only once the last step's copies have read them
        self.copied: torch.cuda.Event | None = None
        # ids, positions, slots, context lengths, rotary positions ([5, n]) and block tables ([n, width])
        self.host_vec = torch.zeros(5, n, dtype=torch.long, device=CPU, pin_memory=pin)
        self.host_tab = torch.zeros(n, width, dtype=torch.int32, device=CPU, pin_memory=pin)
        self.pad_column = torch.tensor([[0], [0], [pad_block * block_size], [1], [0]], device=CPU)
        # per staged table row: (the sequence's block table list, how many of its entries)
        self.staged: list[tuple[list[int], int] | None] = [None] * n
        self.vec = torch.zeros(5, n, dtype=torch.long, device=device)
        self.tab = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.capture = capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.pool = None
        self.logits: Tensor | None = None
        self.captured_with: tuple[int, ...] | None = None
        self.capture_s = 0.0
        self.graph_bytes = 0
        self.replays = 0
        self._pad(0, n)
        self.vec.copy_(self.host_vec)
        self.tab.copy_(self.host_tab)

    def size_for(self, batch: int) -> int | None:
        """The bucket a batch of `batch` sequences runs in (None: more than the largest)."""
        for s in self.sizes:
            if s >= batch:
                return s
        return None

    def _pad(self, start: int, end: int) -> None:
        if start >= end:
            return
        self.host_vec[:, start:end] = self.pad_column
        self.host_tab[start:end, 0] = self.pad_block
        self.staged[start:end] = [None] * (end - start)

    def _static_plan(self, size: int):
        return self.plan_of(
            input_ids=self.vec[0, :size],
            positions=self.vec[1, :size],
            slots=self.vec[2, :size],
            lens=self.vec[3, :size],
            tables=self.tab[:size],
            rotary=self.vec[4, :size] if self.rope_offsets is not None else None,
        )

    def fill(self, seqs: list[Sequence], size: int, ids: Tensor | None = None, known: list[int] | None = None) -> None:
        """Write the step's inputs for `seqs` (each computing one token) and padding up to `size`
        into the static buffers. `ids`: the tokens to feed, already on the device, one past each
        sequence's known tokens (sampled by a step whose result the host has not read yet);
        default: each sequence's last known token. `known`: each sequence's count of known
        tokens (prompt and read output), where the caller has it."""
        # Per sequence only one list of lengths and the block tables' new entries: at 512
        # sequences this is most of the host's part of a step, which the GPU would otherwise wait
        # for. Positions and slots are array arithmetic over the staged tables.
        b, bs = len(seqs), self.block_size
        if self.copied is not None:  # the last step's copies have read the pinned buffers
            self.copied.synchronize()
        pending = 0 if ids is None else 1
        if known is None:
            known = [len(s.prompt_ids) + len(s.output_ids) for s in seqs]
        lens = np.array(known, np.int64) + pending
        width = self._write_tables([s.block_table for s in seqs])
        vec = self.host_vec.numpy()
        pos = lens - 1
        vec[1, :b] = pos
        vec[2, :b] = self.host_tab.numpy()[np.arange(b), pos // bs] * bs + pos % bs
        vec[3, :b] = lens
        if self.rope_offsets is not None:
            vec[4, :b] = pos + np.array(self.rope_offsets(seqs), np.int64)
        if ids is None:
            vec[0, :b] = [s.output_ids[-1] if s.output_ids else s.prompt_ids[-1] for s in seqs]
        self._pad(b, size)
        self.vec[:, :size].copy_(self.host_vec[:, :size], non_blocking=True)
        self.tab[:size, :width].copy_(self.host_tab[:size, :width], non_blocking=True)
        if self.pinned:
            self.copied = torch.cuda.Event()
            self.copied.record()
        if ids is not None:  # after the copy above, in stream order (row 0 holds stale tokens)
            self.vec[0, :b].copy_(ids)

    def _write_tables(self, tables: list[list[int]]) -> int:
        """Bring the staged block tables' first rows up to `tables`; returns the widest. A row
        that holds the same sequence's table as last time only gets the blocks added since
        (tables only grow while a sequence runs; a freed sequence gets a new list)."""
        staged, host = self.staged, self.host_tab.numpy()
        width = 1
        for i, table in enumerate(tables):
            n = len(table)
            if n > width:
                width = n
            had = staged[i]
            if had is not None and had[0] is table:
                if had[1] != n:
                    host[i, had[1] : n] = table[had[1] :]
                    staged[i] = (table, n)
            else:
                host[i, :n] = table
                staged[i] = (table, n)
        return width

    def run(self, seqs: list[Sequence], ids: Tensor | None = None, known: list[int] | None = None) -> Tensor:
        """Logits [len(seqs), V] of a pure decode step over `seqs` (`ids`, `known`: as `fill`
        takes them)."""
        size = self.size_for(len(seqs))
        if not self.capture:
            self.fill(seqs, size, ids, known)
            return self.forward(self._static_plan(size))[: len(seqs)]
        self.check()
        if size not in self.graphs and not self._capture_or_give_up([size]):
            return self.run(seqs, ids, known)  # eagerly from now on
        self.fill(seqs, size, ids, known)  # after capturing: capturing writes padding
        graph, logits = self.graphs[size]
        graph.replay()
        self.replays += 1
        return logits[: len(seqs)]

    def check(self) -> None:
        """Drop the graphs if anything they read has moved since they were captured."""
        if self.graphs and self.bindings() != self.captured_with:
            log.info("CUDA graphs: the weights or the KV cache moved; capturing again")
            self.graphs.clear()

    def capture_all(self) -> None:
        """Capture every bucket (largest first, so the smaller ones reuse its memory)."""
        if not self._capture_or_give_up(sorted(self.sizes, reverse=True)):
            return
        log.info(
            "CUDA graphs: %d batch sizes (1 .. %d) captured in %.1f s, %.0f MiB",
            len(self.sizes),
            self.sizes[-1],
            self.capture_s,
            self.graph_bytes / 2**20,
        )

    def _capture_or_give_up(self, sizes: list[int]) -> bool:
        """Capture `sizes`; where the forward cannot be captured (an op that syncs or allocates
        on the host: a layer given to the engine later, say), say why once and run eagerly."""
        try:
            self._capture(sizes)
            return True
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            log.warning("CUDA graphs off: capturing the decode step failed (%s); it runs eagerly", why)
            self.capture = False
            self.reset()
            return False

    def _capture(self, sizes: list[int]) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # the padding rows' inputs: every static row reads and writes only the padding slot
        self._pad(0, self.sizes[-1])
        self.vec.copy_(self.host_vec)
        self.tab.copy_(self.host_tab)
        self.captured_with = self.bindings()
        for size in sizes:
            plan = self._static_plan(size)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: kernels compiled, library handles made
                warm = self.forward(plan)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self.logits is None:  # one output for every graph: [largest bucket, vocabulary]
                self.logits = warm.new_empty(self.sizes[-1], warm.shape[1])
            del warm
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[:size].copy_(self.forward(plan))
            self.graphs[size] = (graph, self.logits[:size])
        torch.cuda.synchronize(self.device)
        self.graph_bytes += torch.cuda.memory_reserved(self.device) - before
        self.capture_s += time.perf_counter() - t0

    def reset(self) -> None:
        """Drop every graph and their memory (the engine sleeps); the next use captures again."""
        self.graphs.clear()
        self.pool = self.logits = None
        self.graph_bytes = 0

    def stats(self) -> dict:
        return {
            "cuda_graphs": len(self.graphs),
            "cuda_graph_replays": self.replays,
            "cuda_graph_capture_s": round(self.capture_s, 3),
            "cuda_graph_mib": round(self.graph_bytes / 2**20, 1),
        }
