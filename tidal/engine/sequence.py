"""One request's state inside the engine: its tokens, KV blocks and result."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tidal.contracts import SamplingParams

if TYPE_CHECKING:
    from torch import Tensor

    from tidal.vision import Image


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not in the cache: new, or preempted (its KV will be recomputed)
    RUNNING = "running"  # its KV is in the cache; decodes one token per step
    FINISHED = "finished"


@dataclass
class SeqImages:
    """A prompt's images as the engine runs them (`tidal.vision`)."""

    images: list[Image]
    where: list[int]  # prompt indices of their placeholder tokens, in order
    rows: Tensor  # [len(where), hidden]: the placeholders' feature rows, in that order
    keys: list[int]  # the prompt's ids with each image's placeholders as its key (the prefix cache's)
    rope: Tensor | None = None  # [3, prompt length]: Qwen's 3-D positions of the prompt
    delta: int = 0  # and of any later token: its index + delta
    # Gemma 3's: each image's run [a, b) of prompt indices, whose tokens attend both ways
    blocks: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int = 0
    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    # per generated token, when params.top_logprobs > 0: the most likely (token id, log-prob) pairs
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # tokens whose K/V are in the cache (or are written in the step that scheduled them)
    num_cached: int = 0
    # prompt tokens found in the prefix cache at first admission (reported as cached_tokens)
    prefix_hits: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    preemptions: int = 0
    cache_epoch: int = 0  # the block manager's epoch when its blocks were allocated
    stop_ids: frozenset[int] = frozenset()
    # a sequence with the same tokens admitted earlier in this step (a GRPO group's sample): this
    # one's uncached K/V and its next-token logits are copied from it, not computed (one step only)
    twin: Sequence | None = None
    # a hybrid model's recurrent states of this sequence (`tidal.engine.states`), while it has blocks
    state_slot: int = -1
    # the snapshot its states start from at its next step (a prefix-cache hit), -1 for none
    state_from: int = -1
    # (token count, snapshot slot, block hash): states to keep after that many of its tokens, in
    # the step that computes them (`BlockManager.plan_snapshots`)
    snapshots_due: list[tuple[int, int, int]] = field(default_factory=list)
    images: SeqImages | None = None

    @property
    def keys(self) -> list[int]:
        """What the prefix cache identifies the tokens by: the tokens, with an image's
        placeholders standing as the image's content key."""
        return (self.images.keys if self.images else self.prompt_ids) + self.output_ids

    def keys_between(self, start: int, end: int) -> list[int]:
        """`keys[start:end]` without copying the rest (a block's keys, every block_size tokens of
        every running sequence: the whole list grows with the sequence)."""
        head = self.images.keys if self.images else self.prompt_ids
        p = len(head)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return head[start:end]
        return head[start:] + self.output_ids[: end - p]

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_new(self) -> int:
        """Tokens the next forward pass must compute (1 for a running sequence)."""
        return self.num_tokens - self.num_cached
