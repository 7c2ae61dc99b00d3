"""The PPO critic: the policy's backbone with a scalar value head, trained on GAE returns with the
same machinery as the policy (`TrainedModel`, `Optimizer`, `optimizer_steps`).

V(s_t) is read from the hidden state that predicts response token t, i.e. the state in which
the policy chose that token, the same positions the actor scores.

On trainer ranks (`tidal.cluster.trainers`) each rank holds a critic beside its actor, sharded
like it (FSDP2), on the same device: values and value updates are computed there, each rank on
its share of the batch (`share`, `most_micro_batches`, `all_sum`, as the actor's), never in the
driver.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from tidal.algo import aggregate, value_loss
from tidal.algo.options import AlgoConfig
from tidal.hardware import CPU, to_device
from tidal.train import parallel
from tidal.train.estimate import response_mask
from tidal.train.model import TrainedModel, load_causal_lm
from tidal.train.options import TrainConfig
from tidal.train.update import Optimizer, Sums, batch_normalizers, optimizer_steps, step_norm_metrics
from tidal.types import Sample


class ValueModel(torch.nn.Module):
    """A causal LM's backbone (`base_model`, as `TrainedModel` expects) and a linear value head."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.config = lm.config
        self.backbone = lm.base_model
        self.head = torch.nn.Linear(lm.config.hidden_size, 1)
        # zero init: the first values are 0, so the first advantages are the plain discounted rewards
        # rather than noise from a random head
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    @property
    def base_model(self) -> torch.nn.Module:
        return self.backbone

    def forward(self, batch: dict[str, Tensor], hidden: Callable) -> Tensor:
        """[B, R] values at the response positions of `batch`: `hidden(backbone, batch)` [B, R, H]
        through the head, in one forward of this module (FSDP2 gathers the root's parameters,
        the embeddings and the head, only when the root's forward runs)."""
        # a copy, not a view: FSDP2 hooks the root's output for its backward, and a view's hook
        # can be lost to a later in-place op
        return self.head(hidden(self.backbone, batch))[..., 0].clone()

    def set_attn_implementation(self, name: str) -> None:
        self.backbone.set_attn_implementation(name)


class Critic:
    """Value model, its AdamW optimizer, and the value-clipped loss of `tidal.algo.value_loss`."""

    def __init__(
        self,
        model: str | Path,
        train: TrainConfig,
        algo: AlgoConfig,
        pad_id: int = 0,
        device: str | torch.device = CPU,
        shard: Callable[[TrainedModel], None] | None = None,
    ) -> None:
        self.cfg, self.algo = train, algo
        # with LoRA (train.lora_rank) the backbone gets adapters and the value head trains whole
        self.trained = TrainedModel(
            ValueModel(load_causal_lm(model)), train, pad_id, device=device, trainable=("head",)
        )
        if shard is not None:
            shard(self.trained)
        self.opt = Optimizer(self.trained.master, algo.critic_lr, train, distributed=self.trained.sharded)
        # set on trainer ranks, as the actor's: this rank's share of a batch, the largest
        # micro-batch count over the ranks, a sum over the ranks
        self.share: Callable[[list[int]], list[int]] | None = None
        self.most_micro_batches: Callable[[int], int] | None = None
        self.all_sum: Callable[[Tensor], Tensor] | None = None

    @property
    def module(self) -> torch.nn.Module:
        return self.trained.master

    def _values(self, batch: dict[str, Tensor]) -> Tensor:
        if self.trained.cp_group is not None:
            return self._context_values(batch)
        with self.trained.autocast():
            return self.trained.compute(batch, self.trained.fwd.hidden).float()

    def _context_values(self, batch: dict[str, Tensor]) -> Tensor:
        """[B, R] values on a context-parallel rank: each cp rank's values at the positions its
        part of the row predicts, summed over the cp ranks (`tidal.train.context`); the head's
        gradient, like the backbone's, then comes from this rank's positions alone."""
        mine: list[Tensor] = []

        def hidden(backbone: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
            h, own = self.trained.context_hidden(backbone, batch)
            mine.append(own)
            return h

        values = self.trained.compute(batch, hidden).float()
        return parallel.all_sum(values * mine[0], self.trained.cp_group)

    @torch.no_grad()
    def values(self, samples: Sequence[Sample]) -> Tensor:
        """[N, R] value of the state before each response token, zero-padded. On trainer ranks
        each rank computes its share and the shares are summed over the ranks."""
        width = max(max(s.response_length for s in samples), 1)
        out = torch.zeros(len(samples), width, device=self.trained.device)
        self.trained.compute.eval()
        everyone = list(range(len(samples)))
        mine = self.share(everyone) if self.share is not None else everyone
        plan = [[mine[p] for p in pos] for pos in self.trained.fwd.plan([samples[i] for i in mine])] if mine else []
        n = self.most_micro_batches(len(plan)) if self.most_micro_batches is not None else len(plan)
        for k in range(n):  # FSDP2 ranks run as many forward passes as the busiest one
            idx = plan[k] if k < len(plan) else [0]
            v = self._values(self.trained.fwd.collate([samples[i] for i in idx]))
            if k < len(plan):
                for j, i in enumerate(idx):
                    out[i, : samples[i].response_length] = v[j, : samples[i].response_length]
        self.trained.reshard()
        return (self.all_sum(out) if self.all_sum is not None else out).to(CPU)

    def train_step(self, samples: Sequence[Sample], returns: Tensor, old_values: Tensor) -> dict[str, float]:
        """One value update per `global_batch_size` samples: token-mean of the clipped value loss."""
        sums, extra = self.train_sums(samples, returns, old_values)
        return {**sums.mean(), **extra}

    def train_sums(self, samples: Sequence[Sample], returns: Tensor, old_values: Tensor) -> tuple[Sums, dict]:
        """`train_step` with the metrics as weighted sums (trainer ranks' sums add up) and the
        step-level figures apart."""
        returns, old_values = to_device((returns, old_values), self.trained.device)

        def micro_loss(batch: dict[str, Tensor], idx: list[int], norm: dict[str, float], sums: Sums) -> Tensor:
            mask = batch["loss_mask"]
            r = mask.shape[1]
            v = self._values(batch)
            per_token, m = value_loss(v, old_values[idx, :r], returns[idx, :r], mask, self.algo.value_clip)
            n_tok = float(mask.sum())
            sums.add("critic/loss", float(aggregate(per_token.detach(), mask)), n_tok)
            sums.add("critic/clip_frac", float(m.get("clip_frac", 0.0)), n_tok)
            sums.add("critic/value_mean", float(aggregate(v.detach(), mask)), n_tok)
            return aggregate(per_token, mask, "token_mean", **norm)

        self.trained.compute.train()
        sums, grad_norms, _ = optimizer_steps(
            samples,
            self.cfg.global_batch_size,
            self.trained,
            self.opt,
            response_mask(samples),
            lambda m: batch_normalizers(m, "token_mean", 1),
            micro_loss,
            None,
            self.share,
            self.most_micro_batches,
            self._any_rank if self.all_sum is not None else None,
        )
        return sums, step_norm_metrics("critic", grad_norms)

    def _any_rank(self, flag: bool) -> bool:
        return bool(self.all_sum(torch.tensor([float(flag)], device=self.trained.device)) > 0)

    def state_dict(self) -> dict:
        """The value model's full weights and the optimizer state (on ranks: a collective, every
        rank calls it; rank 0's holds the tensors), resumable on any number of ranks."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self.trained.reshard()
        if self.trained.sharded:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model = get_model_state_dict(self.module, options=options)
        else:
            model = self.module.state_dict()
        return {"model": model, **self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if self.trained.sharded:  # every rank is given the full tensors and keeps its shards
            set_model_state_dict(self.module, state["model"], options=StateDictOptions(full_state_dict=True))
        else:
            self.module.load_state_dict(state["model"])
        self.trained.after_step()
        self.opt.load_state_dict(state)
