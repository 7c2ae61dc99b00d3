"""Streaming through the agent door: a call with `stream: true` is sampled and recorded exactly as
one without (the same engine prompts and seeds, the same samples token for token), and the
answer the real `openai` and `anthropic` clients assemble from the stream is the one they get
whole. The engine is `test_agent`'s scripted one."""

from __future__ import annotations

import asyncio

import pytest
from test_agent import AGENTS, CALL, COMPACT, FIRST, TOK, ScriptedEngine, chat_ids, check_layout, ids, rollout

from tidal.data.dataset import PromptRecord
from tidal.reward.options import RewardConfig
from tidal.rollout.manager import RolloutManager
from tidal.rollout.options import AgentConfig, RolloutConfig, SamplingConfig
from tidal.types import Status
from tidal.utils import load_object

ANSWERS = [CALL, COMPACT, "The sum is 4."]  # a call, a call the template would re-serialise, no call
ANSWER_IDS = ["call", "compact_call", "no_call"]


def recorded_rollout(answers: list[list[int]], agent: str, **kw):
    """`rollout` of an agent that answers `answers[k]` on call k; (samples, engine, what the agent
    was answered, call by call)."""
    replies = load_object(f"{AGENTS}:replies")  # the module instance the rollout loads
    replies.clear()
    samples, engine = rollout(lambda p, k: answers[k], agent, **kw)
    return samples, engine, list(replies)


def without_ids(reply):
    """A reply with its tool-call ids dropped: fresh ones are made for every answer."""
    if isinstance(reply, dict):
        return {k: without_ids(v) for k, v in reply.items() if k != "id"}
    if isinstance(reply, list):
        return [without_ids(v) for v in reply]
    return reply


def assert_same_samples(streamed, whole, streamed_engine, whole_engine):
    """The same engine requests (prompt ids, seeds, limits) and the same samples, field by field."""
    assert [(c[0], c[1]) for c in streamed_engine.calls] == [(c[0], c[1]) for c in whole_engine.calls]
    assert len(streamed) == len(whole)
    for s, w in zip(streamed, whole, strict=True):
        assert (s.tokens, s.prompt_length, s.response_length) == (w.tokens, w.prompt_length, w.response_length)
        assert (s.loss_mask, s.rollout_log_probs, s.token_versions) == (
            w.loss_mask,
            w.rollout_log_probs,
            w.token_versions,
        )
        assert s.metadata["agent_calls"] == w.metadata["agent_calls"]
        assert (s.reward, s.status) == (w.reward, w.status)


@pytest.mark.parametrize("first", ANSWERS, ids=ANSWER_IDS)
def test_an_openai_agent_streaming_makes_the_samples_it_makes_whole(first):
    answers = [ids(first) + [2], ids("The sum is 5.") + [2]]
    whole, whole_engine, whole_replies = recorded_rollout(answers, "tool_agent")
    streamed, engine, replies = recorded_rollout(answers, "streaming_tool_agent")
    assert_same_samples(streamed, whole, engine, whole_engine)
    # the messages assembled from the deltas are the whole answers (text, tool names and arguments)
    assert without_ids(replies) == without_ids(whole_replies)
    assert replies[-1] == {"role": "assistant", "content": "The sum is 5."}
    if "tool_call" in first:
        assert replies[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    s = streamed[0]
    # the calls were sent back as streamed (their ids): the sample grew, nothing was re-serialised
    assert [c["case"] for c in s.metadata["agent_calls"]] == ["new", "extend"]
    p0, p1 = engine.calls[0][0], engine.calls[1][0]
    check_layout(s, [(answers[0], True), (p1[len(p0) + len(answers[0]) :], False), (answers[1], True)])
    assert (s.reward, s.status) == (1.0, Status.COMPLETED)


@pytest.mark.parametrize("first", ANSWERS, ids=ANSWER_IDS)
def test_an_anthropic_agent_streaming_makes_the_samples_it_makes_whole(first):
    pytest.importorskip("anthropic")
    answers = [ids(first) + [2], ids("The sum is 5.") + [2]]
    whole, whole_engine, whole_replies = recorded_rollout(answers, "anthropic_tool_agent")
    streamed, engine, replies = recorded_rollout(answers, "anthropic_streaming_tool_agent")
    assert_same_samples(streamed, whole, engine, whole_engine)
    # the text `text_stream` gave and the blocks `get_final_message` assembled are the whole answers
    assert without_ids(replies) == without_ids(whole_replies)
    assert replies[-1] == {"text": "The sum is 5.", "content": [{"type": "text", "text": "The sum is 5."}]}
    if "tool_call" in first:
        (use,) = replies[0]["content"]
        assert (use["type"], use["name"], use["input"], replies[0]["text"]) == ("tool_use", "add", {"a": 2, "b": 3}, "")
    else:
        assert replies[0]["text"] == "The sum is 4."
    assert [c["case"] for c in streamed[0].metadata["agent_calls"]] == ["new", "extend"]


def test_a_streamed_answer_carries_the_whole_answers_logprobs_finish_reason_and_usage():
    answers = [ids("Five, I think.")]  # no end token: the call ends on its token limit
    whole, whole_engine, (whole_reply,) = recorded_rollout(answers, "logprob_agent", max_new_tokens=len(answers[0]))
    streamed, engine, (reply,) = recorded_rollout(answers, "streaming_logprob_agent", max_new_tokens=len(answers[0]))
    assert_same_samples(streamed, whole, engine, whole_engine)
    assert reply == whole_reply
    prompt = chat_ids(FIRST)
    assert reply["content"] == "Five, I think." and reply["finish_reason"] == "length"
    # one entry per sampled token: the scripted engine's log-prob -0.01 x (k + 1) of the k-th
    assert [lp for _, lp in reply["logprobs"]] == [-0.01 * (k + 1) for k in range(len(answers[0]))]
    assert "".join(t for t, _ in reply["logprobs"]) == "Five, I think."
    n = len(answers[0])
    assert reply["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}


def test_a_client_that_goes_away_mid_stream_leaves_the_call_recorded():
    # the answer is sampled and recorded before its stream starts: hanging up after the first
    # chunk stops the sending only; asked again, the same prompt no longer extends that sample
    answers = [ids("Four.") + [2], ids("Five.") + [2]]
    samples, engine, replies = recorded_rollout(answers, "hanging_up_agent", agent_samples="all")
    p0 = chat_ids(FIRST)
    assert [c[0] for c in engine.calls] == [p0, p0]
    first, second = samples
    assert first.tokens == p0 + answers[0] and second.tokens == p0 + answers[1]
    assert [c["case"] for c in first.metadata["agent_calls"]] == ["extend"]
    assert [c["case"] for c in second.metadata["agent_calls"]] == ["new"]
    check_layout(first, [(answers[0], True)])
    assert first.status == second.status == Status.COMPLETED
    assert replies == ["Five."]


class StallingEngine(ScriptedEngine):
    """The scripted engine whose first request never finishes unless cancelled (which it records)."""

    def __init__(self, reply):
        super().__init__(reply)
        self.cancelled = 0

    async def generate(self, input_ids, sampling, *, request_id=None, group=None):
        if not self.calls and not self.cancelled:
            load_object(f"{AGENTS}:sampling").append(True)  # the agent gives up now
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return await super().generate(input_ids, sampling, request_id=request_id, group=group)


def test_a_client_that_goes_away_while_its_answer_is_sampled_aborts_it_and_the_sample_says_so():
    # the first call's client goes away while the engine samples: the door cancels the call (the
    # engine request with it), nothing of it joins the sample, and the retry extends the prompt
    replies = load_object(f"{AGENTS}:replies")
    replies.clear()
    load_object(f"{AGENTS}:sampling").clear()
    answer = ids("Five.") + [2]
    p0 = chat_ids(FIRST)
    records = [PromptRecord(index=0, prompt=FIRST[0]["content"], text="", input_ids=p0, label="5")]
    engine = StallingEngine(lambda p, k: answer)
    manager = RolloutManager(
        engine,
        RolloutConfig(n_samples_per_prompt=1, generate="agent"),
        TOK,
        sampling=SamplingConfig(seed=11),
        reward=RewardConfig(fn="exact_match"),
        agent=AgentConfig(fn=f"{AGENTS}:impatient_agent"),
    )
    (sample,) = manager.generate(records, step=0)
    assert engine.cancelled == 1 and replies == ["gave up", "Five."]
    assert [c[0] for c in engine.calls] == [p0]  # the one request that finished: the retry
    assert sample.tokens == p0 + answer
    check_layout(sample, [(answer, True)])
    gone = {"case": "extend", "at": len(p0), "sampled": 0, "finish_reason": "abort", "client_gone": True}
    assert sample.metadata["agent_calls"] == [
        gone,
        {"case": "extend", "at": len(p0), "sampled": len(answer), "finish_reason": "stop"},
    ]
    assert sample.metadata["agent_client_gone"] == 1
    assert sample.status == Status.COMPLETED
