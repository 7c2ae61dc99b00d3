"""Advantage estimators: pure functions from rewards to per-sample advantages."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["grpo_advantages"]


def grpo_advantages(
    rewards: Tensor,
    group_size: int,
    std_normalize: bool = True,
    eps: float = 1e-6,
    valid: Tensor | None = None,
) -> Tensor:
    """Group-relative advantages (GRPO), one scalar per sample.

    `rewards` has shape [N] laid out group after group: samples ``g*group_size ... (g+1)*group_size-1``
    answer the same prompt. For a sample i in group g with valid members V_g:

        A_i = r_i - mean_g                          (std_normalize=False, "Dr. GRPO")
        A_i = (r_i - mean_g) / (std_g + eps)        (std_normalize=True)

    where mean_g = sum_{j in V_g} r_j / |V_g| and std_g is the unbiased standard deviation
    sqrt(sum_{j in V_g} (r_j - mean_g)^2 / (|V_g| - 1)).

    Entries with ``valid=False`` (e.g. failed generations) are left out of their group's mean and
    std and get advantage exactly 0; their reward may be anything, NaN included. A group with fewer
    than two valid members has std taken as 0, and since its lone member equals the mean its
    advantage is exactly 0 (no NaN from the 0/0 of an unbiased std over one value).

    Raises:
        ValueError: `rewards` is not 1-D, `group_size` < 1, N is not a multiple of `group_size`,
            or `valid` does not have the shape of `rewards`.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(f"{n} rewards cannot be split into groups of {group_size} (not divisible)")
    if valid is not None and tuple(valid.shape) != tuple(rewards.shape):
        raise ValueError(f"valid has shape {tuple(valid.shape)}, expected {tuple(rewards.shape)}")

    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    # float64 internally: with float32, three rewards of 0.1 give a mean that differs from 0.1 by
    # ~1e-9 and a "std" of the same size, which eps=1e-6 only partly hides. Groups are tiny.
    r = rewards.detach().to(torch.float64).view(-1, group_size)
    if valid is None:
        mask = torch.ones_like(r, dtype=torch.bool)
    else:
        mask = valid.to(device=r.device, dtype=torch.bool).view(-1, group_size)
    zero = r.new_zeros(())

    # torch.where, not r * mask: an invalid entry may hold NaN and NaN * 0 is still NaN.
    count = mask.sum(dim=1, keepdim=True).to(r.dtype)
    mean = torch.where(mask, r, zero).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = torch.where(mask, r - mean, zero)
    if not std_normalize:
        return centered.view(-1).to(out_dtype)

    # Unbiased variance; clamping the denominator makes a 0- or 1-member group's std 0 instead of
    # NaN, and its centered values are already 0, so the result is exactly 0 there.
    var = centered.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
    std = torch.where(count >= 2, var.sqrt(), zero)
    denom = std + eps
    # Only reachable with eps=0 on a zero-spread group, where every centered value is 0 anyway:
    # report 0 rather than 0/0 = NaN.
    adv = torch.where(denom > 0, centered / torch.where(denom > 0, denom, 1.0), zero)
    return adv.view(-1).to(out_dtype)
