"""Turn samples into padded tensors and split them into micro-batches."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tidal.types import Sample


def collate(samples: Sequence[Sample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad samples into a batch.

    Returns `input_ids`/`attention_mask` [B, L] over prompt + response, `prompt_lengths` [B],
    `response_ids`, `loss_mask`, `rollout_log_probs` [B, R] over response tokens only (R the
    longest response). Masks come from lengths, never from the pad id (pad may equal eos).
    """
    b = len(samples)
    width = max(len(s.tokens) for s in samples)
    resp = max(max(s.response_length for s in samples), 1)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    resp_ids = torch.full((b, resp), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, resp), dtype=torch.float32)
    rollout_lp = torch.zeros((b, resp), dtype=torch.float32)
    prompt_len = torch.zeros(b, dtype=torch.long)
    for i, s in enumerate(samples):
        n, r = len(s.tokens), s.response_length
        ids[i, :n] = torch.tensor(s.tokens)
        attn[i, :n] = 1
        prompt_len[i] = n - r
        if r:
            resp_ids[i, :r] = torch.tensor(s.tokens[n - r :])
            loss_mask[i, :r] = torch.tensor(s.loss_mask, dtype=torch.float32)
            rollout_lp[i, :r] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "prompt_lengths": prompt_len,
        "response_ids": resp_ids,
        "loss_mask": loss_mask,
        "rollout_log_probs": rollout_lp,
    }


def micro_batches(n: int, size: int) -> list[slice]:
    """Consecutive slices of at most `size` items covering range(n)."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
