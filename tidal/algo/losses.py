"""Per-token policy-gradient losses, KL estimators and masked reductions: pure tensor functions."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "KL_KINDS",
    "entropy_from_logits",
    "kl_estimate",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "token_mean_loss",
]

KL_KINDS = ("k1", "k2", "k3")


def _upcast(x: Tensor) -> Tensor:
    """Half-precision inputs are promoted to float32: exp/log-sum-exp in bf16 lose several digits,
    which shows up as spurious ratio != 1 between rollout and training. float64 is kept as is."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate loss, per token.

    With ratio = exp(log_probs - old_log_probs) and A the advantage:

        loss    = -min(ratio * A, clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A)
        clipped = [ratio * A > clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A]

    so `clipped` is 1.0 exactly where the clipped term is the active (smaller) one and the token
    therefore contributes no gradient. `eps_clip_high` defaults to `eps_clip`; a larger value is the
    asymmetric "clip-higher" variant that lets low-probability tokens grow more.

    Args:
        log_probs: [B, T] log-probs of the sampled tokens under the current policy (carries grad).
        old_log_probs: [B, T] log-probs under the policy that sampled them (treated as constants).
        advantages: [B] (one per sequence, broadcast over T) or [B, T] (treated as constants).

    Returns:
        (per_token_loss [B, T], clipped [B, T] as float 0/1). Padding positions are not masked
        here; reduce with `masked_mean` / `token_mean_loss`.
    """
    if log_probs.shape != old_log_probs.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and old_log_probs {tuple(old_log_probs.shape)} differ")
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    if eps_clip < 0 or eps_clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got eps_clip={eps_clip}, eps_clip_high={eps_clip_high}")

    adv = advantages.detach()
    if adv.dim() == 1 and log_probs.dim() == 2:
        adv = adv.unsqueeze(-1)  # one advantage per sequence, shared by all its tokens
    try:
        torch.broadcast_shapes(adv.shape, log_probs.shape)
    except RuntimeError as e:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} do not broadcast to log_probs {tuple(log_probs.shape)}"
        ) from e

    ratio = torch.exp(_upcast(log_probs) - _upcast(old_log_probs.detach()))
    adv = _upcast(adv)
    unclipped_obj = ratio * adv
    clipped_obj = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high) * adv
    loss = -torch.minimum(unclipped_obj, clipped_obj)
    clipped = (unclipped_obj > clipped_obj).to(loss.dtype).detach()
    return loss, clipped


def kl_estimate(log_probs: Tensor, ref_log_probs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    With d = log_probs - ref_log_probs (log p(x) - log q(x) for x sampled from p):

        k1 = d                      unbiased, can be negative, high variance
        k2 = d^2 / 2                biased, always >= 0
        k3 = exp(-d) - 1 + d        unbiased, always >= 0, low variance (q/p - 1 - log(q/p))

    Raises:
        ValueError: `kind` is not one of k1, k2, k3.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {', '.join(KL_KINDS)}")
    d = _upcast(log_probs) - _upcast(ref_log_probs)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    return torch.exp(-d) - 1.0 + d


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dimension: H = -sum_v p_v log p_v.

    log p = z - logsumexp(z) comes from log_softmax, which subtracts the max logit first; the
    seemingly equivalent H = logsumexp(z) - sum_v p_v z_v cancels catastrophically when logits are
    large (float32 logits of 1000 lose three digits). Logits of -inf (banned tokens) have p = 0 and
    contribute nothing instead of the NaN that 0 * -inf would produce, in value and gradient.
    """
    log_p = torch.log_softmax(_upcast(logits), dim=-1)
    # Zero the -inf log-probs before multiplying so neither the value nor the gradient sees 0 * inf.
    log_p_safe = torch.where(torch.isfinite(log_p), log_p, log_p.new_zeros(()))
    return -(log_p.exp() * log_p_safe).sum(dim=-1)


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of `x` where `mask` is true: sum_i [mask_i] x_i (over `dim`, or everything if None).

    Masked-out entries are replaced with 0 via torch.where rather than multiplied by the mask, so a
    NaN or inf there (padding garbage, exp overflow) cannot leak into the sum or into x's gradient.
    """
    kept = torch.where(mask.bool(), x, x.new_zeros(()))
    if dim is None:
        return kept.sum()
    return kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of `x` over the entries where `mask` is true: sum_i [mask_i] x_i / sum_i [mask_i].

    NaN/inf at masked positions never reach the result (see `masked_sum`). Where no entry is kept
    the count is clamped to 1, giving 0 instead of 0/0 = NaN.
    """
    # Broadcast first so a [B, 1] mask counts every position it covers, not once per row.
    mask_b = mask.bool().expand_as(x)
    total = masked_sum(x, mask_b, dim=dim)
    count = mask_b.sum() if dim is None else mask_b.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def token_mean_loss(per_token: Tensor, mask: Tensor, num_tokens: float | Tensor) -> Tensor:
    """Token-mean loss of one micro-batch, normalised by the token count of the whole global batch.

        loss_mb = sum_{t in mb} [mask_t] per_token_t / num_tokens

    `num_tokens` must be the number of mask-true tokens in the entire global batch (across all
    micro-batches and, in data-parallel training, all ranks), not of this micro-batch. Then

        sum_mb loss_mb = sum_{all t} [mask_t] per_token_t / num_tokens = masked_mean(full batch)

    so the summed loss and its accumulated gradients are identical however the batch is cut into
    micro-batches; dividing each micro-batch by its own count would instead over-weight tokens in
    short micro-batches. A `num_tokens` below 1 is treated as 1 so an all-masked batch gives 0,
    not NaN.
    """
    if isinstance(num_tokens, Tensor):
        denom = num_tokens.detach().to(per_token.dtype).clamp(min=1)
    else:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        denom = max(float(num_tokens), 1.0)
    return masked_sum(per_token, mask) / denom


def log_probs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probabilities of `labels` under softmax(logits / temperature).

        log p(y_t) = z_t[y_t] / tau - logsumexp_v(z_t[v] / tau)

    Args:
        logits: [B, T, V] (any leading shape); the logits at position t must already be the ones
            that predict labels[..., t] (shift before calling).
        labels: [B, T] token ids in [0, V); pad positions must still hold a valid id (mask later).
        temperature: the sampling temperature the rollout engine used, > 0.

    Returns:
        [B, T] log-probs in float32 (float64 if the logits are float64). Only the logsumexp and the
        gathered logit are kept, never a full [B, T, V] log-softmax.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}[:-1]")
    z = _upcast(logits)
    if temperature != 1.0:
        z = z / temperature
    picked = torch.gather(z, dim=-1, index=labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)
