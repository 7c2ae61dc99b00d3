"""examples/coding_agent through the agent door: the agent's run_python call runs in tidal's
sandbox, its output reaches the model's next prompt, and the hidden tests (`code_tests`) score
the program the agent answers with. The engine is scripted (a tiny random model writes no code)."""

from __future__ import annotations

from pathlib import Path

from test_agent import TOK, ScriptedEngine, chat_ids, ids

from tidal.data.dataset import PromptRecord
from tidal.reward.options import RewardConfig
from tidal.rollout.manager import RolloutManager
from tidal.rollout.options import AgentConfig, RolloutConfig
from tidal.types import Status

AGENT = Path(__file__).resolve().parents[2] / "examples" / "coding_agent" / "agent.py"
TASK = "Write a Python program that prints the value of 17 + 25."
CALL = '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(17 + 25)"}}\n</tool_call>'


def run(answers: list[str]):
    record = PromptRecord(
        index=0,
        prompt=TASK,
        text=TASK,
        input_ids=chat_ids([{"role": "user", "content": TASK}]),
        label=[{"input": "", "output": "42\n"}],
    )
    cfg = RolloutConfig(n_samples_per_prompt=1, generate="agent", max_new_tokens=400)
    groups = {"reward": RewardConfig(fn="code_tests"), "agent": AgentConfig(fn=f"{AGENT}:agent")}
    engine = ScriptedEngine(lambda prompt, k: ids(answers[k]) + [2])
    return RolloutManager(engine, cfg, TOK, **groups).generate([record], step=0), engine


def test_the_tool_runs_in_the_sandbox_and_the_hidden_tests_score_the_answer():
    samples, engine = run([CALL, "```python\nprint(17 + 25)\n```"])
    assert len(engine.calls) == 2
    second_prompt = TOK.decode(engine.calls[1][0])
    # the sandbox ran the model's program; its output is the tool message the model reads next
    assert second_prompt.count("42") == 1 and "print(17 + 25)" in second_prompt
    (s,) = samples
    assert [c["case"] for c in s.metadata["agent_calls"]] == ["new", "extend"]
    assert s.status == Status.COMPLETED
    assert s.reward == {"score": 1.0, "passed": 1, "total": 1, "error": ""}


def test_a_wrong_program_scores_zero_and_a_missing_one_fails_no_test():
    samples, _ = run(["```python\nprint(17 * 25)\n```"])
    assert samples[0].reward["score"] == 0.0 and samples[0].reward["passed"] == 0
    samples, _ = run(["The answer is 42."])  # no program: nothing to run, nothing passes
    assert samples[0].reward["score"] == 0.0
