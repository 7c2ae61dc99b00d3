"""OpenAI's Responses API through the agent door: an agent using `client.responses.create`, whole
or streamed, sending the items back or continuing by `previous_response_id`, makes the samples
the same conversation makes through chat completions (the same engine prompts, token ids,
log-probs, masks), and an unmodified OpenAI Agents SDK agent with a function tool trains on its
calls. The engine is `test_agent`'s scripted one."""

from __future__ import annotations

import pytest
import torch
from test_agent import AGENTS, CALL, FIRST, TOK, ascii_model, chat_ids, check_layout, ids
from test_agent_stream import ANSWER_IDS, ANSWERS, assert_same_samples, recorded_rollout

from tidal.adapters.async_engine import AsyncEngine
from tidal.data.dataset import PromptRecord
from tidal.engine.llm_engine import LLMEngine
from tidal.reward.options import RewardConfig
from tidal.rollout.manager import RolloutManager
from tidal.rollout.options import AgentConfig, RolloutConfig, SamplingConfig
from tidal.types import Status


@pytest.mark.parametrize("first", ANSWERS, ids=ANSWER_IDS)
@pytest.mark.parametrize(
    "agent", ["responses_tool_agent", "responses_streaming_tool_agent", "responses_chained_tool_agent"]
)
def test_a_responses_agent_makes_the_chat_agents_samples(first, agent):
    answers = [ids(first) + [2], ids("The sum is 5.") + [2]]
    chat, chat_engine, _ = recorded_rollout(answers, "tool_agent")
    samples, engine, replies = recorded_rollout(answers, agent)
    # one renderer, answers sent back (or kept by previous_response_id) rendered as sampled
    assert_same_samples(samples, chat, engine, chat_engine)
    (s,) = samples
    assert [c["case"] for c in s.metadata["agent_calls"]] == ["new", "extend"]
    p0, p1 = engine.calls[0][0], engine.calls[1][0]
    check_layout(s, [(answers[0], True), (p1[len(p0) + len(answers[0]) :], False), (answers[1], True)])
    assert (s.reward, s.status) == (1.0, Status.COMPLETED)
    # the agent got the model's call as a function_call item, and its last answer as text
    if "tool_call" in first:
        assert replies[0] == [
            {"type": "function_call", "name": "add", "arguments": '{"a": 2, "b": 3}', "status": "completed"}
        ]
    else:
        assert [o["content"][0]["text"] for o in replies[0]] == ["The sum is 4."]
    (last,) = replies[-1]
    assert (last["type"], last["role"], last["content"][0]["text"]) == ("message", "assistant", "The sum is 5.")


def test_a_streamed_response_carries_the_whole_responses_logprobs_status_and_usage():
    answers = [ids("Five, I think.")]  # no end token: the call ends on its token limit
    n = len(answers[0])
    whole, whole_engine, (whole_reply,) = recorded_rollout(answers, "responses_logprob_agent", max_new_tokens=n)
    streamed, engine, (reply,) = recorded_rollout(answers, "responses_streaming_logprob_agent", max_new_tokens=n)
    assert_same_samples(streamed, whole, engine, whole_engine)
    assert reply == whole_reply
    chat, chat_engine, _ = recorded_rollout(answers, "logprob_agent", max_new_tokens=n)
    assert_same_samples(whole, chat, whole_engine, chat_engine)
    prompt = chat_ids(FIRST)
    assert reply["text"] == "Five, I think." and reply["status"] == "incomplete"
    assert reply["incomplete"] == {"reason": "max_output_tokens"}
    assert [lp for _, lp in reply["logprobs"]] == [-0.01 * (k + 1) for k in range(n)]
    assert "".join(t for t, _ in reply["logprobs"]) == "Five, I think."
    assert reply["usage"] == {
        "input_tokens": len(prompt),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": n,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(prompt) + n,
    }


@pytest.mark.parametrize("agent", ["agents_sdk_agent", "agents_sdk_streaming_agent"])
def test_an_openai_agents_sdk_agent_with_a_function_tool_trains_on_its_calls(agent):
    pytest.importorskip("agents")
    answers = [ids(CALL) + [2], ids("The sum is 5.") + [2]]
    samples, engine, replies = recorded_rollout(answers, agent)
    assert replies == ["The sum is 5."]  # the SDK ran the tool and gave the model's last answer
    (s,) = samples
    # the SDK sent its history back as items: the call as sampled, the tool's output after it
    assert [c["case"] for c in s.metadata["agent_calls"]] == ["new", "extend"]
    p0, p1 = engine.calls[0][0], engine.calls[1][0]
    assert p1[: len(p0) + len(answers[0])] == p0 + answers[0]
    env = p1[len(p0) + len(answers[0]) :]
    assert "<tool_response>\n5\n</tool_response>" in chat_ids_text(env)
    check_layout(s, [(answers[0], True), (env, False), (answers[1], True)])
    assert s.tokens == p1 + answers[1] and (s.reward, s.status) == (1.0, Status.COMPLETED)
    # the tool reached the model as the SDK declared it (strict schema, its docstring)
    system = chat_ids_text(p0)
    assert '"name": "add"' in system and "Add two integers." in system


def chat_ids_text(tokens: list[int]) -> str:
    return TOK.decode(tokens)


def test_responses_calls_through_the_real_engine_are_token_exact():
    # tidal's engine on a tiny model writing lowercase ASCII: the recorded log-probs are the
    # model's own (a fresh forward pass over the sample), the mask covers what it sampled. (The
    # Agents SDK is not run here: the model never stops, and the SDK raises on a response cut by
    # its token limit, `status: "incomplete"`, as it does with OpenAI's.)
    agent, turns = "responses_short_agent", 2
    model = ascii_model()
    engine = AsyncEngine(LLMEngine(model, TOK, dtype="float32", block_size=4, kv_cache_tokens=8192))
    prompt = "what is two plus three"
    record = PromptRecord(
        index=0, prompt=prompt, text=prompt, input_ids=chat_ids([{"role": "user", "content": prompt}]), label="5"
    )
    cfg = RolloutConfig(n_samples_per_prompt=2, generate="agent", max_new_tokens=8, max_response_tokens=300)
    groups = {
        "sampling": SamplingConfig(seed=5),
        "reward": RewardConfig(fn="exact_match"),
        "agent": AgentConfig(fn=f"{AGENTS}:{agent}"),
    }
    manager = RolloutManager(engine, cfg, TOK, **groups)
    try:
        samples = manager.generate([record], step=0)
    finally:
        manager.close()
        engine.close()
    assert len(samples) == 2
    for s in samples:
        assert [c["case"] for c in s.metadata["agent_calls"]][1:] == ["extend"] * (turns - 1)
        assert sum(s.loss_mask) == 8 * turns  # every call sampled its 8 tokens, all trained on
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens])).logits[0].float()
        fresh = torch.log_softmax(logits, -1)[torch.arange(s.prompt_length - 1, len(s.tokens) - 1), s.response_tokens]
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        recorded = torch.tensor(s.rollout_log_probs)[mask]
        assert torch.allclose(fresh[mask], recorded, atol=1e-4), (fresh[mask] - recorded).abs().max()
        assert recorded.min() < -1.0  # a real distribution, not a forced token
