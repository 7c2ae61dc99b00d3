"""Single-process policy trainer: log-probs, the configured policy loss, AdamW, gradient clipping.

Every loss term of a micro-batch is reduced with the normalisers of the whole optimizer batch
(token count, sequence count), so the accumulated gradient is exactly the full-batch loss's
gradient however the batch is cut into micro-batches or packed.

Precision (`train.dtype`): the weights the optimizer updates, saves and syncs are always fp32.
`bfloat16` computes forward and backward on a bf16 copy of them (`tidal.train.precision`);
`autocast` computes under bf16 autocast over the fp32 weights; `float32` computes in fp32; `auto`
is `bfloat16` where the hardware computes bf16 natively, else `float32` (`tidal.hardware`).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from tidal.algo import (
    aggregate,
    cispo_loss,
    importance_weights,
    kl_estimate,
    log_probs_and_entropy,
    log_probs_from_logits,
    policy_loss,
)
from tidal.config import AlgoConfig, TrainConfig, resolved_loss_agg, resolved_policy_loss
from tidal.hardware import resolve_dtype
from tidal.train.attention import use_packed_attention
from tidal.train.estimate import response_mask
from tidal.train.forward import Forward
from tidal.train.logits import token_log_probs, token_log_probs_and_entropy
from tidal.train.precision import Bf16Compute, to_bf16_params
from tidal.types import Sample
from tidal.utils import load_object


def load_frozen(path: str | Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval().requires_grad_(False)


def to_grid(values: Tensor, valid: Tensor) -> Tensor:
    """Scatter [T] per-token values back onto the [B, R] grid `valid` marks, zeros elsewhere
    (differentiable)."""
    return values.new_zeros(valid.shape).masked_scatter(valid, values)


def batch_normalizers(mask: Tensor, mode: str, max_len: int) -> dict[str, float]:
    """The global counts `aggregate` divides by, for one optimizer batch's [B, R] mask."""
    if mode == "seq_mean_token_sum_norm":
        return {"num_seqs": float(mask.shape[0]), "max_len": max_len}
    return {"num_tokens": float(mask.sum()), "num_seqs": float((mask.sum(dim=1) > 0).sum())}


class Actor:
    """The policy being trained, its optimizer, and the frozen reference (when KL is on) and
    teacher (for distillation) models."""

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        train: TrainConfig,
        algo: AlgoConfig,
        temperature: float = 1.0,
        pad_id: int = 0,
        reference: str | Path | None = None,
        max_response_len: int = 1,
    ) -> None:
        self.cfg, self.algo = train, algo
        # log-probs must come from the distribution the engine sampled from (temperature applied);
        # greedy rollouts (temperature 0) are scored at temperature 1, as the engine reports them
        self.temperature = temperature if temperature > 0 else 1.0
        self.pad_id = pad_id
        if isinstance(model, torch.nn.Module):
            self.model = model.float()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        self.model.train()
        if train.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.dtype = resolve_dtype(train.dtype, "train.dtype").dtype
        # `model` holds the fp32 master weights; `compute` is the model forward/backward run on
        self.mixed = Bf16Compute(self.model) if self.dtype == "bfloat16" else None
        self.compute = self.mixed.model if self.mixed is not None else self.model
        self.fwd = Forward(train, self.compute, pad_id)
        self.loss_name = "sft" if algo.mode == "sft" else resolved_policy_loss(algo)
        self.user_loss = None
        if self.loss_name not in ("sft", "ppo", "gspo", "cispo"):
            self.user_loss = load_object(self.loss_name, callable_required=True)
        self.agg = resolved_loss_agg(algo)
        self.max_response_len = max_response_len  # Dr.GRPO's constant normaliser
        self.ref = None
        if algo.kl_coef > 0:  # `reference` is the initial model when `model` is a resumed checkpoint
            ref = copy.deepcopy(self.model) if reference is None else load_frozen(reference)
            self.ref = self._frozen(ref)
        self.teacher = self._frozen(load_frozen(algo.teacher)) if algo.teacher else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=train.lr,
            betas=tuple(train.adam_betas),
            weight_decay=train.weight_decay,
            fused=True,  # one kernel over all parameters: ~3x faster than the per-tensor loop on CPU
        )
        warmup = train.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )

    def _frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen model computed like the policy (precision, attention), so that a reference or
        teacher equal to the policy gives exactly the policy's log-probs (KL exactly 0)."""
        model = model.eval().requires_grad_(False)
        if self.fwd.packing:
            use_packed_attention(model)
        return to_bf16_params(model) if self.mixed is not None else model

    # ---------------------------------------------------------------- forward
    def _autocast(self):
        if self.dtype != "autocast":
            return contextlib.nullcontext()
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)

    @contextlib.contextmanager
    def _one_cast_per_update(self):
        """Run an optimizer step's micro-batches inside one outer autocast region, itself switched
        off so only `_score` computes in bf16. Autocast keeps its bf16 copy of each fp32 weight
        until the outermost region exits, so each weight (the 28M-parameter embedding included)
        is cast once per optimizer step instead of once per micro-batch; the weights only change at
        `optimizer.step()`, after the region has closed."""
        if self.dtype != "autocast":
            yield
            return
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", enabled=False):
            yield

    def _response_hidden(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Hidden states [T, H] at the T real response positions (row-major over [B, R]) and that
        [B, R] position mask.

        Only real response positions go through the output projection and the vocabulary-wide
        log-softmax: with a 49k vocabulary they dominate the cost, prompt positions are never
        scored, and the padding of the [B, R] grid is often 30-40% of it.
        """
        valid = batch["response_valid"]
        return self.fwd.hidden(model.base_model, batch)[valid], valid

    def _score(self, model: torch.nn.Module, batch: dict[str, Tensor], entropy_grad: bool = False):
        """(log-probs, entropy) [B, R] of the response tokens, 0 past each response; the entropy
        carries a gradient only when it is a loss term, otherwise it is a metric. Logits are
        computed `train.logits_chunk_tokens` tokens at a time (see `tidal.train.logits`)."""
        head = model.get_output_embeddings()
        with self._autocast():
            hidden, valid = self._response_hidden(model, batch)
            logits = head(hidden) if self.dtype == "autocast" else None
        labels = batch["response_ids"][valid]
        if logits is not None:  # the output projection computed under autocast, as TRL does
            logp, ent = log_probs_and_entropy(logits, labels, self.temperature, entropy_grad)
        else:
            logp, ent = token_log_probs_and_entropy(
                hidden, head, labels, self.temperature, self.cfg.logits_chunk_tokens, entropy_grad
            )
        return to_grid(logp, valid), to_grid(ent, valid)

    @torch.no_grad()
    def compute_log_probs(self, samples: Sequence[Sample], which: str = "policy") -> Tensor:
        """[N, R] response log-probs (zero-padded) under the policy, `reference` or `teacher`."""
        model = {"policy": self.compute, "reference": self.ref, "teacher": self.teacher}[which]
        if model is None:
            raise RuntimeError(f"{which} log-probs requested but no {which} model is configured")
        width = max(max(s.response_length for s in samples), 1)
        out = torch.zeros(len(samples), width)
        head = model.get_output_embeddings()
        for idx in self.fwd.plan(samples):
            batch = self.fwd.collate([samples[i] for i in idx])
            with self._autocast():
                hidden, valid = self._response_hidden(model, batch)
                labels = batch["response_ids"][valid]
                if self.dtype == "autocast":
                    logp = log_probs_from_logits(head(hidden), labels, self.temperature)
                else:
                    logp = token_log_probs(hidden, head, labels, self.temperature, self.cfg.logits_chunk_tokens)
            out[idx, : valid.shape[1]] = to_grid(logp, valid)
        return out

    def _policy_loss(self, logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, dict]:
        a = self.algo
        if self.loss_name in ("ppo", "gspo"):
            level = "sequence" if self.loss_name == "gspo" else "token"
            return policy_loss(logp, old, adv, mask, a.eps_clip, a.eps_clip_high, a.dual_clip, level)
        if self.loss_name == "cispo":
            return cispo_loss(logp, old, adv, mask, None, a.eps_clip_high or a.eps_clip)
        per_token, metrics = self.user_loss(logp, old, adv, mask, a)
        if per_token.shape != logp.shape:
            raise ValueError(
                f"policy loss {self.loss_name} returned shape {tuple(per_token.shape)}, expected {tuple(logp.shape)}"
            )
        return per_token, metrics

    # ---------------------------------------------------------------- training
    def train_step(
        self,
        samples: Sequence[Sample],
        advantages: Tensor | None,
        old_log_probs: Tensor | None = None,
        ref_log_probs: Tensor | None = None,
    ) -> dict[str, float]:
        """One rollout batch → len(samples) / global_batch_size optimizer steps.

        `advantages` [N, R] or [N] (None in sft mode); `old_log_probs` [N, R] when already computed
        (else recomputed if there is more than one update, and taken from the current forward
        otherwise: the policy has not moved yet); `ref_log_probs` [N, R] for the KL loss term.
        Returns metrics averaged over tokens (loss terms) and over optimizer steps (grad norm).
        """
        gbs = self.cfg.global_batch_size
        if len(samples) % gbs:
            raise ValueError(f"train_step: {len(samples)} samples is not a multiple of global_batch_size {gbs}")
        if self.loss_name != "sft" and advantages is None:
            raise ValueError("train_step: advantages are required outside sft mode")
        n_updates = len(samples) // gbs
        mask_all = response_mask(samples)
        if advantages is not None and advantages.dim() == 1:  # one per sample: shared by its tokens
            advantages = advantages[:, None].expand_as(mask_all)
        old = old_log_probs
        if old is None and n_updates > 1 and self.loss_name != "sft":
            old = self.compute_log_probs(samples)
        kl_loss = self.ref is not None and not self.algo.kl_in_reward
        if kl_loss and ref_log_probs is None:
            ref_log_probs = self.compute_log_probs(samples, "reference")
        want_entropy = self.algo.entropy_coef > 0

        sums: dict[str, float] = {}
        weights: dict[str, float] = {}

        def add(key: str, value: float, weight: float) -> None:
            sums[key] = sums.get(key, 0.0) + value * weight
            weights[key] = weights.get(key, 0.0) + weight

        tokens = 0.0
        grad_norms = []
        # samples whose loss is exactly zero pass no gradient: not computing them is exact
        active = self._contributes(mask_all, advantages, kl_loss or want_entropy)
        skipped = 0
        self.compute.train()
        for u in range(n_updates):
            chunk = list(range(u * gbs, (u + 1) * gbs))
            norm = batch_normalizers(mask_all[chunk], self.agg, self.max_response_len)
            self.optimizer.zero_grad(set_to_none=True)
            live = [i for i in chunk if active[i]]
            skipped += len(chunk) - len(live)
            # the skipped tokens' policy loss is exactly 0: they count in its mean
            add(
                "loss/sft" if self.loss_name == "sft" else "loss/pg",
                0.0,
                float(mask_all[chunk].sum() - mask_all[live].sum()),
            )
            with self._one_cast_per_update():
                for pos in self.fwd.plan([samples[i] for i in live]):
                    idx = [live[p] for p in pos]
                    batch = self.fwd.collate([samples[i] for i in idx])
                    mask = batch["loss_mask"]
                    r = mask.shape[1]
                    n_tok = float(mask.sum())
                    logp, ent = self._score(self.compute, batch, entropy_grad=want_entropy)
                    old_lp = logp.detach() if old is None else old[idx, :r]
                    if self.loss_name == "sft":
                        per_token, m = -logp, {}
                    else:
                        per_token, m = self._policy_loss(logp, old_lp, advantages[idx, :r].to(logp.dtype), mask)
                        if self.algo.is_correction != "none":
                            w, wm = importance_weights(
                                old_lp,
                                batch["rollout_log_probs"],
                                mask,
                                self.algo.is_level,
                                self.algo.is_correction,
                                self.algo.is_low,
                                self.algo.is_high,
                            )
                            per_token = per_token * w
                            m = {**m, **{f"is/{k}": v for k, v in wm.items()}}
                    loss = aggregate(per_token, mask, self.agg, **norm)
                    if kl_loss:
                        kl = kl_estimate(logp, ref_log_probs[idx, :r], self.algo.kl_kind)
                        loss = loss + self.algo.kl_coef * aggregate(kl, mask, self.agg, **norm)
                        add("loss/kl", float(aggregate(kl.detach(), mask, "token_mean")), n_tok)
                    if want_entropy:
                        loss = loss - self.algo.entropy_coef * aggregate(ent, mask, self.agg, **norm)
                    loss.backward()
                    with torch.no_grad():
                        add(
                            "loss/sft" if self.loss_name == "sft" else "loss/pg",
                            float(aggregate(per_token.detach(), mask)),
                            n_tok,
                        )
                        add("actor/entropy", float(aggregate(ent.detach(), mask)), n_tok)
                        for k, v in m.items():
                            add(k if "/" in k else f"actor/{k}", float(v), n_tok)
                        if self.loss_name != "sft":
                            diff = (logp.detach() - batch["rollout_log_probs"]).abs()
                            add("actor/rollout_logprob_abs_diff", float(aggregate(diff, mask)), n_tok)
                    tokens += n_tok
            for p in self.params:  # a fully skipped batch still takes its (zero-gradient) AdamW step
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.params, max_norm)))
            self.optimizer.step()
            self.scheduler.step()
            if self.mixed is not None:
                self.mixed.sync()
        metrics = {k: v / max(weights[k], 1.0) for k, v in sums.items()}
        metrics.update(
            {
                "actor/grad_norm": sum(grad_norms) / len(grad_norms),
                "actor/lr": self.scheduler.get_last_lr()[0],
                "actor/updates": float(n_updates),
                "actor/tokens": tokens,
                "actor/skipped_samples": float(skipped),
            }
        )
        return metrics

    def _contributes(self, mask: Tensor, advantages: Tensor | None, extra_terms: bool) -> list[bool]:
        """Per sample: whether its loss can be non-zero. A sample with no loss token never can; with
        `train.skip_zero_advantage`, neither can one whose advantage is 0 on every loss token under a
        built-in policy loss with no KL or entropy term (each of them is A times a function of
        the ratio, so its value and gradient are exactly 0)."""
        has_tokens = mask.sum(dim=1) > 0
        if not self.cfg.skip_zero_advantage:
            return [True] * mask.shape[0]
        keep = has_tokens
        if advantages is not None and not extra_terms and self.loss_name in ("ppo", "gspo", "cispo"):
            keep = keep & ((advantages * mask) != 0).any(dim=1)
        return keep.tolist()

    # ---------------------------------------------------------------- weights / state
    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters by name, for weight sync to the engines: the fp32 master weights, or with
        `dtype` bf16 and a bf16 compute copy, that copy's tensors (kept equal to the master's after
        every optimizer step), so an engine in the same process can share them."""
        compute = None
        if dtype == torch.bfloat16 and self.mixed is not None:
            compute = dict(self.mixed.model.named_parameters(remove_duplicate=False))
        for name, p in self.model.named_parameters():
            yield name, (compute[name] if compute is not None else p).detach()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
