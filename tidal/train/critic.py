"""The PPO critic: the policy's backbone with a scalar value head, trained on GAE returns.

V(s_t) is read from the hidden state that predicts response token t, i.e. the state in which
the policy chose that token, the same positions the actor scores.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from tidal.algo import aggregate, value_loss
from tidal.config import AlgoConfig, TrainConfig
from tidal.hardware import resolve_dtype
from tidal.train.actor import batch_normalizers
from tidal.train.estimate import response_mask
from tidal.train.forward import Forward
from tidal.types import Sample


class Critic:
    """Value model, its AdamW optimizer, and the value-clipped loss of `tidal.algo.value_loss`."""

    def __init__(self, model: str | Path, train: TrainConfig, algo: AlgoConfig, pad_id: int = 0) -> None:
        self.cfg, self.algo = train, algo
        self.dtype = resolve_dtype(train.dtype, "train.dtype").dtype
        lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        self.fwd = Forward(train, lm, pad_id)
        head = torch.nn.Linear(lm.config.hidden_size, 1)
        # zero init: the first values are 0, so the first advantages are the plain discounted rewards
        # rather than noise from a random head
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        self.module = torch.nn.ModuleDict({"backbone": lm.base_model, "head": head})
        if train.gradient_checkpointing:
            lm.gradient_checkpointing_enable()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=algo.critic_lr,
            betas=tuple(train.adam_betas),
            weight_decay=train.weight_decay,
            fused=True,
        )

    def _autocast(self):
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)

    def _values(self, batch: dict[str, Tensor]) -> Tensor:
        with self._autocast():
            hidden = self.fwd.hidden(self.module["backbone"], batch)
            return self.module["head"](hidden).squeeze(-1).float()

    @torch.no_grad()
    def values(self, samples: Sequence[Sample]) -> Tensor:
        """[N, R] value of the state before each response token, zero-padded."""
        width = max(max(s.response_length for s in samples), 1)
        out = torch.zeros(len(samples), width)
        self.module.eval()
        for idx in self.fwd.plan(samples):
            v = self._values(self.fwd.collate([samples[i] for i in idx]))
            for j, i in enumerate(idx):
                out[i, : samples[i].response_length] = v[j, : samples[i].response_length]
        return out

    def train_step(self, samples: Sequence[Sample], returns: Tensor, old_values: Tensor) -> dict[str, float]:
        """One value update per `global_batch_size` samples: token-mean of the clipped value loss."""
        gbs = self.cfg.global_batch_size
        mask_all = response_mask(samples)
        self.module.train()
        sums = {"critic/loss": 0.0, "critic/clip_frac": 0.0, "critic/value_mean": 0.0}
        tokens, grad_norms = 0.0, []
        for u in range(len(samples) // gbs):
            chunk = list(range(u * gbs, (u + 1) * gbs))
            norm = batch_normalizers(mask_all[chunk], "token_mean", 1)
            self.optimizer.zero_grad(set_to_none=True)
            for pos in self.fwd.plan([samples[i] for i in chunk]):
                idx = [chunk[p] for p in pos]
                batch = self.fwd.collate([samples[i] for i in idx])
                mask = batch["loss_mask"]
                r = mask.shape[1]
                v = self._values(batch)
                per_token, m = value_loss(v, old_values[idx, :r], returns[idx, :r], mask, self.algo.value_clip)
                aggregate(per_token, mask, "token_mean", **norm).backward()
                n_tok = float(mask.sum())
                sums["critic/loss"] += float(aggregate(per_token.detach(), mask)) * n_tok
                sums["critic/clip_frac"] += float(m.get("clip_frac", 0.0)) * n_tok
                sums["critic/value_mean"] += float(aggregate(v.detach(), mask)) * n_tok
                tokens += n_tok
            max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.params, max_norm)))
            self.optimizer.step()
        t = max(tokens, 1.0)
        out = {k: v / t for k, v in sums.items()}
        out["critic/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        return out

    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
