"""The agent door: the rule turning a session's calls into samples (extend, realign, new sample)
on exact token lists, an `openai` agent with tool calls through a scripted engine (and an
`anthropic` one making the same samples), the door's
sessions, budget and shutdown, and an agent that trains a tiny model token-exactly."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import door_agents
import httpx
import pytest
import torch
from conftest import loop_config, make_model, make_tokenizer

from tidal.contracts import GenerationOutput
from tidal.data.dataset import PromptRecord
from tidal.reward.options import RewardConfig
from tidal.rollout.agent import Alignment, align
from tidal.rollout.generate import GenerateContext, turn_seed
from tidal.rollout.manager import RolloutManager, group_sizes, sample_seed
from tidal.rollout.options import AgentConfig, RolloutConfig, SamplingConfig
from tidal.types import Status
from tidal.utils import load_object

AGENTS = Path(door_agents.__file__)
TOK = make_tokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def chat_ids(messages, tools=None) -> list[int]:
    from tidal.chat.tools import render_messages

    rendered, _ = render_messages(messages, tools, None, native=False)
    return ids(TOK.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False))


# ---------------------------------------------------------------------------- the rule, pure
VOCAB = {1: "a", 2: "b", 3: "ab", 5: "x", 7: "y", 8: "c"}


def decode(tokens):
    return "".join(VOCAB[t] for t in tokens)


def test_extend_appends_the_new_part():
    assert align([5, 1, 2], [5, 1, 2, 7, 8], decode, 4) == Alignment("extend", 3, [7, 8])
    assert align([5, 1, 2], [5, 1, 2], decode, 4) == Alignment("extend", 3, [])


def test_realign_keeps_the_sampled_tokens_of_the_same_text():
    # "ab" sampled as [1, 2], re-encoded as [3]: the engine gets [5, 1, 2] + [7]
    assert align([5, 1, 2], [5, 3, 7], decode, 4) == Alignment("realign", 3, [7])
    # and the other way round: one sampled token, two in the new prompt
    assert align([5, 3], [5, 1, 2, 7, 8], decode, 4) == Alignment("realign", 2, [7, 8])


def test_a_longer_drift_or_other_text_starts_a_new_sample():
    assert align([5, 1, 2], [5, 3, 7], decode, 1) == Alignment("new", 0, [5, 3, 7])  # 2 tokens drift > 1
    assert align([5, 1, 2], [5, 1, 8, 7], decode, 4) == Alignment("new", 0, [5, 1, 8, 7])  # "ab" vs "ac"
    assert align([5, 1, 2], [7, 1, 2], decode, 4) == Alignment("new", 0, [7, 1, 2])


# ---------------------------------------------------------------------------- scripted engine
class ScriptedEngine:
    """Answers each prompt with `reply(prompt_ids, call)` (token ids) and log-prob -0.01 x (k + 1)
    for the k-th token; records every request."""

    weight_version = 3
    max_model_len = 4096

    def __init__(self, reply):
        self.reply = reply
        self.calls: list[tuple[list[int], object, GenerationOutput]] = []

    async def generate(self, input_ids, sampling, *, request_id=None, group=None):
        toks = list(self.reply(list(input_ids), len(self.calls)))[: sampling.max_new_tokens]
        reason = "stop" if toks and toks[-1] == 2 else "length"
        lps = [-0.01 * (k + 1) for k in range(len(toks))]
        out = GenerationOutput(toks, lps, reason, TOK.decode(toks, skip_special_tokens=True), self.weight_version)
        self.calls.append((list(input_ids), sampling, out))
        return out


def rollout(reply, agent: str, n=1, prompts=("What is 2 + 3?",), agent_samples="last", **cfg):
    records = [
        PromptRecord(index=i, prompt=p, text=p, input_ids=chat_ids([{"role": "user", "content": p}]), label="5")
        for i, p in enumerate(prompts)
    ]
    c = RolloutConfig(n_samples_per_prompt=n, generate="agent", **cfg)
    groups = {
        "sampling": SamplingConfig(seed=11),
        "reward": RewardConfig(fn="exact_match"),
        "agent": AgentConfig(fn=f"{AGENTS}:{agent}", samples=agent_samples),
    }
    engine = ScriptedEngine(reply)
    return RolloutManager(engine, c, TOK, **groups).generate(records, step=0), engine


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
FIRST = [{"role": "user", "content": "What is 2 + 3?"}]


def tool_history(call_text: str) -> list[dict]:
    """The history the agent sends on its second call: its question, the call, the tool's answer."""
    args = json.loads(call_text.split("\n")[1])
    call = {"id": "x", "type": "function", "function": {"name": "add", "arguments": json.dumps(args["arguments"])}}
    return [*FIRST, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "x", "content": "5"}]


def check_layout(sample, parts):
    """`parts`: (ids, sampled?) in order after the prompt; tokens, mask, log-probs, versions follow."""
    resp = [t for p, _ in parts for t in p]
    assert sample.response_tokens == resp
    mask, lps, versions = [], [], []
    for p, sampled in parts:
        mask += [int(sampled)] * len(p)
        lps += [-0.01 * (k + 1) for k in range(len(p))] if sampled else [0.0] * len(p)
        versions += [3 if sampled else -1] * len(p)
    assert sample.loss_mask == mask
    assert sample.rollout_log_probs == pytest.approx(lps, abs=0)
    assert sample.token_versions == versions


def test_tool_calls_over_two_turns_extend_one_sample():
    answer1, answer2 = ids(CALL) + [2], ids("The sum is 5.") + [2]
    samples, engine = rollout(lambda p, k: answer1 if k == 0 else answer2, "tool_agent")
    assert len(samples) == 1 and len(engine.calls) == 2
    s = samples[0]
    p0 = chat_ids(FIRST, door_agents.TOOLS)
    p1 = chat_ids(tool_history(CALL), door_agents.TOOLS)
    assert engine.calls[0][0] == p0 and engine.calls[1][0] == p1  # the door's prompts, rendered as the server does
    assert p1[: len(p0) + len(answer1)] == p0 + answer1  # the template re-rendered the call token for token
    assert s.tokens == p1 + answer2
    # the dataset prompt has no tools in its system message: the first call started a new sample
    assert [c["case"] for c in s.metadata["agent_calls"]] == ["new", "extend"]
    check_layout(s, [(answer1, True), (p1[len(p0) + len(answer1) :], False), (answer2, True)])
    assert s.reward == 1.0 and s.status == Status.COMPLETED  # the agent's reward: "5" in the last answer
    # the rollout's sampling, not the request's temperature 0; call k's seed is turn_seed(sample seed, k)
    seeds = [sp.seed for _, sp, _ in engine.calls]
    assert seeds == [sample_seed(11, 0, 0), turn_seed(sample_seed(11, 0, 0), 1)] and all(
        sp.temperature == 1.0 for _, sp, _ in engine.calls
    )


def test_a_special_token_sampled_as_text_is_realigned():
    # the model spells "<|im_end|>" byte by byte; the re-rendered history encodes it as the special id 2
    answer1 = ids("hi") + [ids(ch)[0] for ch in "<|im_end|>"]
    assert len(answer1) == 12 and 2 not in answer1
    answer2 = ids("5") + [2]
    samples, engine = rollout(lambda p, k: answer1 if k == 0 else answer2, "scorer_agent")
    s = samples[0]
    assert [c["case"] for c in s.metadata["agent_calls"]] == ["extend", "realign"]
    p0 = chat_ids(FIRST)
    history = [*FIRST, {"role": "assistant", "content": "hi<|im_end|>"}, {"role": "user", "content": "again"}]
    p1 = chat_ids(history)
    common = len(p0) + 2  # "hi"
    assert p1[common] == 2 and p1[:common] == p0 + ids("hi")
    env = p1[common + 1 :]  # after the re-encoded "<|im_end|>": what the agent added
    assert engine.calls[1][0] == p0 + answer1 + env  # the model saw what it sampled
    assert s.tokens == p0 + answer1 + env + answer2
    check_layout(s, [(answer1, True), (env, False), (answer2, True)])
    assert s.reward == 0.0  # scored by reward.fn (exact_match: the response is not "5"): the agent gave None


COMPACT = '<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>'


def test_an_answer_sent_back_unchanged_is_rendered_as_sampled():
    # compact JSON: re-serialised, the call would read '{"name": "add", ...}'; sent back as the door
    # returned it, it is rendered as the model wrote it and the sample grows
    answer1, answer2 = ids(COMPACT) + [2], ids("5") + [2]
    samples, engine = rollout(lambda p, k: answer1 if k == 0 else answer2, "tool_agent")
    (p0, _, _), (p1, _, _) = engine.calls
    s = samples[0]
    assert [c["case"] for c in s.metadata["agent_calls"]] == ["new", "extend"]
    assert p1[: len(p0) + len(answer1)] == p0 + answer1 and TOK.decode(p1).count(COMPACT) == 1
    check_layout(s, [(answer1, True), (p1[len(p0) + len(answer1) :], False), (answer2, True)])


@pytest.mark.parametrize("mode", ["all", "last", "first"])
def test_a_rewritten_call_starts_a_new_sample(mode):
    # the agent rebuilds the call with its own JSON: a text the model did not write
    answer1, answer2 = ids(COMPACT) + [2], ids("5") + [2]
    samples, engine = rollout(lambda p, k: answer1 if k == 0 else answer2, "rebuilding_agent", agent_samples=mode)
    p0, p1 = engine.calls[0][0], engine.calls[1][0]
    assert p1 == chat_ids(tool_history(CALL), door_agents.TOOLS)  # what the agent sent, not realigned
    first = (p0, answer1, ["new"])
    second = (p1, answer2, ["new"])
    want = {"all": [first, second], "last": [second], "first": [first]}[mode]
    assert len(samples) == len(want)
    for s, (prompt, answer, cases) in zip(samples, want, strict=True):
        assert s.tokens == prompt + answer and s.prompt_length == len(prompt)
        check_layout(s, [(answer, True)])
        assert [c["case"] for c in s.metadata["agent_calls"]] == cases
        assert s.reward == 1.0 and s.group_index == 0


@pytest.mark.parametrize(
    "first",
    [CALL, COMPACT, "The sum is 4."],  # a call, a call the template would re-serialise, no call
    ids=["call", "compact_call", "no_call"],
)
def test_an_anthropic_agent_makes_the_openai_agents_samples(first):
    pytest.importorskip("anthropic")
    answers = [ids(first) + [2], ids("The sum is 5.") + [2]]
    openai_samples, openai_engine = rollout(lambda p, k: answers[k], "tool_agent")
    samples, engine = rollout(lambda p, k: answers[k], "anthropic_tool_agent")
    # the engine was given the same ids, call for call: one renderer, answers sent back as sampled
    assert [c[0] for c in engine.calls] == [c[0] for c in openai_engine.calls]
    assert len(samples) == len(openai_samples) == 1
    s, o = samples[0], openai_samples[0]
    assert [c["case"] for c in s.metadata["agent_calls"]] == [c["case"] for c in o.metadata["agent_calls"]]
    assert [c["case"] for c in s.metadata["agent_calls"]] == ["new", "extend"]
    assert (s.tokens, s.prompt_length, s.loss_mask) == (o.tokens, o.prompt_length, o.loss_mask)
    assert (s.rollout_log_probs, s.token_versions) == (o.rollout_log_probs, o.token_versions)
    assert (s.reward, s.status) == (o.reward, o.status) == (1.0, Status.COMPLETED)
    p0 = engine.calls[0][0]
    check_layout(s, [(answers[0], True), (engine.calls[1][0][len(p0) + len(answers[0]) :], False), (answers[1], True)])


def test_ragged_fan_out_in_all_mode_gives_ragged_groups():
    def reply(prompt, k):  # prompt 0's call is re-rendered (2 samples), prompt 1's is not (1 sample)
        if TOK.decode(prompt).count("<tool_response>") == 0:
            return ids(COMPACT if "2 + 3" in TOK.decode(prompt) else CALL) + [2]
        return ids("5") + [2]

    samples, _ = rollout(reply, "rebuilding_agent", prompts=("What is 2 + 3?", "What is 1 + 4?"), agent_samples="all")
    # each prompt's group holds however many samples its trajectory made; index is the batch position
    assert group_sizes(samples) == [2, 1]
    assert [(s.group_index, s.index) for s in samples] == [(0, 0), (0, 1), (1, 2)]


def test_the_budget_caps_the_trajectory_and_ends_it_truncated():
    samples, engine = rollout(lambda p, k: ids("abcdefgh"), "greedy_agent", max_new_tokens=8, max_response_tokens=30)
    s = samples[0]
    assert s.response_length <= 30 and s.status == Status.TRUNCATED
    assert sum(s.loss_mask) == sum(len(c[2].token_ids) for c in engine.calls)
    # each call asked for at most what was left of the 30 tokens
    used = 0
    for prompt, sp, out in engine.calls:
        if used:
            used = len(prompt) - s.prompt_length
        assert sp.max_new_tokens == 30 - used
        used += len(out.token_ids)


def test_an_agent_that_never_calls_the_model_fails_its_sample():
    # max_failed_ratio 1: the one sample fails, which would otherwise stop the run
    samples, _ = rollout(lambda p, k: [2], "idle_agent", max_failed_ratio=1.0)
    assert samples[0].status == Status.FAILED and "made no call to the model" in samples[0].metadata["error"]


def test_an_external_program_uses_the_session():
    samples, engine = rollout(lambda p, k: ids("ok") + [2], "external_agent", n=2)
    assert len(samples) == 2 and len(engine.calls) == 4
    assert all(s.reward == {"score": 0.5, "chars": 3.0} for s in samples)  # "ok\n" printed
    assert all([c["case"] for c in s.metadata["agent_calls"]] == ["extend", "extend"] for s in samples)


def test_sessions_are_separate_and_the_door_is_gone_after_the_rollout():
    seen = load_object(f"{AGENTS}:seen_urls")  # the module instance the rollout loads
    seen.clear()
    rollout(lambda p, k: ids("5") + [2], "tool_agent", n=2)
    a, b = seen
    assert a.startswith("http://127.0.0.1:") and a.split("/s/")[0] == b.split("/s/")[0] and a != b
    with pytest.raises(httpx.ConnectError):
        httpx.get(a + "/models", timeout=2)


def test_wrong_tokens_and_bad_requests_answer_in_the_error_shape():
    from tidal.rollout.agent import AgentDoor, Session

    async def run():
        door = AgentDoor()
        await door.start()
        c = RolloutConfig(generate="agent")
        session = Session(GenerateContext(None, TOK, c), None, None)
        door.sessions[session.token] = session
        url = door.base_url(session)
        try:
            async with httpx.AsyncClient() as http:
                ok = await http.get(url + "/models", headers={"Authorization": f"Bearer {session.token}"})
                wrong_key = await http.get(url + "/models", headers={"Authorization": "Bearer nope"})
                no_session = await http.get(f"{door.url}/s/{'0' * 32}/v1/models")
                body = {"messages": FIRST, "n": 2}
                two = await http.post(
                    url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {session.token}"}
                )
                body = {"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}
                bad_role = await http.post(url + "/messages", json=body, headers={"x-api-key": session.token})
                messages_key = await http.post(url + "/messages", json=body, headers={"x-api-key": "nope"})
        finally:
            await door.close()
        return ok, wrong_key, no_session, two, bad_role, messages_key

    ok, wrong_key, no_session, two, bad_role, messages_key = asyncio.run(run())
    # Anthropic's route answers in Anthropic's shape
    assert bad_role.status_code == 400 and bad_role.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages[0].role: must be 'user' or 'assistant', got 'system'",
        },
    }
    assert messages_key.status_code == 401 and messages_key.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "authorization: the session's token is its API key"},
    }
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tidal-policy"
    assert wrong_key.status_code == 401
    assert wrong_key.json()["error"] == {
        "message": "authorization: the session's token is its API key",
        "type": "authentication_error",
        "param": "authorization",
        "code": 401,
    }
    assert no_session.status_code == 404 and no_session.json()["error"]["message"].startswith("session: no open")
    assert two.status_code == 400 and two.json()["error"]["message"] == (
        "n: the agent door samples one answer per call, got 2"
    )


# ---------------------------------------------------------------------------- trains, token-exact
def ascii_model():
    """A tiny Llama that writes lowercase ASCII and never stops by itself: every (tied) embedding
    gets +1 (kept tokens) or -1 (the rest) in dimension 0, which dominates the normed hidden
    state, so only kept tokens are likely; a sampled answer then decodes and re-encodes to itself
    and a re-rendered history extends the previous prompt + answer token for token."""
    model = make_model(vocab_size=259, seed=1, max_position_embeddings=2048)
    emb = model.get_input_embeddings().weight
    keep = torch.zeros(259, dtype=torch.bool)
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789 +=\n":
        keep[ids(ch)[0]] = True
    with torch.no_grad():
        emb[keep] *= 5.0  # some spread between the kept tokens: log-probs that are not all alike
        emb[:, 0] = torch.where(keep, 1.0, -1.0)
    return model


def test_an_openai_agent_trains_through_the_door_token_exactly(tmp_path, monkeypatch):
    import tidal.loop
    from tidal.train.actor import Actor

    model_dir = tmp_path / "model"
    ascii_model().save_pretrained(model_dir)
    TOK.save_pretrained(model_dir)
    calls: dict = {}
    real_generate = GenerateContext.generate

    async def spy_generate(self, input_ids, sampling):
        out = await real_generate(self, input_ids, sampling)
        calls.setdefault(self.index, []).append((list(input_ids), out))
        return out

    checked = []
    real_train = Actor.train_step

    def spy_train(self, samples, *args, **kw):
        logp = self.compute_log_probs(samples)  # the weights that sampled them: nothing trained yet this step
        for i, s in enumerate(samples):
            k = torch.tensor(s.loss_mask, dtype=torch.bool)
            got = logp[i, : s.response_length][k]
            want = torch.tensor(s.rollout_log_probs)[k]
            assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
            checked.append(want.tolist())
        return real_train(self, samples, *args, **kw)

    samples_seen = []
    real_rollout = tidal.loop.RolloutManager.generate

    def spy_rollout(self, records, step, first_index=0):
        calls.clear()
        samples = real_rollout(self, records, step, first_index)
        samples_seen.append((samples, dict(calls)))
        return samples

    monkeypatch.setattr(GenerateContext, "generate", spy_generate)
    monkeypatch.setattr(Actor, "train_step", spy_train)
    monkeypatch.setattr(tidal.loop.RolloutManager, "generate", spy_rollout)
    cfg = loop_config(
        model_dir,
        tmp_path / "run",
        **{
            "train.num_steps": 2,
            "rollout.generate": "agent",
            "agent.fn": f"{AGENTS}:short_tool_agent",
            "rollout.rollout_batch_size": 2,
            "rollout.n_samples_per_prompt": 2,
            "train.global_batch_size": 4,
            "rollout.max_response_tokens": 300,
            "engine.kv_cache_tokens": 8192,  # the tools' system message alone is ~550 byte tokens
        },
    )
    history = tidal.loop.train(cfg)
    assert [h["step"] for h in history] == [1, 2]
    scored = [x for xs in checked for x in xs]
    assert len(scored) == 2 * 4 * 2 * 8  # steps x samples x turns x max_tokens: all of them compared
    assert min(scored) < -1.0 and max(scored) > -0.5  # a real distribution, not a forced token
    for step, (samples, by_key) in enumerate(samples_seen):
        assert len(samples) == 4
        for s in samples:
            trajectory = by_key[s.index]
            assert len(trajectory) == 2  # two turns
            # the first call adds the tools' system message to the dataset prompt: a new sample; then it grows
            assert [c["case"] for c in s.metadata["agent_calls"]] == ["new", "extend"]
            # the trainer's tokens: the engine's last prompt + what it sampled
            last_in, last_out = trajectory[-1]
            assert s.tokens == last_in + last_out.token_ids
            sampled = 0
            for inp, out in trajectory:
                n = len(out.token_ids)
                assert s.tokens[: len(inp)] == inp and s.tokens[len(inp) : len(inp) + n] == out.token_ids
                at = len(inp) - s.prompt_length
                assert s.loss_mask[at : at + n] == [1] * n
                assert s.rollout_log_probs[at : at + n] == out.log_probs
                assert s.token_versions[at : at + n] == [step] * n == [out.weight_version] * n
                sampled += n
            assert sum(s.loss_mask) == sampled  # everything else is environment
            env = [j for j, m in enumerate(s.loss_mask) if not m]
            assert all(s.rollout_log_probs[j] == 0.0 and s.token_versions[j] == -1 for j in env)
