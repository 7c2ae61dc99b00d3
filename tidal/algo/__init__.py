"""RL algorithm math: advantage estimators, policy losses, KL estimators and masked reductions.

Everything here is a pure function on torch tensors (no I/O, no distributed calls), so it can be
tested on CPU and reused by any trainer backend.
"""

from tidal.algo.advantages import grpo_advantages
from tidal.algo.losses import (
    KL_KINDS,
    entropy_from_logits,
    kl_estimate,
    log_probs_from_logits,
    masked_mean,
    masked_sum,
    policy_loss,
    token_mean_loss,
)

__all__ = [
    "KL_KINDS",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_estimate",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "token_mean_loss",
]
