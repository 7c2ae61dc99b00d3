"""The built-in multi-turn tool loop (`rollout.generate: tools`).

    prompt (rendered with the tools' JSON schemas)
    repeat up to rollout.max_turns:
        the policy samples a turn                      -> append_policy (trained on)
        no tool call in it: the sample is complete
        run each call (errors and timeouts become the tool's answer, never a crash)
        the template's glue + the tool messages        -> append_env (mask 0)

Tool calls are found by the server's parser (`tidal.chat.tools.parse_tool_calls`: the Hermes
`<tool_call>` format, never inside `<think>`). The sampled ids are never re-encoded: only the
environment's text (tool results and the chat template's glue around them) is tokenized, once.
That glue is the difference between the template rendered with and without the new messages,
measured on a placeholder conversation, so earlier turns are never re-rendered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import re
import typing
from collections.abc import Callable
from typing import Any

from tidal.chat.tools import parse_tool_calls, render_messages, template_takes_tools
from tidal.contracts import SamplingParams
from tidal.rollout.generate import GenerateContext, finish, keep_routing, turn_seed
from tidal.types import Sample, Status
from tidal.utils import load_object

BUILTIN_TOOLS = {
    "calculator": "tidal.rollout.builtin_tools:calculator",
    "python": "tidal.rollout.builtin_tools:python_tool",
}
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_PLACEHOLDER = "TIDAL-ASSISTANT-TURN"


def tool_spec(fn: Callable) -> dict:
    """The OpenAI tool description of a Python function: its name, the first paragraph of its
    docstring, and a JSON schema of its parameters from the type hints (str, int, float, bool,
    list, dict, optional ones) with each one's text from a Google-style `Args:` section.
    Parameters without a default are required."""
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n")[0].replace("\n", " ").strip()
    arg_docs: dict[str, str] = {}
    if "Args:" in doc:
        section = doc.split("Args:", 1)[1].split("\n\n")[0]
        for m in re.finditer(r"^\s*(\w+)(?:\s*\([^)]*\))?:\s*(.+)$", section, re.MULTILINE):
            arg_docs[m.group(1)] = m.group(2).strip()
    hints = typing.get_type_hints(fn)
    props: dict[str, dict] = {}
    required: list[str] = []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        tp = hints.get(name, str)
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if args and typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            tp = args[0]
        prop = {"type": _JSON_TYPES.get(typing.get_origin(tp) or tp, "string")}
        if name in arg_docs:
            prop["description"] = arg_docs[name]
        props[name] = prop
        if p.default is inspect.Parameter.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": summary,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


def load_tools(names: list[str]) -> dict[str, Callable]:
    """Tool functions by built-in name (calculator, python) or dotted path, keyed by function name."""
    tools: dict[str, Callable] = {}
    for name in names:
        fn = load_object(BUILTIN_TOOLS.get(name, name), callable_required=True)
        tool_name = "python" if name == "python" else fn.__name__
        tools[tool_name] = fn
    return tools


async def call_tool(tools: dict[str, Callable], name: str, arguments: dict, timeout: float) -> str:
    """Run one call; whatever goes wrong is returned as text for the model to read."""
    fn = tools.get(name)
    if fn is None:
        return f"error: unknown tool {name!r}; available: {', '.join(sorted(tools))}"
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as e:
        return f"error: bad arguments for {name}: {e}"
    try:
        if inspect.iscoroutinefunction(fn):
            result = await asyncio.wait_for(fn(**arguments), timeout)
        else:  # a thread cannot be killed: a sync tool that hangs keeps its thread, not the rollout
            result = await asyncio.wait_for(asyncio.to_thread(fn, **arguments), timeout)
    except TimeoutError:
        return f"error: {name} timed out after {timeout:g} s"
    except Exception as e:
        return f"error: {name} raised {type(e).__name__}: {e}"
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)


class TurnRenderer:
    """Chat-template arithmetic for a tool loop with one tokenizer and one tool set."""

    def __init__(self, tokenizer: Any, tools: dict[str, Callable]) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("rollout.generate tools needs a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.specs = [tool_spec(fn) for fn in tools.values()]
        for spec, name in zip(self.specs, tools, strict=True):
            spec["function"]["name"] = name
        self.native = template_takes_tools(tokenizer)
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _PLACEHOLDER}]
        self._base = base
        self._base_text = self._render(base, add_generation_prompt=False)
        self._tail = self._base_text[self._base_text.rindex(_PLACEHOLDER) + len(_PLACEHOLDER) :]

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None) -> str:
        msgs, tools_arg = render_messages(messages, tools, "auto", self.native)
        kw = {"tools": tools_arg} if tools_arg else {}
        return self.tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, prompt: str | list[dict]) -> tuple[list[int], str]:
        """The prompt's ids and text, the tools described in it."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = self._render(messages, add_generation_prompt=True, tools=self.specs)
        return self.encode(text), text

    def after_turn(self, sampled_ids: list[int], messages: list[dict], stop_ids: set[int]) -> tuple[list[int], str]:
        """Ids and text the environment appends after a sampled assistant turn: what the template
        puts after the turn (less the end token the model sampled itself), then `messages`, then
        the next assistant header."""
        full = self._render(self._base + messages, add_generation_prompt=True)
        if not full.startswith(self._base_text):
            raise ValueError("the chat template renders earlier turns differently once tool messages follow")
        glue = self._tail
        if sampled_ids and sampled_ids[-1] in stop_ids:
            end = self.tokenizer.decode([sampled_ids[-1]], skip_special_tokens=False)
            if glue.startswith(end):
                glue = glue[len(end) :]
        text = glue + full[len(self._base_text) :]
        return self.encode(text), text


def _clip(tokenizer: Any, text: str, max_tokens: int) -> str:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens]) + f" ...[cut at {max_tokens} tokens]"


def _state(ctx: GenerateContext) -> tuple[dict[str, Callable], TurnRenderer]:
    if "tools" not in ctx.extra:  # built once per rollout manager, shared by its samples
        tools = load_tools(list(ctx.tools.names))
        ctx.extra["tools"] = (tools, TurnRenderer(ctx.tokenizer, tools))
    return ctx.extra["tools"]


async def tool_loop(ctx: GenerateContext, sample: Sample, sampling: SamplingParams) -> Sample:
    """Sample turns, run the tools they call, feed the results back; see the module docstring.
    `metadata` records turns, tool calls and tool errors; a sample that runs out of turns or
    tokens while still calling tools is TRUNCATED."""
    tools, renderer = _state(ctx)
    if ctx.record is not None:
        sample.tokens, sample.prompt = renderer.prompt(ctx.record.prompt)
    stop_ids = set(sampling.stop_token_ids)
    if ctx.tokenizer.eos_token_id is not None:
        stop_ids.add(ctx.tokenizer.eos_token_id)
    budget = ctx.rollout.response_budget
    calls_made = errors = 0
    conversation: list[dict] = []
    sample.metadata.update(conversation=conversation, turns=0, tool_calls=0, tool_errors=0)
    for turn in range(ctx.rollout.max_turns):
        left = budget - sample.response_length
        params = dataclasses.replace(
            sampling, max_new_tokens=min(sampling.max_new_tokens, left), seed=turn_seed(sampling.seed, turn)
        )
        out = await ctx.generate(sample.tokens, params)
        sample.append_policy(out.token_ids, out.log_probs, out.weight_version, out.text)
        keep_routing(sample, out)
        conversation.append({"role": "assistant", "content": out.text})
        sample.metadata["turns"] = turn + 1
        if out.finish_reason != "stop":
            return finish(sample, out.finish_reason)
        _, calls, problems = parse_tool_calls(out.text)
        if not calls and not problems:
            return finish(sample, "stop")
        if turn == ctx.rollout.max_turns - 1:
            sample.metadata["stop"] = "max_turns"
            break
        results = [f"error: {p}" for p in problems]
        for call in calls:
            results.append(await call_tool(tools, call.name, call.arguments, ctx.tools.timeout))
        calls_made += len(calls)
        errors += sum(r.startswith("error:") for r in results)
        sample.metadata.update(tool_calls=calls_made, tool_errors=errors)
        messages = [{"role": "tool", "content": _clip(ctx.tokenizer, r, ctx.tools.max_output_tokens)} for r in results]
        env_ids, env_text = renderer.after_turn(out.token_ids, messages, stop_ids)
        if sample.response_length + len(env_ids) >= budget:
            sample.metadata["stop"] = "max_response_tokens"
            break
        sample.append_env(env_ids, env_text)
        conversation.extend(messages)
    sample.status = Status.TRUNCATED
    sample.metadata["finish_reason"] = "length"
    return sample
