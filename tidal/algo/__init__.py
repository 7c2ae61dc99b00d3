"""RL algorithm math: advantage estimators, policy/value losses, loss aggregation, importance-weight
corrections, reward shaping, KL estimators and masked reductions.

Everything here is a pure function on torch tensors (no I/O, no distributed calls), so it can be
tested on CPU and reused by any trainer backend. The names below are imported on first use
(PEP 562): `tidal.algo.options`, which the config reads, must not bring torch in with this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "advantages": (
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
    ),
    "corrections": ("importance_weights",),
    "losses": (
        "POLICY_LOSS_LEVELS",
        "aggregate",
        "cispo_loss",
        "entropy_from_logits",
        "kl_estimate",
        "log_probs_and_entropy",
        "log_probs_from_logits",
        "masked_mean",
        "masked_sum",
        "policy_loss",
        "token_mean_loss",
        "value_loss",
    ),
    "options": ("AGGREGATE_MODES", "IS_LEVELS", "IS_MODES", "KL_KINDS"),
    "shaping": ("groups_with_signal", "overlong_penalty"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal.algo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tidal.algo.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
