"""Importance-weight corrections for the mismatch between the rollout engine and the trainer.

The inference engine (vLLM, SGLang, ...) and the training forward pass compute slightly different
log-probs for the same tokens (different kernels, precision, batching), so the rollout policy is
not exactly the policy being trained. These weights re-weight (TIS) or reject (ICEPOP-style
masking) tokens or sequences where the two disagree. They are constants that multiply the
per-token loss; they are not a trust region on the policy update (that is `policy_loss`'s clip).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.algo.losses import _upcast, masked_mean
from tidal.algo.options import IS_LEVELS, IS_MODES

__all__ = ["IS_LEVELS", "IS_MODES", "importance_weights"]


def importance_weights(
    train_log_probs: Tensor,
    rollout_log_probs: Tensor,
    mask: Tensor,
    level: str = "token",
    mode: str = "truncate",
    low: float | None = None,
    high: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Train/rollout importance weights, truncated or used as a rejection mask.

    With Delta_t = train_log_probs_t - rollout_log_probs_t (both detached) and n_i the mask-true
    count of row i, the ratio is

        level="token"      rho_t = exp(Delta_t)
        level="sequence"   rho_t = exp(sum_{s in mask_i} Delta_s)              same for every token of row i
        level="geometric"  rho_t = exp(sum_{s in mask_i} Delta_s / n_i)        (geometric mean of token ratios)

    and the weight is

        mode="truncate" (TIS)            w_t = min(rho_t, high), and max(., low) if `low` is given
        mode="mask" (ICEPOP, rejection)  w_t = rho_t if low <= rho_t <= high else 0

    `low` defaults to no lower bound in both modes (for "mask" that is the same as low = 0, since
    ratios are positive). At the sequence and geometric levels a rejected row is wholly 0. A
    sequence ratio that overflows to inf is truncated to `high` or rejected, never propagated.

    Returns:
        (weights [B, T], metrics). Weights are detached, float32 (float64 for float64 inputs) and 0
        at masked positions; values there (NaN included) affect nothing. Metrics are detached
        scalars over the mask-true tokens (token-weighted also at the sequence levels):
          mismatch_abs_diff  mean |Delta_t|
          clipped_frac       (truncate) tokens whose weight differs from the ratio
          masked_frac        (mask) tokens rejected
          weight_mean        mean weight

    Raises:
        ValueError: unknown level or mode, shape mismatch, high <= 0, low < 0 or low > high.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-weight level {level!r}; expected one of {', '.join(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-weight mode {mode!r}; expected one of {', '.join(IS_MODES)}")
    if not high > 0:
        raise ValueError(f"high must be > 0, got {high}")
    if low is not None and not 0 <= low <= high:
        raise ValueError(f"low must be in [0, high={high}], got {low}")
    if train_log_probs.dim() != 2:
        raise ValueError(f"train_log_probs must be 2-D [B, T], got shape {tuple(train_log_probs.shape)}")
    for name, x in (("rollout_log_probs", rollout_log_probs), ("mask", mask)):
        if x.shape != train_log_probs.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}, expected train_log_probs' shape {tuple(train_log_probs.shape)}"
            )

    train = _upcast(train_log_probs.detach())
    rollout = _upcast(rollout_log_probs.detach())
    dtype = torch.promote_types(torch.promote_types(train.dtype, rollout.dtype), torch.float32)
    keep = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=train.device)
    # Masked entries become 0 before any row sum: inf - inf = NaN there would otherwise poison it.
    delta = torch.where(keep, train.to(dtype) - rollout.to(dtype), zero)

    if level == "token":
        log_ratio = delta
    else:
        total = delta.sum(dim=1, keepdim=True)
        if level == "geometric":
            total = total / keep.sum(dim=1, keepdim=True).clamp(min=1).to(dtype)
        log_ratio = total.expand_as(delta)
    ratio = torch.exp(log_ratio)  # may be inf at the sequence level; both modes below handle it

    if mode == "truncate":
        weight = torch.clamp(ratio, min=low, max=high)
        flagged = ratio > high
        if low is not None:
            flagged = flagged | (ratio < low)
        frac_name = "clipped_frac"
    else:
        accepted = ratio <= high
        if low is not None:
            accepted = accepted & (ratio >= low)
        weight = torch.where(accepted, ratio, zero)
        flagged = ~accepted
        frac_name = "masked_frac"
    weight = torch.where(keep, weight, zero)

    n = keep.sum().clamp(min=1)
    metrics = {
        "mismatch_abs_diff": masked_mean(delta.abs(), keep),
        frac_name: ((flagged & keep).sum() / n).to(dtype),
        "weight_mean": masked_mean(weight, keep),
    }
    return weight, metrics
