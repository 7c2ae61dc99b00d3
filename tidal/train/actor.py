"""Single-process policy trainer: log-probs, PPO-clip loss, AdamW, gradient clipping.

The loss of every micro-batch is divided by the masked-token count of the whole optimizer batch,
so the accumulated gradient is exactly the full-batch token mean whatever the micro-batch size.
Weights stay fp32 (bf16 weights lose small updates); `dtype` only sets the autocast compute dtype.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tidal.algo import (
    entropy_from_logits,
    kl_estimate,
    log_probs_from_logits,
    policy_loss,
    token_mean_loss,
)
from tidal.config import AlgoConfig, TrainConfig
from tidal.train.batching import collate, micro_batches
from tidal.types import Sample


class Actor:
    """The policy being trained, its optimizer and (when KL is on) a frozen reference copy."""

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        train: TrainConfig,
        algo: AlgoConfig,
        temperature: float = 1.0,
        pad_id: int = 0,
        reference: str | Path | None = None,
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
        self.ref = None
        if algo.kl_coef > 0:  # `reference` is the initial model when `model` is a resumed checkpoint
            ref = (
                copy.deepcopy(self.model)
                if reference is None
                else AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32)
            )
            self.ref = ref.eval().requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=train.lr,
            betas=tuple(train.adam_betas),
            weight_decay=train.weight_decay,
        )
        warmup = train.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )

    # ---------------------------------------------------------------- forward
    def _autocast(self):
        if self.cfg.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)

    def _response_logits(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits that predict each response token, [B, R, V].

        Only response positions go through the output projection: with a 49k vocabulary that
        projection dominates the cost, and prompt positions are never scored.
        """
        hidden = model.base_model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
        r = batch["response_ids"].shape[1]
        # response token j of row i sits at prompt_len_i + j and is predicted from the position before
        pos = batch["prompt_lengths"][:, None] - 1 + torch.arange(r)[None, :]
        pos = pos.clamp(max=hidden.shape[1] - 1)
        sel = hidden.gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
        return model.get_output_embeddings()(sel).float() / self.temperature

    def _score(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropy) of the response tokens; the entropy carries a gradient only when
        it is a loss term, otherwise it is a metric computed from the same logits."""
        with self._autocast():
            logits = self._response_logits(model, batch)
        logp = log_probs_from_logits(logits, batch["response_ids"])
        if entropy_grad:
            return logp, entropy_from_logits(logits)
        with torch.no_grad():
            return logp, entropy_from_logits(logits.detach())

    @torch.no_grad()
    def compute_log_probs(self, samples: Sequence[Sample], reference: bool = False) -> list[torch.Tensor]:
        """Per-sample response log-probs [R_i] under the current (or reference) model, no grad."""
        model = self.ref if reference else self.model
        if model is None:
            raise RuntimeError("reference log-probs requested but algo.kl_coef is 0 (no reference model)")
        out = []
        for sl in micro_batches(len(samples), self.cfg.micro_batch_size):
            mb = samples[sl]
            batch = collate(mb, self.pad_id)
            with self._autocast():
                logits = self._response_logits(model, batch)
            logp = log_probs_from_logits(logits, batch["response_ids"])
            out.extend(logp[i, : s.response_length].clone() for i, s in enumerate(mb))
        return out

    # ---------------------------------------------------------------- training
    def train_step(self, samples: Sequence[Sample], advantages: torch.Tensor) -> dict[str, float]:
        """One rollout batch → len(samples) / global_batch_size optimizer steps. Returns metrics
        averaged over tokens (loss terms) and over optimizer steps (grad norm)."""
        gbs = self.cfg.global_batch_size
        if len(samples) % gbs:
            raise ValueError(f"train_step: {len(samples)} samples is not a multiple of global_batch_size {gbs}")
        n_updates = len(samples) // gbs
        # With one update per rollout the policy has not moved yet, so the current log-probs are
        # the old ones; more updates need them frozen before the first step.
        old = self.compute_log_probs(samples) if n_updates > 1 else None
        ref = self.compute_log_probs(samples, reference=True) if self.ref is not None else None

        sums = {k: 0.0 for k in ("pg", "kl", "clip", "entropy", "approx_kl", "rollout_diff")}
        tokens = 0.0
        grad_norms = []
        self.model.train()
        for u in range(n_updates):
            chunk = range(u * gbs, (u + 1) * gbs)
            total = sum(float(sum(samples[i].loss_mask)) for i in chunk)
            denom = max(total, 1.0)
            self.optimizer.zero_grad(set_to_none=True)
            for sl in micro_batches(gbs, self.cfg.micro_batch_size):
                idx = list(chunk)[sl]
                mb = [samples[i] for i in idx]
                batch = collate(mb, self.pad_id)
                mask = batch["loss_mask"]
                want_entropy = self.algo.entropy_coef > 0
                logp, ent = self._score(self.model, batch, entropy_grad=want_entropy)
                old_lp = logp.detach() if old is None else _pad([old[i] for i in idx], logp.shape)
                adv = advantages[idx].to(logp.dtype)
                pg, clipped = policy_loss(logp, old_lp, adv, self.algo.eps_clip, self.algo.eps_clip_high)
                loss = token_mean_loss(pg, mask, denom)
                if ref is not None:
                    kl = kl_estimate(logp, _pad([ref[i] for i in idx], logp.shape), self.algo.kl_kind)
                    loss = loss + self.algo.kl_coef * token_mean_loss(kl, mask, denom)
                    sums["kl"] += float(token_mean_loss(kl.detach(), mask, 1.0))
                if want_entropy:
                    loss = loss - self.algo.entropy_coef * token_mean_loss(ent, mask, denom)
                loss.backward()
                with torch.no_grad():
                    d = logp.detach() - old_lp
                    sums["pg"] += float(token_mean_loss(pg.detach(), mask, 1.0))
                    sums["clip"] += float(token_mean_loss(clipped.float(), mask, 1.0))
                    sums["entropy"] += float(token_mean_loss(ent.detach(), mask, 1.0))
                    sums["approx_kl"] += float(token_mean_loss(0.5 * d * d, mask, 1.0))
                    diff = (logp.detach() - batch["rollout_log_probs"]).abs()
                    sums["rollout_diff"] += float(token_mean_loss(diff, mask, 1.0))
            tokens += total
            max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.params, max_norm)))
            self.optimizer.step()
            self.scheduler.step()
        t = max(tokens, 1.0)
        metrics = {
            "loss/pg": sums["pg"] / t,
            "actor/clip_frac": sums["clip"] / t,
            "actor/entropy": sums["entropy"] / t,
            "actor/approx_kl": sums["approx_kl"] / t,
            "actor/rollout_logprob_abs_diff": sums["rollout_diff"] / t,
            "actor/grad_norm": sum(grad_norms) / len(grad_norms),
            "actor/lr": self.scheduler.get_last_lr()[0],
            "actor/updates": float(n_updates),
            "actor/tokens": tokens,
        }
        if ref is not None:
            metrics["loss/kl"] = sums["kl"] / t
        return metrics

    # ---------------------------------------------------------------- weights / state
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters by name, for weight sync to the engines."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def _pad(rows: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    out = torch.zeros(shape, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out
