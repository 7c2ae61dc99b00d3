"""Evaluation: the pass@k estimator, eval-set config, the loop's eval rows and `tidal eval`."""

import json
import math

import pytest
from conftest import loop_config

import tidal.loop
from tidal.config import Config, build_config
from tidal.eval import pass_at_k, results_table
from tidal.options import ConfigError

VOLATILE = ("time/", "perf/")


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 2 / 5),  # 1 - C(3,1)/C(5,1) = 1 - 3/5
        (5, 2, 2, 7 / 10),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 9 / 10),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 4, 1.0),  # n - c = 3 < 4: every 4-subset holds a correct sample
        (5, 0, 1, 0.0),
        (5, 0, 5, 0.0),
        (5, 5, 1, 1.0),
        (4, 1, 2, 1 / 2),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (10, 3, 5, 1 - 21 / 252),  # C(7,5) = 21, C(10,5) = 252
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_is_exact_for_large_n_and_rejects_bad_arguments():
    # 1 - C(n-c, k)/C(n, k) = 1 - prod_{i<k} (n-c-i)/(n-i); with c = 1: 1 - (n-k)/n = k/n
    assert pass_at_k(2000, 1, 100) == pytest.approx(100 / 2000, rel=1e-12)
    assert pass_at_k(2000, 1, 1) == 1 / 2000
    for n, c, k, msg in [
        (5, 6, 1, "need 0 <= c <= n, got n=5, c=6"),
        (5, -1, 1, "need 0 <= c <= n, got n=5, c=-1"),
        (5, 2, 6, "need 1 <= k <= n, got n=5, k=6"),
        (5, 2, 0, "need 1 <= k <= n, got n=5, k=0"),
    ]:
        with pytest.raises(ValueError, match=msg):
            pass_at_k(n, c, k)
    # pass@1 is the share of correct samples
    assert math.isclose(pass_at_k(8, 3, 1), 3 / 8)


def test_eval_sets_take_their_sampling_from_the_rollout_group(tmp_path):
    f = tmp_path / "held_out.jsonl"
    f.write_text('{"question": "1+1", "label": "2"}\n')
    cfg = build_config(
        None,
        {
            "rollout.n_samples_per_prompt": 4,
            "sampling.temperature": 0.7,
            "eval.interval": 5,
            "eval.datasets": [
                {"path": str(f), "n": 8, "max_new_tokens": 32, "input_key": "question"},
                {"path": "env:arithmetic", "name": "arith", "temperature": 0, "env_args": {"level": 2, "n": 10}},
            ],
        },
    )
    a, b = cfg.eval.sets(cfg.data, cfg.rollout, cfg.sampling)
    assert (a.name, a.n, a.temperature, a.max_new_tokens, a.data.input_key) == ("held_out", 8, 0.7, 32, "question")
    assert a.data.path == str(f) and a.data.env_args == {}
    assert (b.name, b.n, b.temperature, b.max_new_tokens) == ("arith", 4, 0.0, 64)
    assert b.data.env_args == {"level": 2, "n": 10} and b.data.input_key == "prompt"
    cfg.data.env_args = {"level": 3}
    cfg.eval.datasets = ["env:arithmetic", {"path": "env:arithmetic", "name": "other", "env_args": {"n": 3}}]
    same, other = cfg.eval.sets(cfg.data, cfg.rollout, cfg.sampling)
    assert same.data.env_args == {"level": 3} and other.data.env_args == {"n": 3}


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"eval.datasets": [{"path": "env:arithmetic", "temprature": 0}]},
            "unknown key 'temprature'; did you mean 'temperature'?",
        ),
        ({"eval.datasets": [{"path": "nope.jsonl"}]}, "eval.datasets[0].path: file 'nope.jsonl' does not exist"),
        ({"eval.datasets": [{"path": "env:arithmetic", "n": "four"}]}, "eval.datasets[0].n: expected int, got 'four'"),
        ({"eval.datasets": ["env:arithmetic", "env:arithmetic"]}, "eval.datasets[1].name: 'arithmetic' is used twice"),
        ({"eval.datasets": [{"name": "x"}]}, "eval.datasets[0]: expected {path: FILE or env:NAME, ...}"),
        ({"eval.interval": 3}, "eval.interval: needs eval.datasets"),
        ({"eval.pass_k": [0, 2]}, "eval.pass_k: a non-empty list of integers >= 1, got [0, 2]"),
        ({"data.streaming": True}, "data.streaming: reads .jsonl or .parquet files, got data.path 'env:arithmetic'"),
    ],
)
def test_bad_eval_config_is_named(over, message):
    with pytest.raises(ConfigError) as err:
        build_config(None, over)
    assert message in str(err.value)


class FakeRollout:
    """Stands in for RolloutManager: preset rewards/statuses, records the seeds' step and indices."""

    def __init__(self, n, rewards, statuses=None):
        from types import SimpleNamespace

        self.rollout = SimpleNamespace(n_samples_per_prompt=n)
        self.rewards, self.statuses, self.calls = rewards, statuses or {}, []

    def generate(self, records, step, first_index=0):
        from tidal.types import Sample, Status

        self.calls.append((len(records), step, first_index))
        out = []
        for i in range(first_index, first_index + len(records) * self.rollout.n_samples_per_prompt):
            g = (i - first_index) // self.rollout.n_samples_per_prompt
            s = Sample(tokens=[1, 2, 3], response_length=i % 3 + 1, index=i, group_index=g)
            s.reward, s.status = self.rewards[i], self.statuses.get(i, Status.COMPLETED)
            out.append(s)
        return out


def test_evaluate_set_groups_samples_by_prompt_and_counts_correct_at_the_threshold(monkeypatch):
    import tidal.eval
    from tidal.eval import evaluate_set, set_seed_step
    from tidal.types import Status

    monkeypatch.setattr(tidal.eval, "PROMPTS_PER_CALL", 2)  # chunks must not change seeds or results
    # 3 prompts x 4 samples; correct = reward >= 0.9; sample 5 failed (its reward does not count)
    rewards = [1.0, 0.0, 0.0, 0.0, 0.5, 1.0, 0.95, 0.0, 1.0, 1.0, 1.0, 1.0]
    fake = FakeRollout(4, rewards, {5: Status.FAILED})
    m = evaluate_set(fake, [object()] * 3, "held_out", [2, 4, 5], threshold=0.9, reward_key="score")
    assert fake.calls == [(2, set_seed_step("held_out"), 0), (1, set_seed_step("held_out"), 8)]
    # correct per prompt: 1 of 4, 1 of 4 (0.95 counts, the failed 1.0 does not), 4 of 4
    assert m["pass@1"] == pytest.approx((1 / 4 + 1 / 4 + 1) / 3)
    assert m["pass@2"] == pytest.approx((1 / 2 + 1 / 2 + 1) / 3)  # 1 - C(3,2)/C(4,2) = 1/2
    assert m["pass@4"] == 1.0 and "pass@5" not in m
    assert m["mean_reward"] == pytest.approx(sum(rewards) / 12)  # the failed sample keeps the reward set
    assert m["response_length"] == pytest.approx(sum(i % 3 + 1 for i in range(12)) / 12)
    assert (m["prompts"], m["samples"], m["failed_ratio"], m["truncated_ratio"]) == (3, 12, 1 / 12, 0)


class RaggedRollout(FakeRollout):
    """Prompt p of the set fans out into sizes[p] samples (a generate function's fan-out); a
    sample's reward is rewards[p * 10 + its position in the call]."""

    def __init__(self, sizes, rewards):
        super().__init__(1, rewards)
        self.sizes, self.done = sizes, 0

    def generate(self, records, step, first_index=0):
        from tidal.types import Sample

        out = []
        for g in range(len(records)):
            for _ in range(self.sizes[self.done]):
                s = Sample(tokens=[1, 2], response_length=1, index=len(out), group_index=g)
                s.reward = self.rewards[self.done * 10 + len(out)]
                out.append(s)
            self.done += 1
        return out


def test_evaluate_set_scores_ragged_groups_per_prompt(monkeypatch):
    import tidal.eval
    from tidal.eval import evaluate_set

    monkeypatch.setattr(tidal.eval, "PROMPTS_PER_CALL", 2)
    # prompt 0: [1.0]; prompt 1: [0, 1, 1]; prompt 2 (a second call): [0, 0]
    rewards = {0: 1.0, 11: 0.0, 12: 1.0, 13: 1.0, 20: 0.0, 21: 0.0}
    m = evaluate_set(RaggedRollout([1, 3, 2], rewards), [object()] * 3, "ragged", [2], 0.9, "score")
    assert m["pass@1"] == pytest.approx((1 + 2 / 3 + 0) / 3)  # each prompt over its own n
    assert "pass@2" not in m  # prompt 0 has a single sample
    assert (m["prompts"], m["samples"]) == (3, 6)


def test_results_table_has_a_row_per_set():
    table = results_table(
        {"arithmetic": {"prompts": 6, "mean_reward": 0.5, "pass@1": 0.5}, "gsm": {"prompts": 2, "mean_reward": 1.0}}
    )
    assert table.splitlines() == [
        "dataset     prompts  mean_reward  pass@1",
        "arithmetic        6       0.5000  0.5000",
        "gsm               2       1.0000       -",
    ]


def test_default_config_has_eval_off():
    assert Config().eval.interval == 0


def _stable(history):
    return [
        {k: v for k, v in row.items() if not k.startswith(VOLATILE) and not k.startswith("eval/")} for row in history
    ]


EVAL = {
    "eval.interval": 2,
    "eval.pass_k": [1, 2, 8],
    "eval.datasets": [
        {"path": "env:arithmetic", "name": "arith", "n": 4, "env_args": {"n": 5, "seed": 7}},
        {"path": "env:arithmetic", "name": "greedy", "n": 1, "temperature": 0, "env_args": {"n": 3, "seed": 8}},
    ],
}


def test_eval_in_the_loop_logs_eval_rows_and_leaves_training_unchanged(tiny_model_dir, tmp_path):
    plain = tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "plain"))
    evald = tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "eval", **EVAL))
    assert [h["step"] for h in evald] == [0, 1, 2, 3, 4]
    assert set(evald[0]) == {"step", "time/eval"} | {
        f"eval/{s}/{m}"
        for s in ("arith", "greedy")
        for m in ("mean_reward", "response_length", "truncated_ratio", "failed_ratio", "pass@1", "weight_version")
    } | {"eval/arith/pass@2"}  # k = 8 > n = 4 is skipped
    assert [sorted(k for k in h if k.startswith("eval/arith/mean")) for h in evald] == [
        ["eval/arith/mean_reward"],
        [],
        ["eval/arith/mean_reward"],
        [],
        ["eval/arith/mean_reward"],
    ]
    # each eval ran on the weights the steps before it produced
    assert [evald[i]["eval/greedy/weight_version"] for i in (0, 2, 4)] == [0, 2, 4]
    for h in (evald[0], evald[2], evald[4]):
        # 5 prompts x 4 samples, token_parity_reward is 0 or 1: pass@1 equals the mean reward
        assert h["eval/arith/mean_reward"] in {i / 20 for i in range(21)}
        assert h["eval/arith/pass@1"] == pytest.approx(h["eval/arith/mean_reward"])
        assert h["eval/arith/pass@2"] >= h["eval/arith/pass@1"]
        assert 1 <= h["eval/arith/response_length"] <= 8
    # the same training with and without eval: eval read no training data and drew no training RNG
    assert _stable(evald[1:]) == _stable(plain)
    assert all(h["actor/grad_norm"] > 0 for h in plain)
    # step 0 is on the initial weights, and the eval sees the weights change (same seeds each time)
    assert len({h["eval/arith/pass@2"] for h in (evald[0], evald[2], evald[4])}) > 1


def test_standalone_eval_prints_a_table_and_reproduces_the_loops_eval(tiny_model_dir, tmp_path, capsys):
    from tidal.cli import main

    run = tmp_path / "run"
    history = tidal.loop.train(
        loop_config(tiny_model_dir, run, **{**EVAL, "train.num_steps": 2, "train.save_interval": 2})
    )
    capsys.readouterr()
    out = tmp_path / "eval.json"
    args = [
        "eval",
        str(run / "checkpoints" / "step_2"),
        "--dataset",
        "env:arithmetic",
        "--eval.datasets=" + json.dumps(EVAL["eval.datasets"]),
        "--k",
        "1,2",
        "--out",
        str(out),
        "--reward.fn=conftest:token_parity_reward",
        "--rollout.max_new_tokens=8",
        "--engine.dtype=float32",
    ]
    # --dataset replaces the config's sets
    args_config = [a for a in args if a not in ("--dataset", "env:arithmetic")]
    assert main(args_config) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == [
        "dataset",
        "prompts",
        "samples",
        "mean_reward",
        "pass@1",
        "pass@2",
        "response_length",
        "truncated_ratio",
        "failed_ratio",
    ]
    assert [row.split()[:3] for row in table[1:]] == [["arith", "5", "20"], ["greedy", "3", "3"]]
    result = json.loads(out.read_text())["datasets"]
    # the loop's eval at step 2 used the same seeds on the same weights
    for name in ("arith", "greedy"):
        for metric in ("mean_reward", "pass@1", "response_length"):
            assert result[name][metric] == pytest.approx(history[-1][f"eval/{name}/{metric}"], abs=1e-12)

    assert main(args + ["--num-prompts", "2", "--n", "3", "--temperature", "0.5"]) == 0
    result = json.loads(out.read_text())["datasets"]
    assert list(result) == ["arithmetic"]
    assert (result["arithmetic"]["prompts"], result["arithmetic"]["samples"]) == (2, 6)


def test_eval_holds_an_overlapped_rollout_and_records_the_weights_it_saw(tiny_model_dir, tmp_path):
    over = {"train.num_steps": 3, "overlap.mode": "full", "overlap.max_staleness": 0}
    plain = tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "plain", **over))
    evald = tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "eval", **over, **{**EVAL, "eval.interval": 1}))
    assert [h["step"] for h in evald] == [0, 1, 2, 3]
    # engine/: what the worker's rollout had done by each step's read of the counters varies
    timed = [
        [{k: v for k, v in row.items() if not k.startswith("engine/")} for row in _stable(h)]
        for h in (evald[1:], plain)
    ]
    assert timed[0] == timed[1]
    # max_staleness 0: the worker has loaded each step's weights before eval holds it
    assert [h["eval/arith/weight_version"] for h in evald] == [0, 1, 2, 3]
