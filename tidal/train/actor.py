"""The policy trainer: log-probs of sampled tokens, and optimizer steps on the configured loss.

It composes a `TrainedModel` (master weights, precision, forward), the frozen reference (when a KL
term is on) and teacher (distillation) models, an `Optimizer`, and the `PolicyObjective`. It meets
the trainer role of `tidal.contracts.Trainer`; on a cluster each rank runs one over its FSDP2 shard.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

from tidal.algo import log_probs_and_entropy, log_probs_from_logits
from tidal.algo.options import AlgoConfig
from tidal.hardware import CPU, to_device
from tidal.moe import routing_shape
from tidal.options import ConfigError
from tidal.train import lora, parallel
from tidal.train.estimate import response_mask
from tidal.train.forward import replaying
from tidal.train.logits import output_head, token_log_probs, token_log_probs_and_entropy
from tidal.train.model import TrainedModel, load_causal_lm, load_frozen
from tidal.train.objective import PolicyObjective
from tidal.train.options import TrainConfig
from tidal.train.update import (
    Optimizer,
    Sums,
    batch_normalizers,
    group_runs,
    optimizer_batches,
    optimizer_steps,
    step_norm_metrics,
)
from tidal.types import Sample


def count_text(n: int) -> str:
    """A parameter count as people write it: `950`, `4.6K`, `1.2M`, `135M`, `1.7B`."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


# train.dtype (resolved) -> how the weights are kept and computed
_PRECISION = {
    "float32": "fp32 weights and compute",
    "bfloat16": "fp32 master weights, bf16 compute",
    "autocast": "fp32 master weights, bf16 autocast compute",
}


def describe_training(model: torch.nn.Module, cfg: TrainConfig, dtype: str, device: str | torch.device) -> str:
    """The start-up line saying what trains: full fine-tuning or LoRA (rank, alpha, the layers
    that got adapters), how many parameters train of how many, the precision and the device, e.g.
    `trains 1.2M of 135M parameters (LoRA r=8, alpha 32, on q_proj, v_proj; the base weights
    frozen), fp32 master weights, bf16 compute, on cpu`."""
    params = dict(model.named_parameters())  # tied weights once
    trained = sum(p.numel() for p in params.values() if p.requires_grad)
    precision = _PRECISION.get(dtype, f"train.dtype {dtype}")
    if not lora.enabled(cfg):
        total = sum(p.numel() for p in params.values())
        what = (
            f"all {count_text(total)} parameters (full fine-tuning)"
            if trained == total
            else (f"{count_text(trained)} of {count_text(total)} parameters")
        )
        return f"trains {what}, {precision}, on {device}"
    base = sum(p.numel() for n, p in params.items() if ".lora_" not in n)
    targets = ", ".join(sorted({name.rpartition(".")[2] for name in lora.lora_layers(model)}))
    return (
        f"trains {count_text(trained)} of {count_text(base)} parameters (LoRA r={cfg.lora_rank}, "
        f"alpha {cfg.lora_alpha:g}, on {targets}; the base weights frozen), {precision}, on {device}"
    )


def to_grid(values: Tensor, valid: Tensor) -> Tensor:
    """Scatter [T] per-token values back onto the [B, R] grid `valid` marks, zeros elsewhere
    (differentiable)."""
    return values.new_zeros(valid.shape).masked_scatter(valid, values)


class Actor:
    """The policy being trained, its optimizer, and the frozen reference and teacher models."""

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        train: TrainConfig,
        algo: AlgoConfig,
        temperature: float = 1.0,
        pad_id: int = 0,
        reference: str | Path | None = None,
        max_response_len: int = 1,
        shard: Callable[[TrainedModel], None] | None = None,
        device: str | torch.device = CPU,
    ) -> None:
        """`device`: where the models, optimizer state and batches live (resolved by the caller:
        `tidal.hardware.resolve_device`). Samples, advantages and the log-probs returned stay on
        the host; each micro-batch is copied to `device`."""
        self.cfg, self.algo = train, algo
        # log-probs must come from the distribution the engine sampled from (temperature applied);
        # greedy rollouts (temperature 0) are scored at temperature 1, as the engine reports them
        self.temperature = temperature if temperature > 0 else 1.0
        # With LoRA the base weights stay as loaded: a resumed checkpoint is an adapter folder,
        # put on the base model (`reference`), and the reference policy is the adapters switched off
        adapter = train.lora_adapter
        if lora.enabled(train) and lora.is_adapter(model if not isinstance(model, torch.nn.Module) else None):
            adapter, model = model, reference
        self.base = None if isinstance(model, torch.nn.Module) else str(reference or model)
        module = model if isinstance(model, torch.nn.Module) else load_causal_lm(model)
        if algo.routing_replay and routing_shape(module) is None:
            raise ConfigError(f"algo.routing_replay: needs an MoE model (one with top-k routers); {model!r} has none")
        self.trained = TrainedModel(module, train, pad_id, device=device, adapter=adapter, routing=algo.routing_replay)
        self.device = self.trained.device
        ref = None
        if algo.kl_coef > 0 and not self.trained.lora:  # `reference`: the initial model when resuming
            ref = copy.deepcopy(self.trained.master) if reference is None else load_frozen(reference)
        if shard is not None:
            shard(self.trained)
        self.ref = self.trained.frozen(ref) if ref is not None else None
        self.teacher = self.trained.frozen(load_frozen(algo.teacher)) if algo.teacher else None
        self.objective = PolicyObjective(algo, kl_loss=self.has_reference and not algo.kl_in_reward)
        self.max_response_len = max_response_len  # Dr.GRPO's constant normaliser
        self.opt = Optimizer(self.trained.master, train.lr, train, distributed=self.trained.sharded)
        # set on FSDP2 ranks (`tidal.cluster`): this rank's share of a batch, the largest
        # micro-batch count over the ranks, and a sum over the ranks
        self.share: Callable[[list[int]], list[int]] | None = None
        self.most_micro_batches: Callable[[int], int] | None = None
        self.all_sum: Callable[[Tensor], Tensor] | None = None
        self.rank = 0

    # the parts tests and benchmarks look at
    model = property(lambda self: self.trained.master)
    compute = property(lambda self: self.trained.compute)
    mixed = property(lambda self: self.trained.mixed)
    fwd = property(lambda self: self.trained.fwd)
    dtype = property(lambda self: self.trained.dtype)
    params = property(lambda self: self.opt.params)
    optimizer = property(lambda self: self.opt.optimizer)
    scheduler = property(lambda self: self.opt.scheduler)
    # with LoRA the reference is the policy with its adapters off: no model of its own
    has_reference = property(lambda self: self.ref is not None or (self.trained.lora and self.algo.kl_coef > 0))
    has_teacher = property(lambda self: self.teacher is not None)

    def describe(self) -> str:
        """What trains, for the start-up line (`describe_training`)."""
        return describe_training(self.model, self.cfg, self.dtype, self.device)

    # ---------------------------------------------------------------- scoring
    def _score(self, model: torch.nn.Module, batch: dict[str, Tensor], entropy_grad: bool = False):
        """(log-probs, entropy) [B, R] of the response tokens, 0 past each response; the entropy
        carries a gradient only when it is a loss term, otherwise it is a metric. Logits are
        computed `train.logits_chunk_tokens` tokens at a time (see `tidal.train.logits`)."""
        head = output_head(model)
        if self.trained.sharded:  # FSDP2 (the policy, and a reference or teacher sharded like it): the root's forward
            logits, valid = self.trained.root_logits(batch, model)
            labels = batch["response_ids"][valid]
            if self.trained.vocab is not None:  # tensor parallel: this rank's vocabulary slice
                split, t = self.trained.vocab, self.temperature
                logp, ent = parallel.vocab_log_probs_and_entropy(logits, labels, split, t, entropy_grad)
            else:
                logp, ent = log_probs_and_entropy(logits, labels, self.temperature, entropy_grad)
            logp, ent = to_grid(logp, valid), to_grid(ent, valid)
            if self.trained.cp_group is not None:  # context parallel: each cp rank scored its part
                group = self.trained.cp_group
                logp, ent = parallel.all_sum(logp, group), parallel.all_sum(ent, group)
            return logp, ent
        with self.trained.numerics():
            with self.trained.autocast():
                hidden, valid = self.trained.response_hidden(model, batch)
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
        """[N, R] response log-probs (zero-padded) under the policy, `reference` or `teacher`.
        On FSDP2 ranks each rank scores its share and the shares are summed over the ranks."""
        if which == "reference" and self.ref is None and self.has_reference:
            with self.trained.adapters_off():
                return self._log_probs(self.compute, samples)
        model = {"policy": self.compute, "reference": self.ref, "teacher": self.teacher}[which]
        if model is None:
            raise RuntimeError(f"{which} log-probs requested but no {which} model is configured")
        # the teacher is another model: the policy's recorded experts mean nothing to it
        return self._log_probs(model, samples, replay=which != "teacher")

    def _log_probs(self, model: torch.nn.Module, samples: Sequence[Sample], replay: bool = True) -> Tensor:
        """[N, R] log-probs under `model`; with `replay`, a batch's recorded experts, where it has
        them (`algo.routing_replay`), route its forward (`tidal.train.forward.replaying`)."""
        width = max(max(s.response_length for s in samples), 1)
        out = torch.zeros(len(samples), width, device=self.device)
        head = output_head(model)
        mine = self.share(list(range(len(samples)))) if self.share is not None else list(range(len(samples)))
        plan = [[mine[p] for p in pos] for pos in self.fwd.plan([samples[i] for i in mine])] if mine else []
        n = self.most_micro_batches(len(plan)) if self.most_micro_batches is not None else len(plan)
        for k in range(n):  # FSDP2 ranks run as many forward passes as the busiest one
            idx = plan[k] if k < len(plan) else [0]
            batch = self.fwd.collate([samples[i] for i in idx])
            with replaying(model, batch) if replay else contextlib.nullcontext():
                if self.trained.sharded:
                    logp, _ = self._score(model, batch)
                    if k < len(plan):
                        out[idx, : logp.shape[1]] = logp.float()
                    continue
                with self.trained.numerics(), self.trained.autocast():
                    hidden, valid = self.trained.response_hidden(model, batch)
                    labels = batch["response_ids"][valid]
                    if self.dtype == "autocast":
                        logp = log_probs_from_logits(head(hidden), labels, self.temperature)
                    else:
                        logp = token_log_probs(hidden, head, labels, self.temperature, self.cfg.logits_chunk_tokens)
            if k < len(plan):
                out[idx, : valid.shape[1]] = to_grid(logp, valid)
        self.trained.reshard()
        return (self.all_sum(out) if self.all_sum is not None else out).to(CPU)

    # ---------------------------------------------------------------- training
    def train_step(
        self,
        samples: Sequence[Sample],
        advantages: Tensor | None,
        old_log_probs: Tensor | None = None,
        ref_log_probs: Tensor | None = None,
    ) -> dict[str, float]:
        """One rollout batch → len(samples) / global_batch_size optimizer steps (with ragged groups:
        one per batch of whole prompts, see `tidal.train.update.optimizer_batches`).

        `advantages` [N, R] or [N] (None in sft mode); `old_log_probs` [N, R] when already computed
        (else recomputed if there is more than one update, and taken from the current forward
        otherwise: the policy has not moved yet); `ref_log_probs` [N, R] for the KL loss term.
        Samples whose loss is exactly 0 (`train.skip_zero_advantage`) are not computed: the
        gradient is the same. Returns metrics averaged over tokens (loss terms) and over optimizer
        steps (grad norm)."""
        sums, extra = self.train_sums(samples, advantages, old_log_probs, ref_log_probs)
        return {**sums.mean(), **extra}

    def train_sums(
        self,
        samples: Sequence[Sample],
        advantages: Tensor | None,
        old_log_probs: Tensor | None = None,
        ref_log_probs: Tensor | None = None,
    ) -> tuple[Sums, dict[str, float]]:
        """`train_step` with the metrics as weighted sums (trainer ranks' sums add up) and the
        step-level figures apart."""
        gbs = self.cfg.global_batch_size
        obj = self.objective
        if obj.name != "sft" and advantages is None:
            raise ValueError("train_step: advantages are required outside sft mode")
        n_updates = len(optimizer_batches(group_runs(samples), gbs))  # whole prompts when groups are ragged
        mask_all = response_mask(samples)
        if advantages is not None and advantages.dim() == 1:  # one per sample: shared by its tokens
            advantages = advantages[:, None].expand_as(mask_all)
        old = old_log_probs
        if old is None and n_updates > 1 and obj.name != "sft":
            old = self.compute_log_probs(samples)
        if obj.kl_loss and ref_log_probs is None:
            ref_log_probs = self.compute_log_probs(samples, "reference")
        active = obj.contributes(mask_all, advantages).tolist() if self.cfg.skip_zero_advantage else None
        advantages, old, ref_log_probs = to_device((advantages, old, ref_log_probs), self.device)
        tokens = [0.0]

        def micro_loss(batch: dict[str, Tensor], idx: list[int], norm: dict[str, float], sums: Sums) -> Tensor:
            r = batch["loss_mask"].shape[1]
            logp, ent = self._score(self.compute, batch, entropy_grad=obj.entropy_grad)
            tokens[0] += float(batch["loss_mask"].sum())
            return obj(
                logp,
                ent,
                batch,
                norm,
                sums,
                adv=None if advantages is None else advantages[idx, :r],
                old=None if old is None else old[idx, :r],
                ref=None if ref_log_probs is None else ref_log_probs[idx, :r],
            )

        self.compute.train()
        sums, grad_norms, skipped = optimizer_steps(
            samples,
            gbs,
            self.trained,
            self.opt,
            mask_all,
            lambda m: batch_normalizers(m, obj.agg, self.max_response_len),
            micro_loss,
            active,
            self.share,
            self.most_micro_batches,
            self._any_rank if self.all_sum is not None else None,
        )
        if active is not None and self.rank == 0:  # the skipped tokens' policy loss is exactly 0
            skipped_tokens = float(mask_all.sum() - mask_all[torch.tensor(active, dtype=torch.bool, device=CPU)].sum())
            sums.add("loss/sft" if obj.name == "sft" else "loss/pg", 0.0, skipped_tokens)
        return sums, {
            "actor/tokens": tokens[0],
            **step_norm_metrics("actor", grad_norms),
            "actor/lr": self.opt.lr,
            "actor/updates": float(n_updates),
            "actor/skipped_samples": float(skipped),
        }

    def _any_rank(self, flag: bool) -> bool:
        """True on every FSDP2 rank when `flag` is true on one (a sum over the ranks)."""
        return bool(self.all_sum(torch.tensor([float(flag)], device=self.device)) > 0)

    # ---------------------------------------------------------------- weights / state
    def named_weights(
        self, dtype: torch.dtype | None = None, changed_only: bool = False, merged: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters by name, for weight sync to the engines (see `TrainedModel.named_weights`)."""
        return self.trained.named_weights(dtype, changed_only, merged)

    def save_model(self, path: str | Path) -> None:
        """The policy as a Hugging Face folder (fp32 safetensors and config) at `path`; with LoRA,
        the adapter as a peft adapter folder naming the base model."""
        if self.trained.lora:
            lora.save_adapter(self.model, self.cfg, path, self.base)
        else:
            self.model.save_pretrained(str(path), safe_serialization=True)

    def state_dict(self) -> dict:
        self.trained.reshard()
        return self.opt.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)
