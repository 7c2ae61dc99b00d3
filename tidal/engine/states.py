"""The recurrent layers' states of running sequences, beside the paged K/V (hybrid models).

A hybrid model's recurrent mixers (`tidal.recurrent`) carry, per sequence, a conv state (the
last K inputs of their causal convolution) and most a recurrent state (GDN's [heads, dk, dv],
Mamba-2's [heads, head dim, state]). Unlike K/V they do not grow with the sequence, and they
cannot be cut at a token: the state after token t is only known once 0..t have run.

`StatePool` holds them in preallocated slots, one per sequence that may run at once
(`max_num_seqs`), and snapshots (`tidal.engine.state_slots` says which slot is what); the block
manager hands a slot to each admitted sequence and takes it back when it finishes, is aborted or
is preempted. A step's mixer call (`run`) takes the decode tokens of every running sequence as
one [B, 1, H] batch with their states gathered from the pool, and each prefill on its own, from
its slot's state when it continues one or from none when it starts; the states after the call go
back to the slots. A GRPO group's samples admitted together compute their prompt once: the lead's state
after the prompt is copied to each twin's slot (`copy`), like its K/V.

Prefix-cache hits need the states at the hit's end. A sequence's states are kept as a snapshot
whenever it reaches a multiple of `state_snapshot_tokens` (a prefill is split there; a decode
copies its row after the step), and a later sequence whose prefix hits that far starts from the
snapshot (copied into its slot before the step) and computes the rest. Sleep frees the pool with
the K/V; wake allocates it zeroed; new weights drop the snapshots with the prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tidal.recurrent import StateView


@dataclass
class StatePlan:
    """Which flat tokens of a step continue which state."""

    decode_tok: Tensor  # [Bd] flat index of each single token that continues a state
    decode_slots: Tensor  # [Bd] its sequence's state slot
    snap_rows: Tensor  # rows of the decode batch whose states after the step are kept ...
    snap_slots: Tensor  # ... in these snapshot slots
    # (flat start, end, state slot, continues a state, snapshots) per sequence computing several
    # tokens or its first one; snapshots: (tokens into the call, snapshot slot) after which the
    # states are kept
    prefill: list[tuple[int, int, int, bool, tuple[tuple[int, int], ...]]] = field(default_factory=list)

    def to(self, device: torch.device) -> StatePlan:
        moved = (t.to(device) for t in (self.decode_tok, self.decode_slots, self.snap_rows, self.snap_slots))
        return StatePlan(*moved, self.prefill)


@dataclass(frozen=True)
class StateShape:
    conv: tuple[tuple[int, ...], torch.dtype] | None  # per-sequence shape and dtype
    recurrent: tuple[tuple[int, ...], torch.dtype] | None


class StatePool:
    """Per recurrent layer, `slots` conv and recurrent states (see the module docstring)."""

    def __init__(self, slots: int, device: torch.device) -> None:
        self.slots = slots
        self.device = device
        self.shapes: dict[int, StateShape] = {}  # by layer index, from the start-up probe
        self.conv: dict[int, Tensor] = {}
        self.recurrent: dict[int, Tensor] = {}

    def allocate(self) -> None:
        def make(spec):
            return None if spec is None else torch.zeros(self.slots, *spec[0], dtype=spec[1], device=self.device)

        self.conv = {i: make(s.conv) for i, s in self.shapes.items()}
        self.recurrent = {i: make(s.recurrent) for i, s in self.shapes.items()}

    def release(self) -> None:
        self.conv, self.recurrent = {}, {}

    def nbytes(self) -> int:
        pools = (*self.conv.values(), *self.recurrent.values())
        return sum(t.numel() * t.element_size() for t in pools if t is not None)

    def run(self, mixer: nn.Module, forward: Callable, hidden: Tensor, plan) -> Tensor:
        """One mixer's step over the flat batch `hidden` [1, T, H] (see the module docstring).
        Without a plan (the start-up probe): one fresh call, whose states give the shapes."""
        layer = mixer.layer_idx
        if plan is None:
            view = StateView()
            out = forward(hidden, cache=view)
            spec = lambda t: None if t is None else (tuple(t.shape[1:]), t.dtype)  # noqa: E731
            self.shapes[layer] = StateShape(spec(view.conv), spec(view.recurrent))
            return out
        steps: StatePlan = plan.states
        conv, rec = self.conv.get(layer), self.recurrent.get(layer)
        parts: list[tuple[Tensor | slice, Tensor]] = []
        if steps.decode_tok.numel():
            slots = steps.decode_slots
            view = StateView(
                None if conv is None else conv.index_select(0, slots),
                None if rec is None else rec.index_select(0, slots),
            )
            out = forward(hidden[0].index_select(0, steps.decode_tok)[:, None], cache=view)
            self._put(layer, slots, view)
            if steps.snap_rows.numel():
                self._copy_rows(layer, slots.index_select(0, steps.snap_rows), steps.snap_slots)
            parts.append((steps.decode_tok, out[:, 0]))
        for start, end, slot, previous, cuts in steps.prefill:
            view = StateView()
            if previous:
                view = StateView(
                    None if conv is None else conv[slot : slot + 1].clone(),
                    None if rec is None else rec[slot : slot + 1].clone(),
                )
            # split where snapshots are due: the states after each piece are kept
            done = 0
            for cut, snap in (*cuts, (end - start, None)):
                if cut > done:
                    out = forward(hidden[:, start + done : start + cut], cache=view)
                    parts.append((slice(start + done, start + cut), out[0]))
                    view.previous, done = True, cut
                if snap is not None:
                    self._put(layer, snap, view)
            self._put(layer, slot, view)
        result = hidden.new_empty(hidden.shape[1], parts[0][1].shape[-1])
        for where, values in parts:
            if isinstance(where, slice):
                result[where] = values
            else:
                result.index_copy_(0, where, values.to(result.dtype))
        return result[None]

    def _put(self, layer: int, slots: Tensor | int, view: StateView) -> None:
        for pool, state in ((self.conv.get(layer), view.conv), (self.recurrent.get(layer), view.recurrent)):
            if pool is None or state is None:
                continue
            if isinstance(slots, int):
                pool[slots].copy_(state[0])
            else:
                pool.index_copy_(0, slots, state.to(pool.dtype))

    def _copy_rows(self, layer: int, src: Tensor, dst: Tensor) -> None:
        for pool in (self.conv.get(layer), self.recurrent.get(layer)):
            if pool is not None:
                pool.index_copy_(0, dst, pool.index_select(0, src))

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Every layer's states of slots `src` into slots `dst` (a group's twins)."""
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for pool in (*self.conv.values(), *self.recurrent.values()):
            if pool is not None:
                pool.index_copy_(0, d, pool.index_select(0, s))
