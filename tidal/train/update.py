"""What every trainer (policy and critic) does the same way: AdamW with warm-up and clipping, and
one optimizer step as the sum of its micro-batches' gradients.

Every loss term of a micro-batch is divided by the counts of the whole optimizer batch (tokens,
sequences), so the accumulated gradient is exactly the full-batch loss's gradient however the
batch is cut into micro-batches, packed, or shared among trainer ranks.

Optimizer batches (`optimizer_batches`): when every group of a step has the same size, the step's
samples are cut into runs of `train.global_batch_size`, as they always were. When groups differ in
size (ragged groups), each batch is whole prompts: groups are taken in order while they fit in
`global_batch_size` samples, and a group larger than that is a batch alone; a prompt's samples are
never split across optimizer steps. The normalisers count each batch as it is: `token_mean`
divides by its trained tokens, `seq_mean_*` by its sequences with a trained token, and
`seq_mean_token_sum_norm` (Dr. GRPO) by its number of sequences times `max_len`, so a ragged batch
smaller than `global_batch_size` is the mean over what it holds, not over absent samples.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from tidal.hardware import CPU, is_cuda
from tidal.train import parallel
from tidal.train.forward import replaying
from tidal.train.model import TrainedModel
from tidal.train.options import TrainConfig
from tidal.types import RunStopped, Sample

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # AdamW's per-parameter state

log = logging.getLogger("tidal")


def batch_normalizers(mask: Tensor, mode: str, max_len: int) -> dict[str, float]:
    """The global counts `aggregate` divides by, for one optimizer batch's [B, R] mask: the B rows
    actually in the batch (with ragged groups B varies from batch to batch).

        seq_mean_token_sum_norm:  num_seqs = B, max_len            (Dr. GRPO's constant)
        otherwise:                num_tokens = sum(mask), num_seqs = #rows with a trained token
    """
    if mode == "seq_mean_token_sum_norm":
        return {"num_seqs": float(mask.shape[0]), "max_len": max_len}
    return {"num_tokens": float(mask.sum()), "num_seqs": float((mask.sum(dim=1) > 0).sum())}


class Sums:
    """Weighted sums of metrics over micro-batches: `mean()` gives each key's weighted mean."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, key: str, value: float, weight: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value * weight
        self.weights[key] = self.weights.get(key, 0.0) + weight

    def merge(self, other: Sums) -> None:
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
            self.weights[k] = self.weights.get(k, 0.0) + other.weights[k]

    def mean(self) -> dict[str, float]:
        return {k: v / max(self.weights[k], 1.0) for k, v in self.sums.items()}


class Optimizer:
    """AdamW over `module`'s trainable parameters (fused on a single process), linear warm-up,
    global-norm clipping. Its state is saved by parameter name with full (unsharded) tensors, so a
    checkpoint resumes on any number of trainer ranks."""

    def __init__(self, module: torch.nn.Module, lr: float, cfg: TrainConfig, distributed: bool = False):
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        params = self.params
        self.max_grad_norm = cfg.max_grad_norm
        self.max_bad_steps = cfg.max_bad_steps
        self.bad_steps = 0  # skipped steps in a row (non-finite loss or gradient)
        self.optimizer = torch.optim.AdamW(
            params,
            lr=lr,
            betas=tuple(cfg.adam_betas),
            weight_decay=cfg.weight_decay,
            # one kernel over all parameters: ~3x faster than the per-tensor loop on CPU; FSDP2's
            # sharded parameters take the multi-tensor path
            fused=not distributed,
            foreach=distributed or None,
        )
        self.offload = cfg.offload_optimizer
        # the device meshes the parameters live on (FSDP2 and tensor parallelism: two)
        self.meshes = len({id(p.device_mesh) for p in params if hasattr(p, "device_mesh")})
        self.device = self.params[0].device if self.params else torch.device(CPU)
        warmup = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, bad_loss: bool = False) -> float:
        """Clip and step; returns the gradient norm before clipping. A parameter no micro-batch
        reached (every sample skipped) gets a zero gradient, so AdamW still takes its step.

        A bad step, one whose gradient norm is not finite or whose loss was not (`bad_loss`, already
        agreed over the ranks), is skipped: weights, AdamW moments and the learning-rate schedule
        stay as they were, a warning is logged and NaN returned. `train.max_bad_steps` bad steps in
        a row raise `BadStepsError`. The norm is global on FSDP2 ranks, so every rank decides alike."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.meshes > 1:  # tensor parallel: whole weights used on each rank's heads
            parallel.sum_replicated_grads(self.module)
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        if self.meshes > 1:  # tensor parallel: gradients on the dp and the dp x tp meshes
            norm = float(parallel.grad_norm(self.params))
            if math.isfinite(norm):
                parallel.clip_grads(self.params, max_norm, norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            if hasattr(norm, "full_tensor"):  # a DTensor on FSDP2 ranks: the global norm
                norm = norm.full_tensor()
            norm = float(norm)
        if bad_loss or not math.isfinite(norm):
            self.zero_grad()
            self.bad_steps += 1
            what = "loss" if bad_loss else f"gradient norm ({norm})"
            log.warning(
                "optimizer step skipped: non-finite %s; %d bad step(s) in a row, the run stops at %d "
                "(train.max_bad_steps)",
                what,
                self.bad_steps,
                self.max_bad_steps,
            )
            if self.bad_steps >= self.max_bad_steps:
                raise BadStepsError(
                    f"train: {self.bad_steps} optimizer steps in a row had a non-finite loss or gradient "
                    f"(train.max_bad_steps {self.max_bad_steps}); the last: non-finite {what}. "
                    "Lower train.lr, check the rewards and advantages, or use float32."
                )
            return math.nan
        self.bad_steps = 0
        if self.offload:
            self.move_state(self.device)
        self.optimizer.step()
        if self.offload:
            self.move_state(CPU)
        self.scheduler.step()
        return norm

    def move_state(self, device: str | torch.device) -> None:
        """Move AdamW's moments to `device`: the host between steps with `train.offload_optimizer`,
        the parameters' device for the step itself (the step counts stay where AdamW keeps them).
        Host copies are pinned on CUDA machines so the copies do not block."""
        dev = torch.device(device)
        pin = dev.type == CPU and is_cuda(self.device)
        for state in self.optimizer.state.values():
            for k in MOMENTS:
                v = state.get(k)
                if v is None or v.device == dev:
                    continue
                moved = torch.empty_like(v, device=dev, pin_memory=pin)
                moved.copy_(v, non_blocking=pin or is_cuda(dev))
                state[k] = moved

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_dict(self) -> dict:
        """AdamW state keyed by parameter name, full tensors on CPU (on FSDP2 ranks: a collective,
        every rank calls it), and the scheduler's position."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optim = get_optimizer_state_dict(self.module, self.optimizer, options=options)
        # the gather adds the ranks' step counters (a plain tensor on every rank): keep our own
        # (ranks other than 0 get an empty dict)
        for name, p in self.module.named_parameters():
            if name in optim.get("state", {}) and "step" in self.optimizer.state.get(p, {}):
                optim["state"][name]["step"] = self.optimizer.state[p]["step"].detach().clone().cpu()
        return {"optimizer": optim, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        optim = dict(state["optimizer"])
        # the kernel choice (fused on one process, foreach on FSDP2 ranks) belongs to this optimizer
        own = self.optimizer.param_groups[0]
        optim["param_groups"] = [
            {**g, **{k: own[k] for k in ("fused", "foreach") if k in own}} for g in optim["param_groups"]
        ]
        set_optimizer_state_dict(
            self.module,
            self.optimizer,
            optim,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False),
        )
        self.scheduler.load_state_dict(state["scheduler"])


def step_norm_metrics(prefix: str, norms: Sequence[float]) -> dict[str, float]:
    """The mean gradient norm over the steps taken (skipped bad steps report NaN) and their count."""
    good = [n for n in norms if math.isfinite(n)]
    return {
        f"{prefix}/grad_norm": sum(good) / len(good) if good else math.nan,
        f"{prefix}/bad_steps": float(len(norms) - len(good)),
    }


class BadStepsError(RunStopped):
    """`train.max_bad_steps` optimizer steps in a row had a non-finite loss or gradient."""


def group_runs(samples: Sequence[Sample]) -> list[int]:
    """The lengths of the runs of consecutive samples sharing a `group_index` (the batch's groups,
    in order; SFT samples, all in group 0, are one run)."""
    runs: list[int] = []
    last = None
    for i, s in enumerate(samples):
        if i == 0 or s.group_index != last:
            runs.append(0)
            last = s.group_index
        runs[-1] += 1
    return runs


def optimizer_batches(sizes: Sequence[int], gbs: int) -> list[list[int]]:
    """The sample indices of each optimizer step for a batch whose groups have sizes `sizes` (laid
    out group after group).

    Equal sizes: consecutive runs of `gbs` samples, [0, gbs), [gbs, 2 gbs), ... (a group may span
    two steps, as it always could). Ragged sizes: whole groups in order, greedily, while the batch
    stays within `gbs` samples; a group larger than `gbs` is a batch of its own. Every sample is in
    exactly one batch and no group is split.

    Raises:
        ValueError: equal sizes whose total is not a multiple of `gbs`.
    """
    n = sum(sizes)
    if len(set(sizes)) <= 1:
        if n % gbs:
            raise ValueError(f"train_step: {n} samples is not a multiple of global_batch_size {gbs}")
        return [list(range(u * gbs, (u + 1) * gbs)) for u in range(n // gbs)]
    batches: list[list[int]] = []
    current: list[int] = []
    start = 0
    for size in sizes:
        if current and len(current) + size > gbs:
            batches.append(current)
            current = []
        current.extend(range(start, start + size))
        start += size
    if current:
        batches.append(current)
    return batches


MicroLoss = Callable[[dict[str, Tensor], list[int], dict[str, float], Sums], Tensor]


def optimizer_steps(
    samples: Sequence[Sample],
    gbs: int,
    model: TrainedModel,
    optimizer: Optimizer,
    mask: Tensor,
    normalizers: Callable[[Tensor], dict[str, float]],
    micro_loss: MicroLoss,
    active: Sequence[bool] | None = None,
    share: Callable[[list[int]], list[int]] | None = None,
    most_micro_batches: Callable[[int], int] | None = None,
    any_rank: Callable[[bool], bool] | None = None,
) -> tuple[Sums, list[float], int]:
    """Run one optimizer step per batch of `optimizer_batches` over `samples` ([N, R] loss `mask`):
    len(samples) / gbs steps when groups are equal, whole prompts up to `gbs` samples when ragged.

    For each optimizer batch: the global `normalizers` of its mask, then the micro-batches of its
    `active` samples (those whose loss can be non-zero; default all), restricted by `share` to this
    trainer rank's share; `micro_loss(batch, indices, norm, sums)` returns the loss to backpropagate
    (and adds its metrics to `sums`). Returns the metric sums, each step's gradient norm, and the
    number of samples not computed.

    On FSDP2 ranks every rank must run as many forward/backward passes as the others (each one
    gathers and reduces across ranks): `most_micro_batches(n)` returns the largest count over the
    ranks, and a rank with fewer runs the difference on a sample of the batch with its loss
    multiplied by 0 (no value, no gradient).

    A step with a non-finite loss on any rank (`any_rank(flag)`: true on every rank when it is on
    one; default this process's flag) is skipped, see `Optimizer.step`; its norm is NaN."""
    sums, norms, skipped = Sums(), [], 0
    for chunk in optimizer_batches(group_runs(samples), gbs):
        norm = normalizers(mask[chunk])
        optimizer.zero_grad()
        live = [i for i in chunk if active is None or active[i]]
        skipped += len(chunk) - len(live)
        mine = share(live) if share is not None else live
        plan = [[mine[p] for p in pos] for pos in model.fwd.plan([samples[i] for i in mine])] if mine else []
        extra = most_micro_batches(len(plan)) - len(plan) if most_micro_batches is not None else 0
        bad_loss = False
        with model.one_cast_per_update():
            for idx in plan:
                batch = model.fwd.collate([samples[i] for i in idx])
                with replaying(model.compute, batch):  # the backward too: checkpointing recomputes the forward
                    loss = micro_loss(batch, idx, norm, sums)
                    bad_loss = bad_loss or not bool(torch.isfinite(loss.detach()).all())
                    (loss * model.loss_scale if model.loss_scale != 1.0 else loss).backward()
            for _ in range(extra):
                idx = chunk[:1]
                batch = model.fwd.collate([samples[i] for i in idx])
                with replaying(model.compute, batch):
                    (0.0 * micro_loss(batch, idx, norm, Sums())).backward()
        norms.append(optimizer.step(any_rank(bad_loss) if any_rank is not None else bad_loss))
        model.after_step()
    # the gradients are not needed past the step: freed now, their memory serves what comes
    # before the next step (an in-process engine's packed weights, the rollout) instead of both
    optimizer.zero_grad()
    return sums, norms, skipped
