"""From a scored rollout to per-token advantages: the config's estimator applied to tensors.

The math lives in `tidal.algo` (pure functions); this module only picks the function the config
names and feeds it. Everything is padded to [N, R] (R the longest response) with `mask` marking
the tokens that are trained on.
"""

from __future__ import annotations

import logging
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


# ---------------------------------------------------------------- steps that train on nothing
def _values(rewards: Tensor) -> str:
    """`0.0`, or `0.0, 1.0` (at most four distinct values, then `...`), 4 significant digits."""
    distinct = sorted({float(r) for r in rewards.tolist()})
    texts = [f"{v:.4g}" for v in distinct[:4]]
    shown = ", ".join(t if any(c in t for c in ".ein") else f"{t}.0" for t in texts)
    return shown + (", ..." if len(distinct) > 4 else "")


def zero_advantage_reason(
    algo: AlgoConfig,
    samples: Sequence[Sample],
    rewards: Tensor,
    valid: Tensor,
    group_size: Groups,
    advantages: Tensor,
) -> str | None:
    """Why no token of the step has a non-zero advantage (so the policy loss has no gradient:
    the step learns nothing from its samples), with what to change; None when some token does.

    `advantages` [N, R] as `compute_advantages` returns them; the loss masks are read from
    `samples` as they will be trained (after `algo.mask_truncated` has cut truncated samples)."""
    mask = response_mask(samples, advantages.shape[1]) * valid[:, None].to(torch.float32)
    if bool(((advantages * mask) != 0).any()):
        return None
    n = len(samples)
    if not bool(valid.any()):
        why = f"every sample failed ({n} of {n})"
        fix = "each one's error is in samples/step_N.jsonl.gz (field error); fix the generate function or reward"
    elif not bool(mask.any()):
        truncated = algo.mask_truncated and all(s.response_length for s in samples)
        why = (
            "every sample was truncated and algo.mask_truncated is on"
            if truncated
            else "no sample has a token to train"
        )
        fix = "raise rollout.max_new_tokens (or rollout.response_budget) so that responses can finish"
    else:
        kept = rewards[valid]
        sizes = [group_size] * (n // group_size) if isinstance(group_size, int) else list(group_size)
        if algo.advantage in GROUP_ESTIMATORS and max(sizes) < 2:
            why = f"every group has one sample: {algo.advantage} compares the samples of a prompt"
            fix = "set rollout.n_samples_per_prompt to 4 or more"
        else:
            if bool((kept == kept[0]).all()):
                why = f"every reward was equal (all {_values(kept[:1])})"
                if algo.advantage in GROUP_ESTIMATORS:
                    why = f"every group's rewards were equal (all {_values(kept[:1])})"
            elif algo.advantage in GROUP_ESTIMATORS:
                why = f"every group's rewards were equal within the group (values {_values(kept)})"
            else:
                why = f"every advantage was zero (algo.advantage: {algo.advantage})"
            per_prompt = sizes[0] if len(set(sizes)) == 1 else "ragged"
            fix = (
                "a reward that tells better responses from worse ones (partial credit), more samples per prompt "
                f"(rollout.n_samples_per_prompt, now {per_prompt}), prompts the model solves sometimes but not always, "
                "or algo.dynamic_sampling: true (drops the groups whose rewards are all equal and samples more)"
            )
    if (algo.kl_coef > 0 and not algo.kl_in_reward) or algo.entropy_coef > 0:
        effect = "no sample had a non-zero advantage: only the KL and entropy terms trained this step"
    else:
        effect = "no sample had a non-zero advantage, so this step learned nothing from its samples"
    return f"{why}: {effect}. To change it: {fix}"


class NoSignalWarnings:
    """The console's WARNING for steps with no advantage (`zero_advantage_reason`): the first such
    step, then at most one line every `every` steps, with the count so far, so that a run that
    trains on nothing says so without repeating it each step."""

    def __init__(self, every: int = 10, logger: logging.Logger | None = None) -> None:
        self.every = every
        self.count = 0
        self.last: int | None = None
        self.log = logger or logging.getLogger("tidal")

    def check(self, step: int, reason: str | None) -> bool:
        """Count step `step` when `reason` says it had no signal; True when a line was logged."""
        if reason is None:
            return False
        self.count += 1
        if self.last is not None and step - self.last < self.every:
            return False
        self.last = step
        so_far = f" ({self.count} steps without a signal so far)" if self.count > 1 else ""
        self.log.warning("step %d: %s%s", step, reason, so_far)
        return True
