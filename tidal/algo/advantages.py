"""Advantage estimators: pure functions from rewards (and values) to per-sample or per-token advantages."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

# How the samples of a batch fall into groups (one group per prompt, laid out group after group):
# an int for groups that all have that many samples, or each group's size in order (ragged groups).
Groups = int | Sequence[int]

__all__ = [
    "Groups",
    "discounted_returns",
    "distillation_advantages",
    "gae",
    "group_ids",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "token_level_rewards",
    "whiten",
]


def grpo_advantages(
    rewards: Tensor,
    group_size: Groups,
    std_normalize: bool = True,
    eps: float = 1e-6,
    valid: Tensor | None = None,
) -> Tensor:
    """Group-relative advantages (GRPO), one scalar per sample.

    `rewards` has shape [N] laid out group after group; `group_size` is either an int (samples
    ``g*group_size ... (g+1)*group_size-1`` answer the same prompt) or the list of each group's
    size in order, which may differ from group to group (ragged groups, e.g. a generate function
    that fans a prompt out into a varying number of samples). For a sample i in group g with valid
    members V_g:

        A_i = r_i - mean_g                          (std_normalize=False, "Dr. GRPO")
        A_i = (r_i - mean_g) / (std_g + eps)        (std_normalize=True)

    where mean_g = sum_{j in V_g} r_j / |V_g| and std_g is the unbiased standard deviation
    sqrt(sum_{j in V_g} (r_j - mean_g)^2 / (|V_g| - 1)). Each group uses only its own members, so
    with ragged groups a prompt's advantages do not depend on how many samples other prompts got.

    Entries with ``valid=False`` (e.g. failed generations) are left out of their group's mean and
    std and get advantage exactly 0; their reward may be anything, NaN included. A group with fewer
    than two valid members (a 1-sample group included) has std taken as 0, and since its lone
    member equals the mean its advantage is exactly 0 (no NaN from the 0/0 of an unbiased std over
    one value).

    Raises:
        ValueError: `rewards` is not 1-D, a group size is < 1, the sizes do not cover N (an int
            that does not divide N, a list that does not sum to N), or `valid` does not have the
            shape of `rewards`.
    """
    check_grouped(rewards, group_size, valid)

    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    # float64 internally: with float32, three rewards of 0.1 give a mean that differs from 0.1 by
    # ~1e-9 and a "std" of the same size, which eps=1e-6 only partly hides. Groups are tiny.
    r = rewards.detach().to(torch.float64)
    ids, n_groups = group_ids(group_size, r.shape[0], r.device)
    mask = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.to(device=r.device, dtype=torch.bool)
    zero = r.new_zeros(())

    # torch.where, not r * mask: an invalid entry may hold NaN and NaN * 0 is still NaN.
    count = _segment_sum(mask.to(r.dtype), ids, n_groups)[ids]
    mean = _segment_sum(torch.where(mask, r, zero), ids, n_groups)[ids] / count.clamp(min=1)
    centered = torch.where(mask, r - mean, zero)
    if not std_normalize:
        return centered.to(out_dtype)

    # Unbiased variance; clamping the denominator makes a 0- or 1-member group's std 0 instead of
    # NaN, and its centered values are already 0, so the result is exactly 0 there.
    var = _segment_sum(centered.square(), ids, n_groups)[ids] / (count - 1).clamp(min=1)
    std = torch.where(count >= 2, var.sqrt(), zero)
    denom = std + eps
    # Only reachable with eps=0 on a zero-spread group, where every centered value is 0 anyway:
    # report 0 rather than 0/0 = NaN.
    adv = torch.where(denom > 0, centered / torch.where(denom > 0, denom, 1.0), zero)
    return adv.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# Helpers shared by the token-level estimators below


def _float_dtype(*xs: Tensor | None) -> torch.dtype:
    """Working dtype for token-level math: float64 stays float64, everything else (half, bf16,
    float32, integer rewards) is computed in float32. Returns, discounted sums and the GAE recursion
    accumulate over thousands of tokens, where bf16's 8-bit mantissa would lose the signal."""
    for x in xs:
        if x is not None and x.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _check_mask(mask: Tensor, name: str = "mask") -> None:
    if mask.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, T], got shape {tuple(mask.shape)}")


def _check_like(x: Tensor | None, mask: Tensor, name: str) -> None:
    if x is not None and tuple(x.shape) != tuple(mask.shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected the mask's shape {tuple(mask.shape)}")


def _check_per_sample(x: Tensor, mask: Tensor, name: str) -> None:
    if x.dim() != 1 or x.shape[0] != mask.shape[0]:
        raise ValueError(f"{name} must be 1-D with one entry per mask row ({mask.shape[0]}), got {tuple(x.shape)}")


def _check_unit_interval(value: float, name: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def check_grouped(rewards: Tensor, group_size: Groups, valid: Tensor | None = None) -> None:
    """Raise ValueError unless `rewards` is [N], `group_size` splits N into groups (an int that
    divides N, or sizes >= 1 that sum to N) and `valid`, if given, has its shape."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    _check_groups(rewards.shape[0], group_size)
    if valid is not None and tuple(valid.shape) != tuple(rewards.shape):
        raise ValueError(f"valid has shape {tuple(valid.shape)}, expected {tuple(rewards.shape)}")


def _check_groups(n: int, group_size: Groups) -> None:
    if isinstance(group_size, int):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if n % group_size != 0:
            raise ValueError(f"{n} rewards cannot be split into groups of {group_size} (not divisible)")
        return
    sizes = [int(k) for k in group_size]
    if any(k < 1 for k in sizes):
        raise ValueError(f"group_size: every group size must be >= 1, got {sizes}")
    if sum(sizes) != n:
        raise ValueError(f"group_size: group sizes {sizes} sum to {sum(sizes)}, not to the {n} rewards")


def group_ids(group_size: Groups, n: int, device: torch.device | str | None = None) -> tuple[Tensor, int]:
    """(ids, G): the group of each of the N samples as an int64 [N] tensor (0, 0, 1, 1, 1, ...) and
    the number of groups G, for groups laid out one after the other with the sizes `group_size`
    gives (an int: all groups that size). The index the segment sums below scatter into.

    Raises:
        ValueError: the sizes do not split N (see `check_grouped`).
    """
    _check_groups(n, group_size)
    if isinstance(group_size, int):
        g = n // group_size
        return torch.arange(g, device=device).repeat_interleave(group_size), g
    sizes = torch.tensor([int(k) for k in group_size], dtype=torch.long, device=device)
    return torch.arange(len(sizes), device=device).repeat_interleave(sizes), len(sizes)


def _segment_sum(x: Tensor, ids: Tensor, n_groups: int) -> Tensor:
    """[G] per-group sums of the [N] values `x` (index_add: one kernel, no loop over groups)."""
    return x.new_zeros(n_groups).index_add_(0, ids, x)


# ---------------------------------------------------------------------------------------------
# Per-sample estimators


def rloo_advantages(rewards: Tensor, group_size: Groups, valid: Tensor | None = None) -> Tensor:
    """Leave-one-out (RLOO) advantages, one scalar per sample.

    `rewards` [N] is laid out group after group like in `grpo_advantages` (`group_size` an int, or
    each group's size: ragged groups). For a valid sample i in group g with valid members V_g
    (|V_g| = n >= 2):

        A_i = r_i - sum_{j in V_g, j != i} r_j / (n - 1)
            = n / (n - 1) * (r_i - mean_g)

    i.e. the baseline for each sample is the mean of the *other* valid samples of its prompt, which
    does not depend on r_i and so keeps the estimator unbiased. With ragged groups n is each
    group's own count of valid members. A group with fewer than two valid members (a 1-sample
    group included) has no "others" and gives 0. Entries with ``valid=False`` get exactly 0 and
    their reward (NaN included) is ignored. The result is detached, in the reward dtype (float32
    for integers).

    Raises:
        ValueError: `rewards` is not 1-D, the group sizes do not split N (see `check_grouped`),
            or `valid` does not have the shape of `rewards`.
    """
    check_grouped(rewards, group_size, valid)

    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    # float64 for the same reason as grpo_advantages: equal rewards must cancel to exactly 0-ish.
    r = rewards.detach().to(torch.float64)
    ids, n_groups = group_ids(group_size, r.shape[0], r.device)
    keep = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.to(r.device, torch.bool)
    zero = r.new_zeros(())
    r = torch.where(keep, r, zero)  # NaN rewards of invalid entries are replaced before any sum
    count = _segment_sum(keep.to(r.dtype), ids, n_groups)[ids]
    others_mean = (_segment_sum(r, ids, n_groups)[ids] - r) / (count - 1).clamp(min=1)
    adv = torch.where(keep & (count >= 2), r - others_mean, zero)
    return adv.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# Token-level building blocks (REINFORCE++, PPO)


def token_level_rewards(rewards: Tensor, mask: Tensor, token_kl: Tensor | None = None) -> Tensor:
    """Spread sequence rewards over tokens: the reward at the last response token, a KL penalty on all.

        out[i, t] = [t == last_i] * r_i - token_kl[i, t]     where mask[i, t] is true
        out[i, t] = 0                                        where mask[i, t] is false

    with last_i the last position of row i whose mask is true (holes in the mask, e.g. tool output,
    are allowed; the reward goes to the last *trainable* token). `token_kl` is the already-scaled
    penalty (kl_coef * kl_t). A row without any mask-true position is all 0 and its reward, even NaN,
    is ignored; values of `token_kl` at masked positions are never read either.

    Gradients flow to `rewards` and `token_kl` (nothing is detached; the advantage estimators built
    on this detach their output).

    Args:
        rewards: [B] one scalar per sequence.
        mask: [B, T] 0/1 or bool.
        token_kl: optional [B, T] per-token penalty.

    Returns:
        [B, T] in float32 (float64 if any input is float64).
    """
    _check_mask(mask)
    _check_per_sample(rewards, mask, "rewards")
    _check_like(token_kl, mask, "token_kl")
    dtype = _float_dtype(rewards, token_kl)
    keep = mask.bool()
    t = mask.shape[1]
    pos = torch.arange(t, device=mask.device).expand_as(keep)
    # Index of the last kept position per row; -1 (matches no column) for an empty row.
    if t > 0:
        last = torch.where(keep, pos, -1).amax(dim=1, keepdim=True)
    else:
        last = pos.new_full((mask.shape[0], 1), -1)
    at_last = pos == last
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    out = torch.where(at_last, rewards.to(dtype).unsqueeze(1), zero)
    if token_kl is not None:
        out = out - torch.where(keep, token_kl.to(dtype), zero)
    return out


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Discounted reward-to-go over the mask-true positions of each row.

        G_t = r_t + gamma * G_{t'}      t mask-true, t' the next mask-true position after t
        G_t = r_t                       t the last mask-true position
        G_t = 0                         t masked

    Masked positions are skipped entirely (they neither add reward nor count as a discount step),
    so tool output inside a response does not shorten the horizon. Values at masked positions, NaN
    included, never affect the result or its gradient. Differentiable with respect to
    `token_rewards`.

    Returns:
        [B, T] in float32 (float64 for float64 input).

    Raises:
        ValueError: shapes differ, the mask is not 2-D, or gamma is outside [0, 1].
    """
    _check_mask(mask)
    _check_like(token_rewards, mask, "token_rewards")
    _check_unit_interval(gamma, "gamma")
    dtype = _float_dtype(token_rewards)
    keep = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    r = torch.where(keep, token_rewards.to(dtype), zero)
    if gamma == 1.0:
        # Undiscounted: a reverse cumulative sum of the kept rewards, no per-token Python loop.
        return torch.where(keep, r.flip(1).cumsum(1).flip(1), zero)
    # Serial scan from the end; exponentiating gamma^(rank) instead would under/overflow on long rows.
    out = []
    running = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(keep[:, t], r[:, t] + gamma * running, running)
        out.append(torch.where(keep[:, t], running, zero))
    if not out:
        return r
    return torch.stack(out[::-1], dim=1)


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True) -> Tensor:
    """Normalise the mask-true entries of a whole batch to zero mean and unit standard deviation.

        mean = sum_{mask} x / n,   std = sqrt(sum_{mask} (x - mean)^2 / (n - 1))      (unbiased)
        out  = (x - mean) / (std + eps)                   shift_mean=True
        out  = (x - mean) / (std + eps) + mean            shift_mean=False (rescale, keep the mean)

    with n the number of mask-true entries; 0 at masked positions. With n < 2 the std is taken as
    0 (no 0/0): a single entry equals the mean and becomes 0 (or stays at the mean when
    shift_mean=False), and an all-masked input is all 0. With eps = 0 and zero spread the centred
    values are reported as 0 rather than 0/0. Statistics are computed in float64; the output has
    x's dtype (float32 for integer or half input). Differentiable with respect to x (the mean and
    std are not detached), and NaN/inf at masked positions reach neither the value nor the gradient.

    Raises:
        ValueError: shapes differ, the mask is not 2-D, or eps < 0.
    """
    _check_mask(mask)
    _check_like(x, mask, "x")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    out_dtype = _float_dtype(x)
    keep = mask.bool()
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    v = torch.where(keep, x.to(torch.float64), zero)
    n = keep.sum().to(torch.float64)
    mean = v.sum() / n.clamp(min=1)
    centered = torch.where(keep, v - mean, zero)
    var = centered.square().sum() / (n - 1).clamp(min=1)
    # sqrt has an infinite derivative at 0; keep var = 0 (and n < 2) out of it so a zero-spread
    # batch gets a 0 gradient rather than 0 * inf = NaN.
    has_spread = (n >= 2) & (var > 0)
    std = torch.where(has_spread, torch.where(has_spread, var, 1.0).sqrt(), zero)
    denom = std + eps
    scaled = torch.where(denom > 0, centered / torch.where(denom > 0, denom, 1.0), zero)
    if not shift_mean:
        scaled = scaled + mean
    return torch.where(keep, scaled, zero).to(out_dtype)


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    token_kl: Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++ advantages: per-token returns of the KL-shaped reward, whitened over the batch.

        r_t = [t == last] * R_i - token_kl_t            (token_level_rewards)
        G_t = r_t + gamma * G_{t'}                       (discounted_returns)
        A_t = (G_t - mean(G)) / (std(G) + eps)           (whiten over all mask-true tokens of the batch)

    No critic and no per-prompt baseline: the batch-wide normalisation is the baseline.

    Returns:
        [B, T] detached, 0 at masked positions.
    """
    token_r = token_level_rewards(rewards.detach(), mask, None if token_kl is None else token_kl.detach())
    returns = discounted_returns(token_r, mask, gamma)
    return whiten(returns, mask, eps=eps).detach()


def reinforce_pp_baseline_advantages(
    rewards: Tensor,
    group_size: Groups,
    mask: Tensor,
    token_kl: Tensor | None = None,
    valid: Tensor | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++-baseline: group-mean baseline first, then KL shaping, returns and batch whitening.

        R'_i = R_i - mean_{j in V_g} R_j        (valid members of i's group; invalid rows 0)
        r_t  = [t == last] * R'_i - token_kl_t
        G_t  = sum_{t' >= t, mask-true} r_t'     (gamma = 1)
        A_t  = (G_t - mean(G)) / (std(G) + eps)  over mask-true tokens of valid rows

    Rows with ``valid=False`` are excluded from both the group mean and the whitening statistics
    and come out all 0 (their reward and token_kl may be NaN). A group of one valid member has
    R' = 0, so only its KL term remains. `group_size` is an int or each group's size (ragged
    groups): the baseline is each prompt's own mean over however many valid samples it has (a
    1-sample group gets R' = 0), and the whitening is over the whole batch as before.

    Returns:
        [B, T] detached, 0 at masked positions and on invalid rows.
    """
    _check_mask(mask)
    _check_per_sample(rewards, mask, "rewards")
    centered = grpo_advantages(rewards, group_size, std_normalize=False, valid=valid)
    keep = mask.bool()
    if valid is not None:
        keep = keep & valid.to(device=keep.device, dtype=torch.bool).unsqueeze(1)
    token_r = token_level_rewards(centered, keep, None if token_kl is None else token_kl.detach())
    returns = discounted_returns(token_r, keep, 1.0)
    return whiten(returns, keep, eps=eps).detach()


def gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the mask-true positions of each row.

    For consecutive mask-true positions t < t' (masked positions in between are skipped):

        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t                         (returns, the value-function target)

    and after the last mask-true position V = 0 and A = 0 (the episode ends there). Both outputs
    are 0 at masked positions; rewards and values there, NaN included, are never read. lam = 1
    gives Monte-Carlo returns minus V, lam = 0 the one-step TD error.

    Returns:
        (advantages, returns), both [B, T], detached, in float32 (float64 for float64 inputs).

    Raises:
        ValueError: shapes differ, the mask is not 2-D, or gamma/lam are outside [0, 1].
    """
    _check_mask(mask)
    _check_like(token_rewards, mask, "token_rewards")
    _check_like(values, mask, "values")
    _check_unit_interval(gamma, "gamma")
    _check_unit_interval(lam, "lam")
    dtype = _float_dtype(token_rewards, values)
    keep = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    r = torch.where(keep, token_rewards.detach().to(dtype), zero)
    v = torch.where(keep, values.detach().to(dtype), zero)
    b, t_len = keep.shape
    adv = torch.zeros((b, t_len), dtype=dtype, device=mask.device)
    next_v = r.new_zeros(b)
    next_a = r.new_zeros(b)
    # Serial scan: carry V_{t'} and A_{t'} of the next kept position through masked ones unchanged.
    for t in range(t_len - 1, -1, -1):
        k = keep[:, t]
        a_t = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        adv[:, t] = torch.where(k, a_t, zero)
        next_a = torch.where(k, a_t, next_a)
        next_v = torch.where(k, v[:, t], next_v)
    returns = torch.where(keep, adv + v, zero)
    return adv, returns


def distillation_advantages(
    student_log_probs: Tensor,
    teacher_log_probs: Tensor,
    mask: Tensor,
    coef: float = 1.0,
) -> Tensor:
    """Per-token advantage for on-policy distillation: the negative reverse-KL sample per token.

        A_t = coef * (log p_teacher(y_t) - log p_student(y_t))

    For tokens y_t sampled from the student, E[log p_student - log p_teacher] is KL(student ||
    teacher), so maximising sum_t A_t * log p_student(y_t) with a policy-gradient loss descends the
    reverse KL: tokens the teacher likes more than the student are pushed up. Detached; 0 at masked
    positions; float32 (float64 for float64 input).
    """
    _check_mask(mask)
    _check_like(student_log_probs, mask, "student_log_probs")
    _check_like(teacher_log_probs, mask, "teacher_log_probs")
    dtype = _float_dtype(student_log_probs, teacher_log_probs)
    diff = teacher_log_probs.detach().to(dtype) - student_log_probs.detach().to(dtype)
    return torch.where(mask.bool(), coef * diff, torch.zeros((), dtype=dtype, device=mask.device))
