"""A step with no advantage to train on says so: why, and what to change, at most once every few
steps (`tidal.train.estimate.zero_advantage_reason`, `NoSignalWarnings`)."""

import logging

import torch
from conftest import loop_config, make_samples

import tidal.loop
from tidal.algo.options import AlgoConfig
from tidal.train.estimate import NoSignalWarnings, compute_advantages, zero_advantage_reason
from tidal.types import Status

FIX = (
    "To change it: a reward that tells better responses from worse ones (partial credit), more samples per prompt "
    "(rollout.n_samples_per_prompt, now 4), prompts the model solves sometimes but not always, or "
    "algo.dynamic_sampling: true (drops the groups whose rewards are all equal and samples more)"
)
NOTHING = "no sample had a non-zero advantage, so this step learned nothing from its samples"


def reason(rewards, algo=None, group=4, failed=(), truncated=()):
    algo = algo or AlgoConfig()
    samples = make_samples(n=len(rewards), group=group)
    for i in failed:
        samples[i].status = Status.FAILED
    for i in truncated:
        samples[i].status = Status.TRUNCATED
        samples[i].loss_mask = [0] * samples[i].response_length
    rewards = torch.tensor(rewards, dtype=torch.float32)
    valid = torch.tensor([s.status != Status.FAILED for s in samples])
    adv, _, _ = compute_advantages(algo, samples, rewards, valid, group)
    return zero_advantage_reason(algo, samples, rewards, valid, group, adv)


def test_equal_rewards_everywhere_name_the_value_and_the_ways_out():
    assert reason([0.0] * 8) == f"every group's rewards were equal (all 0.0): {NOTHING}. {FIX}"
    assert reason([1.0] * 8).startswith("every group's rewards were equal (all 1.0): ")
    # each group flat at its own value: still nothing to compare inside a group
    assert (
        reason([0.0] * 4 + [0.5] * 4)
        == f"every group's rewards were equal within the group (values 0.0, 0.5): {NOTHING}. {FIX}"
    )


def test_a_step_with_a_signal_has_no_reason():
    assert reason([0.0, 1.0, 0.0, 0.0] + [0.0] * 4) is None


def test_failed_truncated_and_single_sample_groups_say_so():
    assert reason([0.0] * 4, failed=range(4)) == (
        f"every sample failed (4 of 4): {NOTHING}. To change it: each one's error is in samples/step_N.jsonl.gz "
        "(field error); fix the generate function or reward"
    )
    cut = reason([0.0, 1.0, 0.0, 1.0], algo=AlgoConfig(mask_truncated=True), truncated=range(4))
    assert cut == (
        f"every sample was truncated and algo.mask_truncated is on: {NOTHING}. To change it: raise "
        "rollout.max_new_tokens (or rollout.response_budget) so that responses can finish"
    )
    assert reason([0.0, 1.0], group=1) == (
        f"every group has one sample: grpo compares the samples of a prompt: {NOTHING}. To change it: set "
        "rollout.n_samples_per_prompt to 4 or more"
    )


def test_a_kl_term_still_trains_and_the_line_says_so():
    got = reason([0.0] * 4, algo=AlgoConfig(kl_coef=0.1))
    assert got.startswith(
        "every group's rewards were equal (all 0.0): no sample had a non-zero advantage: only the KL and entropy "
        "terms trained this step. "
    )


def test_the_warning_comes_once_then_every_n_steps_with_a_count(caplog):
    warn = NoSignalWarnings(every=3)
    with caplog.at_level(logging.WARNING, logger="tidal"):
        logged = [warn.check(step, "why: what" if step != 3 else None) for step in range(1, 9)]
    assert logged == [True, False, False, True, False, False, True, False]  # steps 1, 4, 7 (3 had a signal)
    assert [r.getMessage() for r in caplog.records] == [
        "step 1: why: what",
        "step 4: why: what (3 steps without a signal so far)",
        "step 7: why: what (6 steps without a signal so far)",
    ]


def zero_reward(sample) -> float:
    return 0.0


def test_a_run_whose_rewards_are_all_equal_warns_once(tiny_model_dir, tmp_path, caplog):
    cfg = loop_config(tiny_model_dir, tmp_path, **{"train.num_steps": 2, "reward.fn": "test_no_signal:zero_reward"})
    with caplog.at_level(logging.WARNING, logger="tidal"):
        history = tidal.loop.train(cfg)
    assert [h["reward/equal_reward_groups"] for h in history] == [1.0, 1.0]
    assert [h["actor/skipped_samples"] for h in history] == [16.0, 16.0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "tidal"]
    assert warnings == [f"step 1: every group's rewards were equal (all 0.0): {NOTHING}. {FIX}"]
