"""The whole loop on a tiny model: metrics, checkpoints, weight versions, and exact resume."""

import json

import pytest
from conftest import loop_config, record_weight_versions, train_killed
from transformers import AutoModelForCausalLM

import tidal.loop
from tidal.reward.failures import TooManyFailedSamples

VOLATILE = ("time/", "perf/")  # wall-clock figures differ between any two runs


config = loop_config


def stable(history):
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in history]


def test_run_writes_metrics_checkpoints_and_versions(tiny_model_dir, tmp_path, monkeypatch):
    versions = record_weight_versions(monkeypatch)
    history = tidal.loop.train(config(tiny_model_dir, tmp_path, **{"train.num_steps": 3, "train.save_interval": 2}))
    assert [h["step"] for h in history] == [1, 2, 3]
    assert versions == [{0}, {1}, {2}]  # each rollout ran on the weights of the steps before it
    for key in (
        "reward/mean",
        "response/length_mean",
        "response/truncated_ratio",
        "loss/pg",
        "actor/clip_frac",
        "actor/entropy",
        "actor/grad_norm",
        "time/rollout",
        "time/train",
        "perf/rollout_tokens_per_s",
    ):
        assert key in history[0], key
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_2", "step_3"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_3"
    # an HF folder transformers loads as is
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / "step_3")
    assert model.config.num_hidden_layers == 2
    state = json.loads((tmp_path / "checkpoints" / "step_3" / "state.json").read_text())
    assert state["step"] == 3 and state["weight_version"] == 3


@pytest.mark.parametrize("extra", [{}, {"algo.kl_coef": 0.1, "algo.advantage": "dr_grpo", "train.warmup_steps": 3}])
def test_resume_after_a_crash_matches_an_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch, extra):
    # with KL on, the resumed run's reference must still be the initial model, not the checkpoint
    full = tidal.loop.train(config(tiny_model_dir, tmp_path / "full", **{"train.save_interval": 2, **extra}))

    # crash inside step 4's training, after step 2's checkpoint and step 3's metrics were written
    cut = config(tiny_model_dir, tmp_path / "cut", **{"train.save_interval": 2, **extra})
    train_killed(cut, monkeypatch)
    assert [json.loads(x)["step"] for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]

    resumed = tidal.loop.train(cut, resume=True)  # continues from step_2: redoes 3, then 4
    assert [h["step"] for h in resumed] == [1, 2, 3, 4]
    assert stable(resumed) == stable(full)
    # the runs really trained, so equal metrics mean equal weights, optimizer and data position
    assert all(h["actor/grad_norm"] > 0 for h in full)
    assert len({h["reward/mean"] for h in full}) > 1


def test_resume_without_checkpoint_starts_fresh(tiny_model_dir, tmp_path):
    history = tidal.loop.train(config(tiny_model_dir, tmp_path, **{"train.num_steps": 1}), resume=True)
    assert [h["step"] for h in history] == [1]


def test_failing_reward_marks_samples_failed_and_the_run_goes_on(tiny_model_dir, tmp_path, monkeypatch):
    mod = tmp_path / "flaky_reward.py"
    mod.write_text(
        "def reward(sample):\n"
        "    if sample.index % 4 == 0:\n"
        "        raise RuntimeError('verifier crashed')\n"
        "    return 1.0 if sample.index % 2 else 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    history = tidal.loop.train(
        config(tiny_model_dir, tmp_path / "run", **{"train.num_steps": 2, "reward.fn": "flaky_reward:reward"})
    )
    assert [h["response/failed_ratio"] for h in history] == [0.25, 0.25]
    assert [h["step"] for h in history] == [1, 2]


def test_a_reward_failing_on_every_sample_stops_the_run(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "broken_reward.py").write_text("def reward(sample):\n    raise KeyError('answer')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config(tiny_model_dir, tmp_path / "run", **{"train.num_steps": 2, "reward.fn": "broken_reward:reward"})
    with pytest.raises(TooManyFailedSamples, match=r"^16 of 16 samples failed \(100%\), more than "):
        tidal.loop.train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_eval_scores_a_checkpoint_deterministically(tiny_model_dir, tmp_path):
    from tidal.cli import main

    out = tmp_path / "eval.json"
    args = [
        "eval",
        str(tiny_model_dir),
        "--greedy",
        "--num-prompts",
        "6",
        "--out",
        str(out),
        "--reward.fn=conftest:token_parity_reward",
        "--rollout.max_new_tokens=4",
        "--data.env_args={n: 20}",
        "--engine.dtype=float32",
    ]
    assert main(args) == 0
    first = json.loads(out.read_text())
    assert list(first["datasets"]) == ["arithmetic"]  # data.path, as no eval set is given
    scores = first["datasets"]["arithmetic"]
    assert scores["prompts"] == 6 and scores["samples"] == 6
    assert scores["mean_reward"] in {i / 6 for i in range(7)}
    assert main(args) == 0
    assert json.loads(out.read_text()) == first  # greedy: the same answers every time


def test_rollout_metrics_with_dict_rewards():
    import torch

    from tidal.rollout.collect import rollout_metrics
    from tidal.types import Sample, Status

    def s(reward, n, status=Status.COMPLETED):
        return Sample(
            tokens=[1] * (3 + n),
            response_length=n,
            loss_mask=[1] * n,
            rollout_log_probs=[0.0] * n,
            reward=reward,
            status=status,
        )

    samples = [
        s({"score": 1.0, "correct": 1}, 4),
        s({"score": 0.0, "correct": 0}, 6, Status.TRUNCATED),
        s({"score": 0.5, "correct": 1, "note": "x"}, 2),
        s({"score": 0.5, "correct": 1}, 4),
    ]
    m = rollout_metrics(samples, torch.tensor([1.0, 0.0, 0.5, 0.5]), group=2)
    assert m["reward/mean"] == 0.5
    assert m["rewards/score"] == 0.5 and m["rewards/correct"] == 0.75
    assert "rewards/note" not in m
    assert m["response/length_mean"] == 4.0 and m["response/truncated_ratio"] == 0.25
    assert m["reward/equal_reward_groups"] == 0.5  # the second group's rewards are all equal


def test_kl_term_starts_at_zero_and_grows(tiny_model_dir, tmp_path):
    one_update = {"train.num_steps": 2, "algo.kl_coef": 0.1, "train.global_batch_size": 16}
    history = tidal.loop.train(config(tiny_model_dir, tmp_path, **one_update))
    assert history[0]["loss/kl"] == pytest.approx(0.0, abs=1e-9)  # policy == reference before any update
    assert history[1]["loss/kl"] > 0


def test_jsonl_prompts_without_chat_template_and_stop_strings(tiny_model_dir, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"q": f"say {i}", "a": str(i)}) + "\n" for i in range(6)))
    history = tidal.loop.train(
        config(
            tiny_model_dir,
            tmp_path / "run",
            **{
                "train.num_steps": 2,
                "data.path": str(data),
                "data.input_key": "q",
                "data.label_key": "a",
                "data.apply_chat_template": False,
                "sampling.stop": ["a", "e", "i", "o", "u", " "],
                "sampling.top_p": 0.9,
                "sampling.top_k": 50,
                "rollout.max_new_tokens": 32,
            },
        )
    )
    assert [h["step"] for h in history] == [1, 2]
    # stop strings end responses early, so few reach max_new_tokens
    assert all(h["response/length_mean"] < 32 for h in history)


@pytest.mark.parametrize(("dtype", "shared"), [("float32", "master"), ("bfloat16", "compute")])
def test_in_process_engine_shares_the_trainers_weights(tiny_model_dir, tmp_path, monkeypatch, dtype, shared):
    """No second copy of the weights: the engine's parameters are the trainer's tensors (its fp32
    master weights, or its bf16 compute copy), so a sync copies nothing and the next rollout runs
    on exactly the updated weights."""
    seen = {}
    real = tidal.loop.rl_step

    def spy(step, source, rollout, roles, cfg, *rest):
        out = real(step, source, rollout, roles, cfg, *rest)
        actor, engine = roles.trainer, roles.engines.engine
        trainer = actor.model if shared == "master" else actor.mixed.model
        ptrs = {n: p.data_ptr() for n, p in trainer.named_parameters()}
        seen[step] = all(p.data_ptr() == ptrs[n] for n, p in engine.core.model.named_parameters())
        seen["version"] = engine.weight_version
        return out

    monkeypatch.setattr(tidal.loop, "rl_step", spy)
    tidal.loop.train(
        config(tiny_model_dir, tmp_path, **{"train.num_steps": 2, "train.dtype": dtype, "engine.dtype": dtype})
    )
    assert seen == {0: True, 1: True, "version": 2}
