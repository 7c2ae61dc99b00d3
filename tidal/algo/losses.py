"""Per-token policy/value losses, loss aggregation, KL estimators and masked reductions: pure tensor functions."""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.algo.options import AGGREGATE_MODES, KL_KINDS

__all__ = [
    "AGGREGATE_MODES",
    "KL_KINDS",
    "POLICY_LOSS_LEVELS",
    "aggregate",
    "cispo_loss",
    "entropy_from_logits",
    "kl_estimate",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "token_mean_loss",
    "value_loss",
]

POLICY_LOSS_LEVELS = ("token", "sequence")


def _upcast(x: Tensor) -> Tensor:
    """Half-precision inputs are promoted to float32: exp/log-sum-exp in bf16 lose several digits,
    which shows up as spurious ratio != 1 between rollout and training. float64 is kept as is."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


def _as_dtype_of(*xs: Tensor) -> torch.dtype:
    """Common float dtype of the inputs after half-precision upcasting (float32 at least)."""
    dtype = torch.float32
    for x in xs:
        dtype = torch.promote_types(dtype, _upcast(x).dtype if x.is_floating_point() else torch.float32)
    return dtype


def _ratio_inputs(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Validate the shared inputs of the ratio-based losses and clean them up.

    Returns (keep [B, T] bool, log_probs, log_ratio = log_probs - old_log_probs, advantages [B, T]),
    all in a common float dtype of at least float32, with every masked position replaced by 0
    *before* any arithmetic: then NaN/inf there cannot reach a value, and since torch.where sends a
    zero gradient to the branch it did not pick, not a gradient either. `log_probs` keeps its
    gradient at mask-true positions; old log-probs and advantages are detached.
    """
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be 2-D [B, T], got shape {tuple(log_probs.shape)}")
    if old_log_probs.shape != log_probs.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and old_log_probs {tuple(old_log_probs.shape)} differ")
    if mask.shape != log_probs.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected log_probs' shape {tuple(log_probs.shape)}")
    b = log_probs.shape[0]
    adv = advantages.detach()
    if adv.dim() == 1 and adv.shape[0] == b:
        adv = adv.unsqueeze(1)  # one advantage per sequence, shared by all its tokens
    elif adv.shape != log_probs.shape:
        raise ValueError(
            f"advantages have shape {tuple(advantages.shape)}, "
            f"expected [B] = ({b},) or [B, T] = {tuple(log_probs.shape)}"
        )
    dtype = _as_dtype_of(log_probs, old_log_probs, adv)
    keep = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=log_probs.device)
    lp = torch.where(keep, log_probs.to(dtype), zero)
    old = torch.where(keep, old_log_probs.detach().to(dtype), zero)
    adv = torch.where(keep, adv.to(dtype), zero)
    return keep, lp, lp - old, adv


def _frac(flag: Tensor, keep: Tensor, dtype: torch.dtype) -> Tensor:
    """Fraction of mask-true tokens where `flag` holds (0 when there are none)."""
    return ((flag & keep).sum() / keep.sum().clamp(min=1)).to(dtype)


def _token_mean(x: Tensor, keep: Tensor) -> Tensor:
    """Detached masked mean over mask-true tokens, for metrics."""
    return masked_mean(x.detach(), keep)


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
    level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss per token, with optional dual-clip and sequence-level (GSPO) ratios.

    With A the advantage and ratio_t as given by `level`:

        loss_t = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_clip, 1 + eps_clip_high) * A_t)
        loss_t = min(loss_t, -dual_clip * A_t)          additionally where A_t < 0, if dual_clip is set

    level="token" (PPO):   ratio_t = exp(log_probs_t - old_log_probs_t)
    level="sequence" (GSPO-token):
        s_i     = exp( sum_{t in mask_i} (log_probs_t - old_log_probs_t) / |mask_i| )
        ratio_t = sg(s_i) * exp(log_probs_t - sg(log_probs_t))
    so every token of row i has the value s_i (the clip decision is made per sequence, on the
    length-normalised sequence ratio) and the gradient s_i * grad log_probs_t. With [B] advantages
    and ``aggregate(..., mode="seq_mean_token_mean")`` this is exactly GSPO's sequence objective.

    `eps_clip_high` defaults to `eps_clip`; a larger value is the asymmetric "clip-higher" variant.
    Dual-clip (Ye et al. 2020) bounds the loss of negative-advantage tokens whose ratio has blown up:
    without it -ratio * A grows without limit as ratio -> inf.

    Args:
        log_probs: [B, T] log-probs of the sampled tokens under the current policy (carries grad).
        old_log_probs: [B, T] log-probs under the policy that sampled them (treated as constants).
        advantages: [B] (one per sequence, broadcast over T) or [B, T] (treated as constants).
        mask: [B, T] 0/1 or bool; False positions get loss exactly 0 and no gradient, and whatever
            they hold in any input (NaN included) affects nothing, sequence ratios included.

    Returns:
        (per_token_loss [B, T], metrics). The loss is float32 for half-precision inputs (float64 if
        any input is float64); reduce it with `aggregate`. The metrics are detached scalars, each a
        mean over the mask-true tokens of this call (0 if there are none):
          clip_frac       tokens where the clipped term is the active one (they get no gradient)
          dual_clip_frac  tokens where the dual-clip cap is active (no gradient either)
          approx_kl       mean of 0.5 * (log_probs - old_log_probs)^2 (per token, at any level)
          ratio_mean      mean of ratio_t as used in the loss

    Raises:
        ValueError: on shape mismatches, negative clip ranges, dual_clip <= 1 or an unknown level.
    """
    if level not in POLICY_LOSS_LEVELS:
        raise ValueError(f"unknown policy loss level {level!r}; expected one of {', '.join(POLICY_LOSS_LEVELS)}")
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    if eps_clip < 0 or eps_clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got eps_clip={eps_clip}, eps_clip_high={eps_clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (a cap of -dual_clip * A on negative advantages), got {dual_clip}")
    keep, lp, log_ratio, adv = _ratio_inputs(log_probs, old_log_probs, advantages, mask)

    if level == "token":
        ratio = torch.exp(log_ratio)
    else:
        n = keep.sum(dim=1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
        seq_ratio = torch.exp(log_ratio.detach().sum(dim=1, keepdim=True) / n)
        # exp(x - sg(x)) is exactly 1 in value and has derivative 1: it only attaches the gradient.
        ratio = seq_ratio * torch.exp(lp - lp.detach())

    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    is_clipped = unclipped > clipped
    if dual_clip is not None:
        cap = -dual_clip * adv
        is_dual = (adv < 0) & (loss > cap)
        loss = torch.where(is_dual, cap, loss)
    else:
        is_dual = torch.zeros_like(keep)
    loss = torch.where(keep, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))

    metrics = {
        "clip_frac": _frac(is_clipped, keep, loss.dtype),
        "dual_clip_frac": _frac(is_dual, keep, loss.dtype),
        "approx_kl": _token_mean(0.5 * log_ratio.square(), keep),
        "ratio_mean": _token_mean(ratio, keep),
    }
    return loss, metrics


def cispo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_clip_low: float | None = None,
    eps_clip_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO loss (MiniMax-M1): REINFORCE with a clipped, stop-gradient importance weight.

        w_t    = sg(clip(exp(log_probs_t - old_log_probs_t), 1 - eps_clip_low, 1 + eps_clip_high))
        loss_t = -w_t * A_t * log_probs_t

    There is no lower bound when `eps_clip_low` is None. Unlike PPO, clipping only caps the
    weight: every mask-true token keeps the gradient -w_t * A_t * grad log_probs_t, so rare tokens
    with large ratios (often the "reflective" tokens in long reasoning) still learn. The loss value
    itself is not a surrogate of the return; only its gradient is meaningful.

    Args and masking are as in `policy_loss`.

    Returns:
        (per_token_loss [B, T], metrics) with detached scalar metrics over mask-true tokens:
          clip_frac   tokens whose weight was clipped
          approx_kl   mean of 0.5 * (log_probs - old_log_probs)^2
          ratio_mean  mean of the unclipped ratio

    Raises:
        ValueError: on shape mismatches or negative clip ranges.
    """
    if eps_clip_high < 0 or (eps_clip_low is not None and eps_clip_low < 0):
        raise ValueError(f"clip ranges must be >= 0, got eps_clip_low={eps_clip_low}, eps_clip_high={eps_clip_high}")
    keep, lp, log_ratio, adv = _ratio_inputs(log_probs, old_log_probs, advantages, mask)
    ratio = torch.exp(log_ratio.detach())
    low = None if eps_clip_low is None else 1.0 - eps_clip_low
    weight = torch.clamp(ratio, min=low, max=1.0 + eps_clip_high)
    is_clipped = ratio > 1.0 + eps_clip_high
    if low is not None:
        is_clipped = is_clipped | (ratio < low)
    loss = -weight * adv * lp  # lp is already 0 at masked positions, and so is adv
    loss = torch.where(keep, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    metrics = {
        "clip_frac": _frac(is_clipped, keep, loss.dtype),
        "approx_kl": _token_mean(0.5 * log_ratio.square(), keep),
        "ratio_mean": _token_mean(ratio, keep),
    }
    return loss, metrics


def _denominator(value: float | Tensor | None, default: Tensor, name: str) -> Tensor:
    """A normaliser for `aggregate`: the caller's (global) count or this batch's, never below 1."""
    if value is None:
        return default.clamp(min=1)
    if isinstance(value, Tensor):
        return value.detach().to(default.dtype).clamp(min=1)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return default.new_tensor(max(float(value), 1.0))


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str = "token_mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar. With n_i = mask-true count of row i:

        token_mean               sum_{i,t in mask} x_it / num_tokens
        seq_mean_token_mean      sum_i (sum_{t in mask_i} x_it / n_i) / num_seqs       (rows with n_i = 0 add 0)
        seq_mean_token_sum       sum_i  sum_{t in mask_i} x_it        / num_seqs
        seq_mean_token_sum_norm  sum_{i,t in mask} x_it / (num_seqs * max_len)       (Dr. GRPO)

    Defaults, from this batch: num_tokens = number of mask-true entries; num_seqs = number of rows
    with at least one mask-true entry (but B for seq_mean_token_sum_norm, whose normaliser is a
    constant that ignores content); max_len = T. Every denominator is clamped to >= 1, so an
    all-masked batch gives 0, not NaN.

    For gradient accumulation pass the counts of the whole global batch (all micro-batches and
    ranks; a Tensor is accepted so an all-reduced count can be passed as is). Each mode is a sum
    over rows divided by a constant, so summing aggregate() over micro-batches then equals
    aggregate() of the whole batch, in value and gradient.

    NaN/inf at masked positions never reach the result or the gradient.

    Raises:
        ValueError: unknown mode, shape mismatch, negative counts or max_len < 1.
    """
    if mode not in AGGREGATE_MODES:
        raise ValueError(f"unknown aggregate mode {mode!r}; expected one of {', '.join(AGGREGATE_MODES)}")
    if per_token.dim() != 2:
        raise ValueError(f"per_token must be 2-D [B, T], got shape {tuple(per_token.shape)}")
    if mask.shape != per_token.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected per_token's shape {tuple(per_token.shape)}")
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    keep = mask.bool()
    x = per_token if per_token.is_floating_point() else per_token.float()
    count_dtype = x.dtype if x.dtype == torch.float64 else torch.float32

    if mode == "token_mean":
        denom = _denominator(num_tokens, keep.sum().to(count_dtype), "num_tokens")
        return masked_sum(x, keep) / denom
    if mode == "seq_mean_token_sum_norm":
        seqs = _denominator(num_seqs, torch.tensor(float(x.shape[0]), dtype=count_dtype, device=x.device), "num_seqs")
        length = float(x.shape[1] if max_len is None else max_len)
        return masked_sum(x, keep) / (seqs * length).clamp(min=1)
    rows = keep.any(dim=1).sum().to(count_dtype)
    seqs = _denominator(num_seqs, rows, "num_seqs")
    if mode == "seq_mean_token_mean":
        per_row = masked_mean(x, keep, dim=1)
    else:
        per_row = masked_sum(x, keep, dim=1)
    return per_row.sum() / seqs


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic regression loss per token, with optional PPO-style value clipping.

        loss_t = 0.5 * (V_t - R_t)^2                                            clip=None
        loss_t = 0.5 * max((V_t - R_t)^2, (V_old_t + clamp(V_t - V_old_t, -clip, clip) - R_t)^2)

    The clipped form stops the value head from moving more than `clip` away from the rollout-time
    values when that would reduce the loss (the pessimistic max). `old_values` and `returns` are
    constants; 0 and no gradient at masked positions, whose contents (NaN included) never matter.

    Returns:
        (per_token_loss [B, T], metrics) with detached scalars over the mask-true tokens:
          clip_frac      tokens where the clipped term is the larger one (0 without clip)
          value_mean     mean of V
          explained_var  1 - Var(R - V) / Var(R) (population variances; 0 when Var(R) = 0)

    Raises:
        ValueError: shape mismatch or clip < 0.
    """
    if values.dim() != 2:
        raise ValueError(f"values must be 2-D [B, T], got shape {tuple(values.shape)}")
    for name, x in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if x.shape != values.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected values' shape {tuple(values.shape)}")
    if clip is not None and clip < 0:
        raise ValueError(f"clip must be >= 0, got {clip}")
    dtype = _as_dtype_of(values, old_values, returns)
    keep = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=values.device)
    v = torch.where(keep, values.to(dtype), zero)
    old = torch.where(keep, old_values.detach().to(dtype), zero)
    ret = torch.where(keep, returns.detach().to(dtype), zero)

    unclipped = (v - ret).square()
    if clip is None:
        per_token = 0.5 * unclipped
        is_clipped = torch.zeros_like(keep)
    else:
        v_clipped = old + torch.clamp(v - old, -clip, clip)
        clipped = (v_clipped - ret).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        is_clipped = clipped > unclipped
    per_token = torch.where(keep, per_token, zero)

    with torch.no_grad():
        var_ret = _token_mean((ret - _token_mean(ret, keep)).square(), keep)
        err = ret - v
        var_err = _token_mean((err - _token_mean(err, keep)).square(), keep)
        explained = torch.where(var_ret > 0, 1.0 - var_err / torch.where(var_ret > 0, var_ret, 1.0), zero)
    metrics = {
        "clip_frac": _frac(is_clipped, keep, dtype),
        "value_mean": _token_mean(v, keep),
        "explained_var": explained,
    }
    return per_token, metrics


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


def _entropy_of_log_softmax(log_p: Tensor) -> Tensor:
    # -inf log-probs (banned tokens, p = 0) are clamped to the most negative finite value, so
    # p * log p is 0 * finite = 0 in value and gradient instead of 0 * inf = NaN. One clamp pass is
    # half the cost of an isfinite mask and a where over a 49k vocabulary.
    return -(log_p.exp() * log_p.clamp(min=torch.finfo(log_p.dtype).min)).sum(dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dimension: H = -sum_v p_v log p_v.

    log p = z - logsumexp(z) comes from log_softmax, which subtracts the max logit first; the
    seemingly equivalent H = logsumexp(z) - sum_v p_v z_v cancels catastrophically when logits are
    large (float32 logits of 1000 lose three digits). Logits of -inf (banned tokens) have p = 0 and
    contribute nothing instead of the NaN that 0 * -inf would produce, in value and gradient.
    """
    return _entropy_of_log_softmax(torch.log_softmax(_upcast(logits), dim=-1))


def log_probs_and_entropy(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, entropy_grad: bool = True
) -> tuple[Tensor, Tensor]:
    """`log_probs_from_logits` and `entropy_from_logits` of softmax(logits / temperature) from one
    log-softmax pass over the vocabulary. With `entropy_grad=False` the entropy is a detached
    metric (no graph kept for it); the log-probs always carry the gradient."""
    log_p = _log_softmax(logits, labels, temperature)
    picked = torch.gather(log_p, dim=-1, index=labels.long().unsqueeze(-1)).squeeze(-1)
    if entropy_grad:
        return picked, _entropy_of_log_softmax(log_p)
    with torch.no_grad():
        return picked, _entropy_of_log_softmax(log_p.detach())


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
        [B, T] log-probs in float32 (float64 if the logits are float64).
    """
    log_p = _log_softmax(logits, labels, temperature)
    return torch.gather(log_p, dim=-1, index=labels.long().unsqueeze(-1)).squeeze(-1)


def _log_softmax(logits: Tensor, labels: Tensor, temperature: float) -> Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}[:-1]")
    z = _upcast(logits)
    if temperature != 1.0:
        z = z / temperature
    # log_softmax is one fused pass (max, exp-sum, subtract); gather - logsumexp costs twice that
    # forward and backward on CPU over a 49k vocabulary
    return torch.log_softmax(z, dim=-1)
