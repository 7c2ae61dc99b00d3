"""RL algorithm math: advantage estimators, policy/value losses, loss aggregation, importance-weight
corrections, reward shaping, KL estimators and masked reductions.

Everything here is a pure function on torch tensors (no I/O, no distributed calls), so it can be
tested on CPU and reused by any trainer backend.
"""

from tidal.algo.advantages import (
    Groups,
    discounted_returns,
    distillation_advantages,
    gae,
    group_ids,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    token_level_rewards,
    whiten,
)
from tidal.algo.corrections import IS_LEVELS, IS_MODES, importance_weights
from tidal.algo.losses import (
    AGGREGATE_MODES,
    KL_KINDS,
    POLICY_LOSS_LEVELS,
    aggregate,
    cispo_loss,
    entropy_from_logits,
    kl_estimate,
    log_probs_and_entropy,
    log_probs_from_logits,
    masked_mean,
    masked_sum,
    policy_loss,
    token_mean_loss,
    value_loss,
)
from tidal.algo.shaping import groups_with_signal, overlong_penalty

__all__ = [
    "AGGREGATE_MODES",
    "Groups",
    "IS_LEVELS",
    "IS_MODES",
    "KL_KINDS",
    "POLICY_LOSS_LEVELS",
    "aggregate",
    "cispo_loss",
    "discounted_returns",
    "distillation_advantages",
    "entropy_from_logits",
    "gae",
    "group_ids",
    "groups_with_signal",
    "grpo_advantages",
    "importance_weights",
    "kl_estimate",
    "log_probs_and_entropy",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "overlong_penalty",
    "policy_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "token_level_rewards",
    "token_mean_loss",
    "value_loss",
    "whiten",
]
