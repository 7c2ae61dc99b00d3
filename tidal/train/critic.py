"""The PPO critic: the policy's backbone with a scalar value head, trained on GAE returns with the
same machinery as the policy (`TrainedModel`, `Optimizer`, `optimizer_steps`).

V(s_t) is read from the hidden state that predicts response token t, i.e. the state in which
the policy chose that token, the same positions the actor scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from tidal.algo import aggregate, value_loss
from tidal.algo.options import AlgoConfig
from tidal.hardware import CPU, to_device
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

    def set_attn_implementation(self, name: str) -> None:
        self.backbone.set_attn_implementation(name)


class Critic:
    """Value model, its AdamW optimizer, and the value-clipped loss of `tidal.algo.value_loss`."""

    def __init__(
        self, model: str | Path, train: TrainConfig, algo: AlgoConfig, pad_id: int = 0, device: str = CPU
    ) -> None:
        self.cfg, self.algo = train, algo
        # with LoRA (train.lora_rank) the backbone gets adapters and the value head trains whole
        self.trained = TrainedModel(
            ValueModel(load_causal_lm(model)), train, pad_id, device=device, trainable=("head",)
        )
        self.opt = Optimizer(self.trained.master, algo.critic_lr, train)

    @property
    def module(self) -> torch.nn.Module:
        return self.trained.master

    def _values(self, batch: dict[str, Tensor]) -> Tensor:
        model = self.trained.compute
        with self.trained.autocast():
            hidden = self.trained.fwd.hidden(model.base_model, batch)
            return model.head(hidden).squeeze(-1).float()

    @torch.no_grad()
    def values(self, samples: Sequence[Sample]) -> Tensor:
        """[N, R] value of the state before each response token, zero-padded."""
        width = max(max(s.response_length for s in samples), 1)
        out = torch.zeros(len(samples), width, device=self.trained.device)
        self.trained.compute.eval()
        for idx in self.trained.fwd.plan(samples):
            v = self._values(self.trained.fwd.collate([samples[i] for i in idx]))
            for j, i in enumerate(idx):
                out[i, : samples[i].response_length] = v[j, : samples[i].response_length]
        return out.to(CPU)

    def train_step(self, samples: Sequence[Sample], returns: Tensor, old_values: Tensor) -> dict[str, float]:
        """One value update per `global_batch_size` samples: token-mean of the clipped value loss."""
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
        )
        return {**sums.mean(), **step_norm_metrics("critic", grad_norms)}

    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), **self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.trained.after_step()
        self.opt.load_state_dict(state)
