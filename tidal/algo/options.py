"""The `algo` option group: advantage estimator, policy loss and its aggregation, KL, critic,
distillation, DAPO's options, train/inference mismatch correction, MoE routing replay. The names
each option takes are defined here, once; the math in `tidal.algo` checks its arguments against them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tidal.options import USER_CODE, Need, is_dotted, one_of, opt

ESTIMATORS = (
    "grpo",
    "dr_grpo",
    "gspo",
    "cispo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "ppo",
)
# the estimators whose advantage compares the samples of a prompt's group
GROUPED_ESTIMATORS = ("grpo", "dr_grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus_baseline")
POLICY_LOSSES = ("auto", "ppo", "gspo", "cispo")
AGGREGATE_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
KL_KINDS = ("k1", "k2", "k3")
IS_MODES = ("truncate", "mask")  # algo.is_correction besides none
IS_LEVELS = ("token", "sequence", "geometric")


@dataclass
class AlgoConfig:
    mode: str = opt("rl", "rl (rollout + policy gradient) or sft (negative log-likelihood on data.path chats)")
    advantage: str = opt(
        "grpo",
        "advantage estimator: "
        + " | ".join(ESTIMATORS)
        + f" | your own `advantage(rewards, mask, group_size, samples)` returning [N] or [N, R] advantages, given as "
        f"{USER_CODE}",
    )
    policy_loss: str = opt(
        "auto",
        "ppo | gspo | cispo | your own `policy_loss(logp, old_logp, advantages, mask, algo)` returning (per-token "
        f"loss, metrics dict), given as {USER_CODE} (auto: gspo/cispo when algo.advantage names them, else ppo)",
    )
    loss_agg: str = opt(
        "auto",
        "how per-token losses are reduced: " + " | ".join(AGGREGATE_MODES) + " (auto: seq_mean_token_sum_norm for "
        "dr_grpo, seq_mean_token_mean for gspo, else token_mean)",
    )
    eps_clip: float = opt(0.2, "PPO clip range: ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]")
    eps_clip_high: float | None = opt(None, "upper clip range (defaults to eps_clip; gspo and cispo: see docs)")
    dual_clip: float | None = opt(None, "dual-clip constant c > 1 bounding the loss of negative advantages")
    kl_coef: float = opt(0.0, "weight of the KL to the reference model (0 = no reference model)")
    kl_kind: str = opt("k3", "KL estimator: " + " | ".join(KL_KINDS))
    kl_in_reward: bool = opt(False, "fold the KL into the reward (shaping) instead of adding it to the loss")
    entropy_coef: float = opt(0.0, "entropy bonus weight (subtracted from the loss)")
    gamma: float = opt(1.0, "discount for reinforce_plus_plus and ppo (GAE)")
    lam: float = opt(0.95, "GAE lambda (ppo)")
    critic_lr: float = opt(1e-5, "critic learning rate (ppo)")
    value_clip: float | None = opt(0.2, "value clipping range of the critic loss (ppo; null = off)")
    teacher: str | None = opt(None, "model folder of a teacher for on-policy distillation (same tokenizer)")
    distill_coef: float = opt(1.0, "weight of the per-token teacher-minus-student log-prob in the advantage")
    dynamic_sampling: bool = opt(False, "DAPO: drop groups whose rewards are all equal and sample more prompts")
    dynamic_sampling_filter: str = opt(
        "",
        "dynamic_sampling: your own `keep(group: list[Sample]) -> bool` keeping a group or not, instead of the "
        f"built-in rule (rewards not all equal), given as {USER_CODE}",
    )
    max_sampling_rounds: int = opt(3, "rollout rounds per step to fill the batch when dynamic_sampling is on")
    oversample: float = opt(1.0, "prompts asked per round, as a multiple of the groups still missing")
    overlong_buffer: int = opt(0, "DAPO soft overlong penalty over the last N tokens before max_new_tokens (0 = off)")
    overlong_penalty: float = opt(1.0, "the penalty reached at max_new_tokens")
    mask_truncated: bool = opt(False, "DAPO: truncated samples keep their reward in the group but get no loss")
    is_correction: str = opt("none", "train/rollout mismatch correction: none | truncate (TIS) | mask (ICEPOP)")
    is_level: str = opt("token", "importance ratio level: " + " | ".join(IS_LEVELS))
    is_low: float | None = opt(None, "lower ratio bound of the correction (null = none)")
    is_high: float = opt(2.0, "upper ratio bound of the correction")
    routing_replay: bool = opt(
        False,
        "MoE models: the trainer's forwards use the experts the engine chose for each token (routing replay, R3); "
        "the routing weights still come from the trainer's router",
    )

    @property
    def grouped(self) -> bool:
        """Whether the advantage compares the samples of a prompt's group."""
        return self.advantage in GROUPED_ESTIMATORS

    def check(self, need: Need) -> None:
        need(self.mode in ("rl", "sft"), f"algo.mode: rl or sft, got {self.mode!r}")
        need(
            self.advantage in ESTIMATORS or is_dotted(self.advantage),
            f"algo.advantage: one of {', '.join(ESTIMATORS)} or a dotted path, got {self.advantage!r}",
        )
        need(
            self.policy_loss in POLICY_LOSSES or is_dotted(self.policy_loss),
            f"algo.policy_loss: one of {', '.join(POLICY_LOSSES)} or a dotted path, got {self.policy_loss!r}",
        )
        one_of(need, "algo.loss_agg", self.loss_agg, ("auto", *AGGREGATE_MODES))
        need(self.eps_clip > 0, f"algo.eps_clip: must be > 0, got {self.eps_clip}")
        need(self.eps_clip_high is None or self.eps_clip_high > 0, "algo.eps_clip_high: must be > 0 or null")
        need(self.dual_clip is None or self.dual_clip > 1, f"algo.dual_clip: must be > 1 or null, got {self.dual_clip}")
        need(self.kl_coef >= 0, f"algo.kl_coef: must be >= 0, got {self.kl_coef}")
        need(self.kl_kind in KL_KINDS, f"algo.kl_kind: k1, k2 or k3, got {self.kl_kind!r}")
        need(not self.kl_in_reward or self.kl_coef > 0, "algo.kl_in_reward: needs algo.kl_coef > 0 to have any effect")
        need(0 <= self.gamma <= 1, f"algo.gamma: must be in [0, 1], got {self.gamma}")
        need(0 <= self.lam <= 1, f"algo.lam: must be in [0, 1], got {self.lam}")
        need(self.critic_lr > 0, f"algo.critic_lr: must be > 0, got {self.critic_lr}")
        need(self.value_clip is None or self.value_clip > 0, "algo.value_clip: must be > 0 or null")
        need(
            self.teacher is None or Path(self.teacher).is_dir(), f"algo.teacher: {self.teacher!r} is not a model folder"
        )
        need(
            not self.dynamic_sampling_filter or is_dotted(self.dynamic_sampling_filter),
            f"algo.dynamic_sampling_filter: a dotted path or file.py:fn, got {self.dynamic_sampling_filter!r}",
        )
        need(
            not self.dynamic_sampling_filter or self.dynamic_sampling,
            "algo.dynamic_sampling_filter: only used by dynamic sampling; set algo.dynamic_sampling true",
        )
        need(self.max_sampling_rounds >= 1, f"algo.max_sampling_rounds: must be >= 1, got {self.max_sampling_rounds}")
        need(self.oversample >= 1, f"algo.oversample: must be >= 1, got {self.oversample}")
        need(
            self.is_correction in ("none", *IS_MODES),
            f"algo.is_correction: none, truncate or mask, got {self.is_correction!r}",
        )
        need(self.is_level in IS_LEVELS, f"algo.is_level: token, sequence or geometric, got {self.is_level!r}")
        need(self.is_high > 0, f"algo.is_high: must be > 0, got {self.is_high}")
        need(
            self.is_low is None or 0 <= self.is_low < self.is_high,
            f"algo.is_low: must be in [0, is_high) or null, got {self.is_low}",
        )


def resolved_policy_loss(a: AlgoConfig) -> str:
    """The loss `policy_loss: auto` stands for: the one named by a gspo/cispo estimator, else ppo."""
    if a.policy_loss != "auto":
        return a.policy_loss
    return a.advantage if a.advantage in ("gspo", "cispo") else "ppo"


def resolved_loss_agg(a: AlgoConfig) -> str:
    """`loss_agg: auto`: Dr.GRPO's constant normaliser for dr_grpo, sequence means for gspo."""
    if a.loss_agg != "auto":
        return a.loss_agg
    return {"dr_grpo": "seq_mean_token_sum_norm", "gspo": "seq_mean_token_mean"}.get(a.advantage, "token_mean")
