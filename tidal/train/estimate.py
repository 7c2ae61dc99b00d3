"""From a scored rollout to per-token advantages: the config's estimator applied to tensors.

The math lives in `tidal.algo` (pure functions); this module only picks the function the config
names and feeds it. Everything is padded to [N, R] (R the longest response) with `mask` marking
the tokens that are trained on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from tidal.algo import (
    Groups,
    distillation_advantages,
    gae,
    grpo_advantages,
    kl_estimate,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    token_level_rewards,
)
from tidal.algo.options import AlgoConfig
from tidal.hardware import on_host
from tidal.types import Sample
from tidal.utils import load_object

# estimators that compare the samples of a group and give one advantage per sample
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "gspo", "cispo", "rloo")


@on_host
def pad_rows(rows: Sequence[Sequence[float]] | Sequence[Tensor], width: int | None = None) -> Tensor:
    """Right-pad 1-D rows with zeros into a float32 [N, width] tensor."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.zeros(len(rows), max(width, 1), dtype=torch.float32)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.float32)
    return out


def response_mask(samples: Sequence[Sample], width: int | None = None) -> Tensor:
    """[N, R] float 0/1: each sample's loss mask, zero-padded."""
    return pad_rows([s.loss_mask for s in samples], width)


def load_estimator(name: str) -> Callable:
    """A user advantage function given by dotted path; see `compute_advantages` for its contract."""
    return load_object(name, callable_required=True)


@on_host
def compute_advantages(
    algo: AlgoConfig,
    samples: Sequence[Sample],
    rewards: Tensor,
    valid: Tensor,
    group_size: Groups,
    log_probs: Tensor | None = None,
    ref_log_probs: Tensor | None = None,
    values: Tensor | None = None,
    teacher_log_probs: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, dict[str, float]]:
    """Advantages [N, R] (and returns [N, R] for ppo, else None) for one rollout batch.

    Args:
        rewards: [N] scalar rewards, group after group; `valid` [N] False for failed samples.
        group_size: the samples per group, or each group's size in order when groups differ in
            size (ragged groups: a generate function's fan-out varies by prompt).
        log_probs: [N, R] policy log-probs of the sampled tokens (needed for KL shaping and
            distillation; padded with zeros).
        ref_log_probs: [N, R] reference-model log-probs, when `algo.kl_coef > 0`.
        values: [N, R] critic values (ppo).
        teacher_log_probs: [N, R] teacher log-probs, when `algo.teacher` is set.

    KL shaping (`algo.kl_in_reward`): per-token penalty kl_coef * KL_t. Token-level estimators
    (reinforce_plus_plus*, ppo) take it per token; group estimators subtract its sum over the
    response from the sample's reward before comparing within the group.

    A user estimator `fn(rewards, mask, group_size, samples)` returns [N] or [N, R] advantages;
    its `group_size` is an int when all groups have that size, else the list of group sizes.
    """
    # a failed sample is never trained on, whatever its loss mask says
    mask = response_mask(samples) * valid[:, None].to(torch.float32)
    metrics: dict[str, float] = {}
    token_kl = None
    if algo.kl_in_reward:
        if log_probs is None or ref_log_probs is None:
            raise ValueError("algo.kl_in_reward needs the policy and reference log-probs")
        kl = kl_estimate(log_probs, ref_log_probs, algo.kl_kind)
        token_kl = torch.where(mask.bool(), algo.kl_coef * kl, torch.zeros(()))
        metrics["reward/kl_penalty"] = float(token_kl.sum(dim=1).mean())

    name = algo.advantage
    returns = None
    if name in GROUP_ESTIMATORS:
        r = rewards if token_kl is None else rewards - token_kl.sum(dim=1)
        if name == "rloo":
            adv = rloo_advantages(r, group_size, valid=valid)
        else:
            adv = grpo_advantages(r, group_size, std_normalize=name != "dr_grpo", valid=valid)
        adv = adv[:, None].expand_as(mask).clone()
    elif name == "reinforce_plus_plus":
        adv = reinforce_pp_advantages(torch.where(valid, rewards, 0.0), mask, token_kl, algo.gamma)
    elif name == "reinforce_plus_plus_baseline":
        adv = reinforce_pp_baseline_advantages(rewards, group_size, mask, token_kl, valid=valid)
    elif name == "ppo":
        if values is None:
            raise ValueError("algo.advantage=ppo needs critic values")
        token_rewards = token_level_rewards(torch.where(valid, rewards, 0.0), mask, token_kl)
        adv, returns = gae(token_rewards, values, mask, algo.gamma, algo.lam)
    else:
        adv = torch.as_tensor(load_estimator(name)(rewards, mask, group_size, list(samples)), dtype=torch.float32)
        if adv.dim() == 1 and adv.shape[0] == mask.shape[0]:
            adv = adv[:, None].expand_as(mask).clone()
        if tuple(adv.shape) != tuple(mask.shape):
            raise ValueError(
                f"advantage function {name} returned shape {tuple(adv.shape)}; expected [N] = [{mask.shape[0]}] "
                f"or [N, R] = {list(mask.shape)}"
            )

    if teacher_log_probs is not None:
        if log_probs is None:
            raise ValueError("distillation needs the policy log-probs")
        distill = distillation_advantages(log_probs, teacher_log_probs, mask, algo.distill_coef)
        metrics["distill/teacher_minus_student"] = float(distill.sum() / mask.sum().clamp(min=1))
        adv = adv + distill
    adv = torch.where(mask.bool(), adv.to(torch.float32), torch.zeros(()))
    return adv, returns, metrics
