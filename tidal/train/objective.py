"""The policy's loss for one micro-batch, composed from `tidal.algo` as the config says:

    loss = agg(policy_loss(logp, old, A) * is_weight) + kl_coef * agg(KL(logp, ref)) - entropy_coef * agg(H)

(`sft`: agg(-logp)). `agg` divides by the counts of the whole optimizer batch (see
`tidal.train.update`), so the sum of the micro-batches' gradients is the full batch's.
"""

from __future__ import annotations

from torch import Tensor

from tidal.algo import aggregate, cispo_loss, importance_weights, kl_estimate, policy_loss
from tidal.algo.options import AlgoConfig, resolved_loss_agg, resolved_policy_loss
from tidal.train.update import Sums
from tidal.utils import load_object

BUILT_IN = ("ppo", "gspo", "cispo")


class PolicyObjective:
    """Callable on one micro-batch; `kl_loss` says whether a KL term is in the loss."""

    def __init__(self, algo: AlgoConfig, kl_loss: bool) -> None:
        self.algo = algo
        self.name = "sft" if algo.mode == "sft" else resolved_policy_loss(algo)
        self.user_loss = None if self.name in ("sft", *BUILT_IN) else load_object(self.name, callable_required=True)
        self.agg = resolved_loss_agg(algo)
        self.kl_loss = kl_loss
        self.entropy_grad = algo.entropy_coef > 0

    def contributes(self, mask: Tensor, advantages: Tensor | None) -> Tensor:
        """[N] bool: whether a sample's loss can be non-zero. A sample with no loss token never
        can; under a built-in policy loss with no KL or entropy term, neither can one whose
        advantage is 0 on every loss token (each loss is A times a function of the ratio, so its
        value and gradient are exactly 0)."""
        keep = mask.sum(dim=1) > 0
        if advantages is not None and not (self.kl_loss or self.entropy_grad) and self.name in BUILT_IN:
            keep = keep & ((advantages * mask) != 0).any(dim=1)
        return keep

    def _policy_loss(self, logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, dict]:
        a = self.algo
        if self.name in ("ppo", "gspo"):
            level = "sequence" if self.name == "gspo" else "token"
            return policy_loss(logp, old, adv, mask, a.eps_clip, a.eps_clip_high, a.dual_clip, level)
        if self.name == "cispo":
            return cispo_loss(logp, old, adv, mask, None, a.eps_clip_high or a.eps_clip)
        per_token, metrics = self.user_loss(logp, old, adv, mask, a)
        if per_token.shape != logp.shape:
            raise ValueError(
                f"policy loss {self.name} returned shape {tuple(per_token.shape)}, expected {tuple(logp.shape)}"
            )
        return per_token, metrics

    def __call__(
        self,
        logp: Tensor,
        ent: Tensor,
        batch: dict[str, Tensor],
        norm: dict[str, float],
        sums: Sums,
        adv: Tensor | None = None,
        old: Tensor | None = None,
        ref: Tensor | None = None,
    ) -> Tensor:
        """The micro-batch's loss; `logp`, `ent` [B, R] from the policy, `adv`, `old`, `ref` [B, R]
        (`old` None: the policy has not moved since the rollout, so it is `logp` itself). Metrics
        go to `sums`, weighted by the micro-batch's loss tokens."""
        a, mask = self.algo, batch["loss_mask"]
        n_tok = float(mask.sum())
        old = logp.detach() if old is None else old
        if self.name == "sft":
            per_token, m = -logp, {}
        else:
            per_token, m = self._policy_loss(logp, old, adv.to(logp.dtype), mask)
            if a.is_correction != "none":
                w, wm = importance_weights(
                    old, batch["rollout_log_probs"], mask, a.is_level, a.is_correction, a.is_low, a.is_high
                )
                per_token = per_token * w
                m = {**m, **{f"is/{k}": v for k, v in wm.items()}}
        loss = aggregate(per_token, mask, self.agg, **norm)
        if self.kl_loss:
            kl = kl_estimate(logp, ref, a.kl_kind)
            loss = loss + a.kl_coef * aggregate(kl, mask, self.agg, **norm)
            sums.add("loss/kl", float(aggregate(kl.detach(), mask, "token_mean")), n_tok)
        if self.entropy_grad:
            loss = loss - a.entropy_coef * aggregate(ent, mask, self.agg, **norm)
        sums.add("loss/sft" if self.name == "sft" else "loss/pg", float(aggregate(per_token.detach(), mask)), n_tok)
        sums.add("actor/entropy", float(aggregate(ent.detach(), mask)), n_tok)
        for k, v in m.items():
            sums.add(k if "/" in k else f"actor/{k}", float(v), n_tok)
        if self.name != "sft":
            diff = (logp.detach() - batch["rollout_log_probs"]).abs()
            sums.add("actor/rollout_logprob_abs_diff", float(aggregate(diff, mask)), n_tok)
        return loss
