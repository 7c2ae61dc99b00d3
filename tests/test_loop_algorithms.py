"""Every estimator, loss and DAPO option through the whole loop on the tiny model."""

import json

import pytest
import torch
from test_loop import config, stable

import tidal.loop
from tidal.train.critic import Critic

ALGOS = {
    "grpo": {},
    "dr_grpo": {"algo.advantage": "dr_grpo"},
    "gspo": {"algo.advantage": "gspo", "algo.eps_clip": 3e-4, "algo.eps_clip_high": 4e-4},
    "cispo": {"algo.advantage": "cispo", "algo.eps_clip_high": 0.28},
    "rloo": {"algo.advantage": "rloo"},
    "reinforce_pp": {"algo.advantage": "reinforce_plus_plus", "algo.kl_coef": 0.01, "algo.kl_in_reward": True},
    "reinforce_pp_baseline": {"algo.advantage": "reinforce_plus_plus_baseline"},
    "ppo": {"algo.advantage": "ppo", "algo.critic_lr": 1e-3},
    "dual_clip_tis": {"algo.dual_clip": 3.0, "algo.is_correction": "truncate", "algo.is_high": 2.0},
    "icepop_geometric": {"algo.is_correction": "mask", "algo.is_level": "geometric", "algo.is_low": 0.5},
    "dapo": {
        "algo.dynamic_sampling": True,
        "algo.overlong_buffer": 4,
        "algo.eps_clip_high": 0.28,
        "algo.loss_agg": "token_mean",
    },
    "padded_token_budget": {"train.packing": False, "train.max_tokens_per_micro_batch": 60},
}


@pytest.mark.parametrize("name", list(ALGOS))
def test_every_algorithm_trains_through_the_loop(tiny_model_dir, tmp_path, name):
    history = tidal.loop.train(config(tiny_model_dir, tmp_path, **{"train.num_steps": 2, **ALGOS[name]}))
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert all(v == v for v in h.values() if isinstance(v, float)), h  # no NaN anywhere
        assert h["actor/grad_norm"] > 0
    if name == "ppo":
        assert history[0]["critic/loss"] > 0 and history[1]["critic/value_mean"] != 0.0
    if name == "reinforce_pp":
        assert history[0]["reward/kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    if name == "dapo":
        assert history[0]["dynamic_sampling/rounds"] >= 1
        kept, filled = history[0]["dynamic_sampling/groups_kept"], history[0]["dynamic_sampling/filled_without_signal"]
        assert min(kept, 4) + filled == 4


def test_mask_truncated_takes_truncated_samples_out_of_the_loss(tiny_model_dir, tmp_path):
    # step 1 samples the same responses with and without the option (same seeds, same weights);
    # a truncated response has exactly max_new_tokens = 8 tokens, all of which leave the loss;
    # every group has signal (actor/tokens counts only the samples with an advantage)
    one = {"train.num_steps": 1, "reward.fn": "conftest:index_parity_reward"}
    full = tidal.loop.train(config(tiny_model_dir, tmp_path / "a", **one))[0]
    over = {**one, "algo.mask_truncated": True}
    masked = tidal.loop.train(config(tiny_model_dir, tmp_path / "b", **over))[0]
    truncated = round(masked["response/truncated_ratio"] * 16)
    assert truncated > 0
    assert full["actor/tokens"] - masked["actor/tokens"] == 8 * truncated


def test_overlong_penalty_is_added_to_the_reward(tiny_model_dir, tmp_path):
    base = tidal.loop.train(config(tiny_model_dir, tmp_path / "a", **{"train.num_steps": 1}))[0]
    over = {"train.num_steps": 1, "algo.overlong_buffer": 8, "algo.overlong_penalty": 0.5}
    shaped = tidal.loop.train(config(tiny_model_dir, tmp_path / "b", **over))[0]
    # buffer = max_new_tokens = 8: every response of length L gets -L / 8 * 0.5
    expected = base["reward/mean"] - base["response/length_mean"] * 0.5 / 8
    assert shaped["reward/mean"] == pytest.approx(expected, abs=1e-6)


def test_ppo_resume_restores_the_critic(tiny_model_dir, tmp_path):
    ppo = {"algo.advantage": "ppo", "algo.critic_lr": 1e-3, "train.save_interval": 1}
    full = tidal.loop.train(config(tiny_model_dir, tmp_path / "full", **{"train.num_steps": 3, **ppo}))
    tidal.loop.train(config(tiny_model_dir, tmp_path / "cut", **{"train.num_steps": 2, **ppo}))
    resumed = tidal.loop.train(config(tiny_model_dir, tmp_path / "cut", **{"train.num_steps": 3, **ppo}), resume=True)
    assert stable(resumed) == stable(full)


def test_dynamic_sampling_keeps_only_groups_with_signal(tiny_model_dir, tmp_path, monkeypatch):
    """A reward that is constant on even prompts: those groups must be dropped and refilled."""
    mod = tmp_path / "half_signal.py"
    mod.write_text(
        "def reward(sample):\n"
        "    if sample.metadata['prompt_index'] % 2 == 0:\n"
        "        return 1.0\n"
        "    return float(sample.index % 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    over = {
        "train.num_steps": 1,
        "reward.fn": "half_signal:reward",
        "algo.dynamic_sampling": True,
        "algo.max_sampling_rounds": 4,
        "algo.oversample": 2.0,
    }
    (h,) = tidal.loop.train(config(tiny_model_dir, tmp_path / "run", **over))
    assert h["dynamic_sampling/filled_without_signal"] == 0.0
    assert h["reward/equal_reward_groups"] == 0.0  # every group kept has differing rewards
    assert h["reward/mean"] == pytest.approx(0.5)  # and so alternates 0/1 within each group


def test_sft_mode_lowers_the_nll_of_the_chats(tiny_model_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "yes"}]} for i in range(8)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = {"algo.mode": "sft", "data.path": str(data), "train.num_steps": 10, "train.lr": 1e-2}
    history = tidal.loop.train(config(tiny_model_dir, tmp_path / "run", **over))
    nll = [h["loss/sft"] for h in history]
    assert nll[-1] < 0.5 * nll[0], nll  # a constant answer is learned fast
    assert all("reward/mean" not in h for h in history)
    assert (tmp_path / "run" / "checkpoints" / "step_10" / "model.safetensors").exists()


def test_critic_values_come_from_the_positions_that_predict_each_token(tiny_model_dir):
    from tidal.algo.options import AlgoConfig
    from tidal.train.options import TrainConfig
    from tidal.types import Sample

    critic = Critic(tiny_model_dir, TrainConfig(dtype="float32", micro_batch_size=2), AlgoConfig())
    torch.nn.init.normal_(critic.module.head.weight)
    g = torch.Generator().manual_seed(0)
    samples = []
    for p_len, r_len in ((3, 5), (7, 2), (2, 9), (5, 1), (4, 6)):
        tokens = torch.randint(3, 300, (p_len + r_len,), generator=g).tolist()
        samples.append(
            Sample(tokens=tokens, response_length=r_len, loss_mask=[1] * r_len, rollout_log_probs=[0.0] * r_len)
        )
    v = critic.values(samples)
    for i, s in enumerate(samples):
        with torch.no_grad():
            h = critic.module.backbone(torch.tensor([s.tokens])).last_hidden_state[0]
            ref = critic.module.head(h).squeeze(-1)[s.prompt_length - 1 : -1]
        torch.testing.assert_close(v[i, : s.response_length], ref, atol=1e-5, rtol=1e-5)
        assert not v[i, s.response_length :].any()


def test_distillation_from_a_teacher_folder(tiny_model_dir, tmp_path):
    """The teacher is the initial policy: its log-probs equal the student's on the first step, so
    the distillation term starts at exactly 0 and moves once the student has been updated."""
    over = {"train.num_steps": 2, "algo.teacher": str(tiny_model_dir), "algo.distill_coef": 0.5}
    history = tidal.loop.train(config(tiny_model_dir, tmp_path, **over))
    assert history[0]["distill/teacher_minus_student"] == 0.0
    assert history[1]["distill/teacher_minus_student"] != 0.0
