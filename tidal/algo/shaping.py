"""Reward shaping and batch filtering helpers: per-sample penalties and group-level selection."""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.algo.advantages import Groups, check_grouped, group_ids

__all__ = ["groups_with_signal", "overlong_penalty"]


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment, one penalty per sample (added to the reward).

    With the soft limit c = max_len - buffer and L the response length:

        p(L) = 0                              L <= c
        p(L) = -(L - c) / buffer * factor     c < L <= max_len     (linear ramp from 0 to -factor)
        p(L) = -factor                        L > max_len

    so a response is penalised progressively as it enters the last `buffer` tokens before the
    hard limit, instead of a truncated answer getting the same reward signal as a finished one.

    Returns:
        [N] in float32 (float64 if `lengths` is float64).

    Raises:
        ValueError: `lengths` is not 1-D or not 0 < buffer <= max_len.
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D [N], got shape {tuple(lengths.shape)}")
    if not 0 < buffer <= max_len:
        raise ValueError(f"buffer must satisfy 0 < buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    dtype = torch.float64 if lengths.dtype == torch.float64 else torch.float32
    length = lengths.detach().to(dtype)
    soft = max_len - buffer
    ramp = -(length - soft) / buffer * factor
    full = torch.full_like(length, -factor)
    return torch.where(length <= soft, torch.zeros_like(length), torch.where(length <= max_len, ramp, full))


def groups_with_signal(rewards: Tensor, group_size: Groups, valid: Tensor | None = None) -> Tensor:
    """Which groups carry a learning signal: their valid rewards are not all equal (DAPO dynamic sampling).

        keep_g = |V_g| >= 2  and  max_{j in V_g} r_j != min_{j in V_g} r_j

    with V_g the valid members of group g: samples g*group_size ... (g+1)*group_size-1 for an int
    `group_size`, or, for a list of group sizes (ragged groups), the next `group_size[g]` samples.
    A group whose rewards are all equal has all-zero group-relative advantages and contributes no
    gradient, so DAPO drops it and samples more prompts. Invalid rewards (NaN included) are
    ignored; a group with fewer than two valid members (a 1-sample group included) is False.

    Returns:
        [G] bool, one per group.

    Raises:
        ValueError: `rewards` is not 1-D, the group sizes do not split N (see `check_grouped`),
            or `valid` does not have the shape of `rewards`.
    """
    check_grouped(rewards, group_size, valid)
    r = rewards.detach().to(torch.float64)
    ids, n_groups = group_ids(group_size, r.shape[0], r.device)
    keep = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.to(r.device, torch.bool)
    # Invalid members are pushed to +-inf so they never decide the min or the max.
    hi = r.new_full((n_groups,), -torch.inf).scatter_reduce_(0, ids, torch.where(keep, r, -torch.inf), "amax")
    lo = r.new_full((n_groups,), torch.inf).scatter_reduce_(0, ids, torch.where(keep, r, torch.inf), "amin")
    count = torch.zeros(n_groups, dtype=torch.long, device=r.device).index_add_(0, ids, keep.long())
    return (count >= 2) & (hi != lo)
