"""Agent programs (`agent.command`): an unmodified program run once per sample through its own
session on the agent door. The same calls make the same samples as through `agent.fn`; the
program's environment, prompt, output and exit status; a failing, a hanging and a missing
program; an OpenAI Agents SDK program with a function tool; and training through the loop."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import loop_config
from test_agent import TOK, ScriptedEngine, ascii_model, chat_ids, ids

from tidal.config import build_config
from tidal.data.dataset import PromptRecord
from tidal.hooks import check_user_code
from tidal.options import ConfigError
from tidal.reward.options import RewardConfig
from tidal.rollout.manager import RolloutManager
from tidal.rollout.options import AgentConfig, RolloutConfig, SamplingConfig
from tidal.types import Status

PY = sys.executable
LABEL = "label-7f3a"  # a label no prompt, URL or token contains: the program must never see it

# the same two calls, as a program of its own (the sync `openai` client, configured by its
# environment alone) and as an `agent.fn`
TWO_CALLS = """
import os, openai
client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
messages = [{"role": "user", "content": os.environ["TIDAL_PROMPT"]}]
for _ in range(2):
    resp = client.chat.completions.create(model="policy", messages=messages, max_tokens=20)
    messages += [resp.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
print(resp.choices[0].message.content)
"""

TWO_CALLS_FN = """
async def agent(client, prompt, label):
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        resp = await client.chat.completions.create(model="policy", messages=messages, max_tokens=20)
        messages += [resp.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
"""

REWARDS = """
def printed_five(sample):
    # scores what the program printed, not the response
    return float(sample.metadata["agent_output"] == "The sum is 5.\\n")
"""


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def rollout(reply, agent: AgentConfig, n=1, prompts=("What is 2 + 3?",), reward="exact_match", label=LABEL, **cfg):
    chats = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    records = [
        PromptRecord(index=i, prompt=p, text=str(p), input_ids=chat_ids(chat), label=label)
        for i, (p, chat) in enumerate(zip(prompts, chats, strict=True))
    ]
    rollout_cfg = RolloutConfig(n_samples_per_prompt=n, generate="agent", **cfg)
    engine = ScriptedEngine(reply)
    groups = {"sampling": SamplingConfig(seed=11), "reward": RewardConfig(fn=reward), "agent": agent}
    return RolloutManager(engine, rollout_cfg, TOK, **groups).generate(records, step=0), engine


def failed_with(sample, message: str) -> bool:
    """Whether the sample failed with this error (the manager keeps the exception's repr)."""
    return sample.status == Status.FAILED and sample.metadata["error"] == f"generate: {RuntimeError(message)!r}"


def test_a_program_makes_the_samples_its_agent_fn_twin_makes(tmp_path):
    def reply(prompt, k):  # by the prompt, not the call's rank: the two samples' programs run at once
        return ids("The sum is 5." if "again" in TOK.decode(prompt) else "The sum is 4.") + [2]

    program = write(tmp_path, "two_calls.py", TWO_CALLS)
    twin = write(tmp_path, "two_calls_fn.py", TWO_CALLS_FN)
    rewards = write(tmp_path, "rewards.py", REWARDS)
    got, engine = rollout(reply, AgentConfig(command=f"{PY} {program}"), n=2, reward=f"{rewards}:printed_five")
    want, twin_engine = rollout(reply, AgentConfig(fn=f"{twin}:agent"), n=2)
    # the engine was asked the same ids with the same sampling (each call's seed), call for call
    asked = sorted((c[0], c[1].seed) for c in engine.calls)
    assert len(asked) == 4 and asked == sorted((c[0], c[1].seed) for c in twin_engine.calls)
    assert len(got) == len(want) == 2
    for s, w in zip(got, want, strict=True):
        assert (s.tokens, s.prompt_length, s.loss_mask) == (w.tokens, w.prompt_length, w.loss_mask)
        assert (s.rollout_log_probs, s.token_versions, s.status) == (w.rollout_log_probs, w.token_versions, w.status)
        assert s.metadata["agent_calls"] == w.metadata["agent_calls"]
        assert [c["case"] for c in s.metadata["agent_calls"]] == ["extend", "extend"]
        # what it printed and its exit status, for reward.fn, which scored the printed answer
        assert s.metadata["agent_output"] == "The sum is 5.\n" and s.metadata["agent_exit_code"] == 0
        assert s.reward == 1.0
    assert all("agent_output" not in w.metadata for w in want)


ENV_PROGRAM = """
import json, os, sys, openai
client = openai.OpenAI(max_retries=0)
client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
json.dump({"env": dict(os.environ), "argv": sys.argv[1:], "stdin": sys.stdin.read(), "cwd": os.getcwd()}, sys.stdout)
"""


@pytest.mark.parametrize("as_messages", [False, True], ids=["text", "messages"])
def test_the_program_gets_its_session_and_prompt_and_never_the_label(tmp_path, monkeypatch, as_messages):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-the-real-key")  # tidal's own: must not reach the program
    monkeypatch.setenv("TIDAL_TEST_SECRET", "x")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "env_program.py", ENV_PROGRAM)
    prompt = "What is 2 + 3?"
    agent = AgentConfig(command=f"{PY} env_program.py --task '{{prompt}}!' -v", env={"MY_SETTING": "on"})
    records_prompt = [{"role": "user", "content": prompt}] if as_messages else prompt
    samples, _ = rollout(lambda p, k: ids("ok") + [2], agent, prompts=(records_prompt,))
    seen = json.loads(samples[0].metadata["agent_output"])
    env, text = seen["env"], json.dumps(records_prompt) if as_messages else prompt
    url = env["OPENAI_BASE_URL"]
    assert url.startswith("http://127.0.0.1:") and "/s/" in url and url.endswith("/v1")
    token = env["OPENAI_API_KEY"]
    assert len(token) == 32 and url.split("/s/")[1] == f"{token}/v1"
    assert env["ANTHROPIC_BASE_URL"] == url.removesuffix("/v1") and env["ANTHROPIC_API_KEY"] == token
    assert env["TIDAL_PROMPT"] == text and seen["stdin"] == text
    assert seen["argv"] == ["--task", f"{text}!", "-v"]  # {prompt} replaced, the rest as written
    assert env["OPENAI_AGENTS_DISABLE_TRACING"] == "1" and env["MY_SETTING"] == "on"
    # `python` is the interpreter tidal runs on, then tidal's PATH
    assert env["PATH"] == os.pathsep.join(dict.fromkeys([os.path.dirname(PY), "/usr/bin", "/bin"]))
    assert env["HOME"] == seen["cwd"] == env["TMPDIR"]
    assert "TIDAL_TEST_SECRET" not in env
    assert LABEL not in json.dumps(seen)
    # its own working directory, removed after it
    assert Path(seen["cwd"]).name.startswith("tidal-sandbox-") and not Path(seen["cwd"]).exists()
    assert samples[0].status == Status.COMPLETED and samples[0].metadata["agent_exit_code"] == 0


def test_a_program_that_exits_1_fails_its_sample_with_its_stderr(tmp_path):
    program = write(
        tmp_path,
        "fails.py",
        """
        import sys, openai
        openai.OpenAI(max_retries=0).chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
        sys.exit("boom: the task was too hard")
        """,
    )
    samples, engine = rollout(lambda p, k: ids("ok") + [2], AgentConfig(command=f"{PY} {program}"), max_failed_ratio=1)
    assert len(engine.calls) == 1
    said = "stderr: boom: the task was too hard"
    assert failed_with(samples[0], f"agent.command: {PY} exit code 1, having made 1 call to the model; {said}")


def test_a_program_past_its_timeout_is_killed_with_its_children(tmp_path):
    pids = tmp_path / "pids"
    program = write(
        tmp_path,
        "hangs.py",
        f"""
        import os, subprocess, sys, time
        child = subprocess.Popen(["sleep", "600"], start_new_session=True)  # leaves the process group
        with open({str(pids)!r}, "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        print("working on it", file=sys.stderr, flush=True)
        time.sleep(600)
        """,
    )
    agent = AgentConfig(command=f"{PY} {program}", timeout=8)  # room for a slow machine to start it
    samples, engine = rollout(lambda p, k: [2], agent, max_failed_ratio=1)
    assert not engine.calls
    assert failed_with(
        samples[0], f"agent.command: {PY} timed out after 8 s, having made 0 calls to the model; stderr: working on it"
    )
    for pid in map(int, pids.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_program_stopped_by_the_spent_budget_keeps_what_it_sampled(tmp_path):
    # it calls until the door refuses (a 400 the openai client raises), then dies of it
    program = write(
        tmp_path,
        "greedy.py",
        """
        import openai
        client = openai.OpenAI(max_retries=0)
        messages = [{"role": "user", "content": "go"}]
        while True:
            resp = client.chat.completions.create(model="policy", messages=messages)
            messages += [resp.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        """,
    )
    agent = AgentConfig(command=f"{PY} {program}")
    samples, engine = rollout(lambda p, k: ids("abcdefgh"), agent, max_new_tokens=8, max_response_tokens=30)
    (s,) = samples
    assert s.status == Status.TRUNCATED and s.response_length <= 30 and s.metadata["agent_exit_code"] == 1
    assert sum(s.loss_mask) == sum(len(c[2].token_ids) for c in engine.calls)


def test_a_program_that_never_calls_the_model_fails_its_sample(tmp_path):
    program = write(tmp_path, "idle.py", "print('done')\n")
    samples, _ = rollout(lambda p, k: [2], AgentConfig(command=f"{PY} {program}"), max_failed_ratio=1)
    assert failed_with(samples[0], "agent.command made no call to the model: nothing to train on")


def agent_values(tmp_path, **agent) -> dict:
    values = {"rollout.generate": "agent", "reward.fn": "exact_match"}
    return {**values, **{f"agent.{k}": v for k, v in agent.items()}}


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (
            "no-such-agent-7f3a --task x",
            "agent.command: no program 'no-such-agent-7f3a' beside tidal's Python or on PATH",
        ),
        ("./not_executable.py", "agent.command: './not_executable.py' is not an executable file"),
        ("python 'open", 'agent.command: "python \'open" cannot be split into arguments: No closing quotation'),
    ],
)
def test_a_missing_program_is_refused_before_the_model_loads(tmp_path, monkeypatch, command, message):
    import tidal.loop

    monkeypatch.chdir(tmp_path)
    (tmp_path / "not_executable.py").write_text("print(1)\n")
    cfg = loop_config(tmp_path / "no-model-here", tmp_path / "run", **agent_values(tmp_path, command=command))
    with pytest.raises(ConfigError) as e:
        check_user_code(cfg)
    assert str(e.value) == f"invalid config:\n  {message}"
    with pytest.raises(ConfigError) as e:  # the model folder does not exist: the check came first
        tidal.loop.train(cfg)
    assert str(e.value) == f"invalid config:\n  {message}"
    assert not (tmp_path / "run").exists()


def test_the_agent_is_a_function_or_a_program_not_both_nor_neither(tmp_path):
    with pytest.raises(ConfigError) as e:
        build_config(None, agent_values(tmp_path))
    assert (
        "agent.fn: rollout.generate agent needs the agent: its dotted path (agent.fn) or a program's command line "
        "(agent.command)"
    ) in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_config(None, agent_values(tmp_path, fn="a.py:agent", command="python b.py"))
    assert "agent.command: the agent is agent.fn or agent.command, not both; unset one" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_config(None, agent_values(tmp_path, command="python b.py", timeout=0, env={"A": 1}))
    assert "agent.timeout: must be > 0 seconds, got 0" in str(e.value)
    assert "agent.env: must map variable names to strings, got {'A': 1}" in str(e.value)


# ---------------------------------------------------------------------------- the OpenAI Agents SDK
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agents_sdk"


def test_the_agents_sdk_example_calls_its_tool_through_the_door_and_is_scored():
    """examples/agents_sdk/agent.py as it is: the model's call runs the SDK's function tool, the
    result comes back in the next prompt, one sample grows over both calls, and the example's
    reward scores what the program printed."""
    pytest.importorskip("agents")
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "16 * 86"}}\n</tool_call>'
    answers = [ids(call) + [2], ids("1376") + [2]]
    agent = AgentConfig(command=f"{PY} {EXAMPLE / 'agent.py'}", timeout=120)
    samples, engine = rollout(
        lambda p, k: answers[k],
        agent,
        prompts=("What is 16 * 86?",),
        reward=f"{EXAMPLE / 'reward.py'}:reward",
        label="1376",
    )
    assert len(engine.calls) == 2
    assert "<tool_response>\n1376\n</tool_response>" in TOK.decode(engine.calls[1][0])  # the SDK ran the tool
    (s,) = samples
    assert s.status == Status.COMPLETED and s.metadata["agent_output"] == "1376\n"
    # the second call's prompt holds the first answer as sampled: one sample, grown
    assert [c["case"] for c in s.metadata["agent_calls"]] == ["new", "extend"]
    first_prompt = engine.calls[0][0]
    assert s.tokens[: len(first_prompt) + len(answers[0])] == first_prompt + answers[0]
    assert s.tokens[-len(answers[1]) :] == answers[1]
    assert sum(s.loss_mask) == len(answers[0]) + len(answers[1])
    assert s.reward == 1.0  # the last number printed is the label


@pytest.mark.parametrize(
    ("expression", "value"),
    [("16 * 86", 1376), ("(4 + 5) / 3", 3.0), ("-2 - 7", -9), ("2 ** 10", None), ("__import__('os')", None)],
)
def test_the_examples_calculator_evaluates_arithmetic_only(expression, value):
    import ast

    pytest.importorskip("agents")
    from tidal.utils import load_object

    evaluate = load_object(f"{EXAMPLE / 'agent.py'}:evaluate")
    tree = ast.parse(expression, mode="eval").body
    if value is None:
        with pytest.raises(ValueError, match=r"^only numbers, \+ - \* / and parentheses are allowed$"):
            evaluate(tree)
    else:
        assert evaluate(tree) == value


# ---------------------------------------------------------------------------- trains, token-exact
def by_index(sample) -> float:
    """A reward that differs within every group of two (the batch positions 2g and 2g + 1), so each
    step has advantages to train on whatever tokens the tiny model samples."""
    return float(sample.index % 2)


def test_a_program_trains_through_the_loop_token_exactly(tmp_path):
    import tidal.loop

    model_dir = tmp_path / "model"
    ascii_model().save_pretrained(model_dir)
    TOK.save_pretrained(model_dir)
    program = write(tmp_path, "two_calls.py", TWO_CALLS)
    cfg = loop_config(
        model_dir,
        tmp_path / "run",
        **{
            "train.num_steps": 2,
            "rollout.generate": "agent",
            "agent.command": f"{PY} {program}",
            "rollout.rollout_batch_size": 2,
            "rollout.n_samples_per_prompt": 2,
            "rollout.max_new_tokens": 6,
            "train.global_batch_size": 4,
            "reward.fn": f"{Path(__file__)}:by_index",
        },
    )
    history = tidal.loop.train(cfg)
    assert [h["step"] for h in history] == [1, 2]
    for h in history:  # every program ran and every sampled token's log-prob is the trainer's
        assert h["response/failed_ratio"] == 0.0 and h["actor/rollout_logprob_abs_diff"] < 1e-4
