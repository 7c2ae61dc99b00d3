"""The tool loop, token for token: what the trainer gets is the engine's sampled ids plus the
environment's ids, never a re-encoding; plus the Sample growth API, tool schemas, tool errors and
per-request engine calls (no sample waits for another)."""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import CHATML

from tidal.contracts import GenerationOutput
from tidal.data.dataset import PromptRecord
from tidal.reward.options import RewardConfig
from tidal.rollout.generate import GenerateContext, single_turn, turn_seed
from tidal.rollout.manager import RolloutManager, group_size, group_sizes, sample_seed
from tidal.rollout.multi_turn import call_tool, tool_spec
from tidal.rollout.options import RolloutConfig, SamplingConfig, ToolsConfig
from tidal.types import Sample, Status


def merging_tokenizer():
    """Byte-level BPE with the merges a+d -> "ad" and ad+d -> "add": the engine may sample "a",
    "d", "d" one byte at a time, and decoding then encoding gives ["add"]: the round trip is not
    the identity."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    vocab["ad"], vocab["add"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "d"), ("ad", "d")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def byte_ids(tok, text: str) -> list[int]:
    """One id per byte: the non-canonical spelling a model is free to sample."""
    return [tok.convert_tokens_to_ids(c) for c in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)[0][0]]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b (int): the second addend
    """
    return a + b


# the tool loop's test tool, its samples scored by exact match
ADD_TOOL = {"tools": ToolsConfig(names=["test_multi_turn:add"]), "reward": RewardConfig(fn="exact_match")}
CALL = '<tool_call>{"name": "add", "arguments": {"a": %d, "b": %d}}</tool_call>'


class ScriptedEngine:
    """Answers by (sample, turn), found from the request's seed; records every request."""

    def __init__(self, tok, scripts: dict[int, list[str]], seeds: dict[int, int]):
        self.tok, self.scripts, self.calls = tok, scripts, []
        self.by_seed = {turn_seed(seed, t): (i, t) for i, seed in seeds.items() for t in range(8)}
        self.weight_version = 3

    async def generate(self, input_ids, sampling, *, request_id=None, group=None):
        i, t = self.by_seed[sampling.seed]
        self.calls.append((i, t))
        ids = byte_ids(self.tok, self.scripts[i][t]) + [self.tok.eos_token_id]
        logps = [-0.01 * (k + 1) - t for k in range(len(ids))]
        return GenerationOutput(ids, logps, "stop", self.scripts[i][t], self.weight_version + t)


def record(prompt="What is 2 + 3 + 4?"):
    return PromptRecord(index=0, prompt=prompt, text=prompt, input_ids=[1, 2, 3], label="9")


def test_three_turns_are_token_exact_with_a_tokenizer_that_does_not_round_trip():
    tok = merging_tokenizer()
    turns = [CALL % (2, 3), CALL % (5, 4), "The answer is 9"]
    assert tok.encode(turns[0], add_special_tokens=False) != byte_ids(tok, turns[0])  # "add" merges
    cfg = RolloutConfig(n_samples_per_prompt=1, rollout_batch_size=1, generate="tools", max_new_tokens=200)
    groups = {"sampling": SamplingConfig(seed=5), **ADD_TOOL}
    engine = ScriptedEngine(tok, {0: turns}, {0: sample_seed(5, 0, 0)})
    (s,) = RolloutManager(engine, cfg, tok, **groups).generate([record()], step=0)

    prompt_text = tok.apply_chat_template(
        [{"role": "system", "content": s.prompt.split("<|im_start|>system\n")[1].split("<|im_end|>")[0]},
         {"role": "user", "content": "What is 2 + 3 + 4?"}], tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert '"name": "add"' in s.prompt and "the second addend" in s.prompt and s.prompt == prompt_text
    prompt_ids = tok.encode(s.prompt, add_special_tokens=False)

    def env(result: str) -> list[int]:
        # after the model's own <|im_end|>: the template's newline, the tool turn, the next header
        text = f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        return tok.encode(text, add_special_tokens=False)

    sampled = [byte_ids(tok, t) + [tok.eos_token_id] for t in turns]
    expected = prompt_ids + sampled[0] + env("5") + sampled[1] + env("9") + sampled[2]
    assert s.tokens == expected
    assert s.response_length == len(expected) - len(prompt_ids)
    segs = [(sampled[0], 1, 3), (env("5"), 0, -1), (sampled[1], 1, 4), (env("9"), 0, -1), (sampled[2], 1, 5)]
    assert s.loss_mask == [m for ids, m, _ in segs for _ in ids]
    assert s.token_versions == [v for ids, _, v in segs for _ in ids]
    logps = []
    for t, (ids, m, _) in enumerate(segs):
        logps += [-0.01 * (k + 1) - t // 2 for k in range(len(ids))] if m else [0.0] * len(ids)
    assert s.rollout_log_probs == pytest.approx(logps)
    assert s.weight_version == 3 and s.status == Status.COMPLETED
    assert s.metadata["turns"] == 3 and s.metadata["tool_calls"] == 2 and s.metadata["tool_errors"] == 0
    assert [m["content"] for m in s.metadata["conversation"] if m["role"] == "tool"] == ["5", "9"]
    assert engine.calls == [(0, 0), (0, 1), (0, 2)]
    # each turn's request is exactly the tokens so far: sampled ids are never re-encoded
    s.validate()


def test_tool_errors_are_answers_and_turns_are_bounded():
    tok = merging_tokenizer()
    scripts = {
        0: ['<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "done"],
        1: ['<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "done"],
        2: ["<tool_call>not json</tool_call>", "done"],
        3: [CALL % (1, 1)] * 3,  # never stops calling: cut at max_turns
    }
    cfg = RolloutConfig(n_samples_per_prompt=4, generate="tools", max_turns=3, max_new_tokens=100)
    engine = ScriptedEngine(tok, scripts, {i: sample_seed(0, 0, i) for i in range(4)})
    samples = RolloutManager(engine, cfg, tok, **ADD_TOOL).generate([record()], step=0)
    tool_answers = [[m["content"] for m in s.metadata["conversation"] if m["role"] == "tool"] for s in samples]
    assert tool_answers[0] == ["error: unknown tool 'nope'; available: add"]
    assert tool_answers[1] == ["error: bad arguments for add: missing a required argument: 'b'"]
    assert tool_answers[2][0].startswith("error: tool call is not JSON")
    assert tool_answers[3] == ["2", "2"]
    assert [s.status for s in samples] == [Status.COMPLETED] * 3 + [Status.TRUNCATED]
    assert samples[3].metadata["stop"] == "max_turns" and samples[3].metadata["turns"] == 3
    assert [s.metadata["tool_errors"] for s in samples] == [1, 1, 1, 0]
    # every sample's turns in order, each its own request
    assert len(engine.calls) == 9
    for i, turns in enumerate([2, 2, 2, 3]):
        assert [c for c in engine.calls if c[0] == i] == [(i, t) for t in range(turns)]


def test_a_response_budget_cuts_before_the_tool_output_that_overflows_it():
    tok = merging_tokenizer()
    call = CALL % (2, 3)
    n_call = len(byte_ids(tok, call)) + 1
    cfg = RolloutConfig(n_samples_per_prompt=1, generate="tools", max_response_tokens=n_call + 5)
    engine = ScriptedEngine(tok, {0: [call, "x"]}, {0: sample_seed(0, 0, 0)})
    (s,) = RolloutManager(engine, cfg, tok, **ADD_TOOL).generate([record()], step=0)
    assert s.response_length == n_call and s.status == Status.TRUNCATED
    assert s.metadata["stop"] == "max_response_tokens"


async def _slow_echo(text: str) -> str:
    await asyncio.sleep(10)
    return text


def test_call_tool_turns_failures_into_text():
    tools = {"add": add, "slow": _slow_echo, "boom": lambda: 1 / 0}
    run = asyncio.run
    assert run(call_tool(tools, "add", {"a": 2, "b": 5}, 30.0)) == "7"  # in a thread: room for a loaded machine
    assert run(call_tool(tools, "slow", {"text": "x"}, 0.05)) == "error: slow timed out after 0.05 s"
    assert run(call_tool(tools, "boom", {}, 1.0)) == "error: boom raised ZeroDivisionError: division by zero"
    assert run(call_tool(tools, "add", {"a": 1, "c": 2}, 1.0)).startswith("error: bad arguments for add:")


def test_tool_spec_from_signature_and_docstring():
    def search(query: str, limit: int = 5, exact: bool | None = None, tags: list | None = None) -> str:
        """Search the notes.

        Args:
            query: words to look for
            limit: most results
        """
        return ""

    assert tool_spec(search) == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "words to look for"},
                    "limit": {"type": "integer", "description": "most results"},
                    "exact": {"type": "boolean"},
                    "tags": {"type": "array"},
                },
                "required": ["query"],
            },
        },
    }
    assert json.loads(json.dumps(tool_spec(add)))["function"]["parameters"]["required"] == ["a", "b"]


def test_sample_growth_keeps_fields_aligned_and_refuses_misaligned_input():
    s = Sample(tokens=[1, 2], index=4)
    s.append_policy([5, 6], [-0.5, -0.25], version=2, text="ab")
    s.append_env([7], text="c")
    s.append_policy([8], [-1.0], version=1)
    assert (s.tokens, s.response_length, s.loss_mask) == ([1, 2, 5, 6, 7, 8], 4, [1, 1, 0, 1])
    assert s.rollout_log_probs == [-0.5, -0.25, 0.0, -1.0] and s.token_versions == [2, 2, -1, 1]
    assert (s.weight_version, s.response, s.policy_versions) == (1, "abc", [2, 2, 1])
    with pytest.raises(ValueError, match=r"sample 4: append_policy got 2 token ids but 1 log-probs"):
        s.append_policy([9, 9], [-1.0], version=1)
    s.loss_mask.append(1)  # someone broke the alignment by hand
    with pytest.raises(ValueError, match=r"sample 4: loss_mask has 5 entries, expected response_length=4"):
        s.append_env([3])
    assert s.tokens == [1, 2, 5, 6, 7, 8]  # refused appends change nothing
    assert Sample.from_dict(Sample(tokens=[1], response_length=0).to_dict()).token_versions == []


class Echo:
    """Answers [last id + 1] at once; records the prompts in the order they arrive."""

    weight_version = 0

    def __init__(self):
        self.prompts = []

    async def generate(self, input_ids, sampling, *, request_id=None, group=None):
        self.prompts.append(list(input_ids))
        return GenerationOutput([input_ids[-1] + 1], [-0.5], "stop", "x", 0)


def test_a_sample_waiting_on_its_tool_holds_no_other_sample_up():
    """Sample 0's tool finishes only after samples 1 and 2 have finished both their turns. Under a
    round barrier (every request waits until every sample is waiting on the engine) this could not
    end; per request it does, in that order."""

    async def main():
        engine, others_done = Echo(), asyncio.Event()
        finished = []

        async def job(key, tool):
            x = key * 100
            for _ in range(2):  # a turn, the tool, the next turn
                x = (await engine.generate([x], None)).token_ids[0]
                await tool()
            finished.append(key)
            if len(finished) == 2:
                others_done.set()
            return x

        async def no_tool():
            pass

        results = await asyncio.wait_for(
            asyncio.gather(job(0, others_done.wait), job(1, no_tool), job(2, no_tool)), timeout=60
        )
        return results, finished

    assert asyncio.run(main()) == ([2, 102, 202], [1, 2, 0])


def test_single_turn_through_the_context():
    class One:
        async def generate(self, input_ids, sampling, *, request_id=None, group=None):
            return GenerationOutput([9, 2], [-0.1, -0.2], "length", "xy", 6)

    ctx = GenerateContext(One(), None, RolloutConfig())
    s = asyncio.run(single_turn(ctx, Sample(tokens=[1, 2, 3]), None))
    assert (s.tokens, s.loss_mask, s.token_versions, s.status) == ([1, 2, 3, 9, 2], [1, 1], [6, 6], Status.TRUNCATED)


async def twice(ctx, sample, sampling):
    """A user generate function that fans a prompt out into two samples and sets their rewards."""
    out = []
    for k in range(2):
        s = Sample(tokens=list(sample.tokens), label=sample.label, metadata=dict(sample.metadata))
        o = await ctx.generate(s.tokens, sampling)
        s.append_policy(o.token_ids, o.log_probs, o.weight_version)
        s.reward = float(k)
        out.append(s)
    return out


def test_user_generate_functions_by_path_and_per_prompt_row():
    rows = [record(), PromptRecord(index=1, prompt="q", text="q", input_ids=[7], metadata={"generate": "single_turn"})]
    cfg = RolloutConfig(n_samples_per_prompt=2, generate="test_multi_turn:twice")
    exact = RewardConfig(fn="exact_match")
    samples = RolloutManager(Echo(), cfg, reward=exact).generate(rows[:1], step=0)
    assert [(s.group_index, s.index, s.reward, s.tokens) for s in samples] == [
        (0, i, float(i % 2), [1, 2, 3, 4]) for i in range(4)
    ]
    # row 1 names single_turn (one sample per call): ragged groups of 4 and 2, numbered in order
    ragged = RolloutManager(Echo(), cfg).generate(rows, step=0)
    assert group_sizes(ragged) == [4, 2] and group_size(ragged) == [4, 2]
    assert [(s.group_index, s.index) for s in ragged] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 4), (1, 5)]
    with pytest.raises(ValueError, match=r"rollout.generate: 'test_multi_turn:add' must be `async def generate"):
        RolloutManager(Echo(), RolloutConfig(generate="test_multi_turn:add"))
