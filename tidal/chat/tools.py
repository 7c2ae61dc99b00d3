"""Tool calls in the Hermes / Qwen format, shared by the chat routes of `tidal serve` and rollout
(the agent door, the tool loop):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse_tool_calls` finds them in generated text (never inside a `<think>...</think>` reasoning
block: a call the model only thinks about is not a call). `render_messages` makes a chat with
tools and tool results renderable by any chat template: templates that take `tools` get them;
for one that does not (SmolLM2's ChatML, for example), the tools are described in the system
message, an assistant's calls become `<tool_call>` text and a tool result becomes a
`<tool_response>` user turn, which is what Hermes-style models are trained on.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = ""

    def to_openai(self) -> dict:
        """The call as an OpenAI `tool_calls` entry (a fresh id when it has none)."""
        return {
            "id": self.id or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], list[str]]:
    """(the text with the calls removed, the calls, problems). A `<tool_call>` block that is not
    a JSON object with a string `name` and an object `arguments` is left in the text and reported
    in the problems; blocks inside `<think>` are ignored."""
    calls: list[ToolCall] = []
    problems: list[str] = []
    kept: list[str] = []
    pos = 0
    thinking = [(m.start(), m.end()) for m in THINK.finditer(text)]
    for m in TOOL_CALL.finditer(text):
        if any(a <= m.start() < b for a, b in thinking):
            continue
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError as e:
            problems.append(f"tool call is not JSON: {e.msg} at position {e.pos}")
            continue
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if isinstance(args, str):  # some models send the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            problems.append('tool call must be {"name": string, "arguments": object}')
            continue
        calls.append(ToolCall(obj["name"], args))
        kept.append(text[pos : m.start()])
        pos = m.end()
    kept.append(text[pos:])
    return "".join(kept).strip(), calls, problems


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools` argument."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "tools" in template


def _system_text(tools: list[dict], tool_choice: Any) -> str:
    specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    text = (
        "You may call one or more functions to help with the request. The functions are described "
        f"in JSON within <tools></tools>:\n<tools>\n{specs}\n</tools>\n"
        "To call a function, answer with a JSON object with its name and arguments within "
        '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>"
    )
    if tool_choice == "required":
        text += "\nYou must call at least one function."
    elif isinstance(tool_choice, dict):
        text += f"\nYou must call the function {tool_choice.get('function', {}).get('name')}."
    return text


IMAGE_PARTS = ("image_url", "image")  # OpenAI's image part, and the form chat templates take


def flatten_content(content: Any, where: str, images: list | None = None) -> str | list[dict]:
    """OpenAI content given as parts ([{"type": "text", "text": ...}]) joined into one string.
    `images`: for a vision-language model, where each image part's value (its `image_url.url`)
    is put, in order; content with images is then kept as parts for the chat template (text
    parts joined, each image as `{"type": "image"}`)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of parts")
    out: list[dict] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS and images is not None:
            url = part.get("image_url") if kind == "image_url" else part.get("image")
            images.append(url.get("url") if isinstance(url, dict) else url)
            out.append({"type": "image"})
            continue
        if kind not in ("text", "input_text"):
            served = "text and images" if images is not None else "text only: this model takes no images"
            raise ValueError(f"{where}.content[{i}]: part type {kind!r} is not supported ({served})")
        text = str(part.get("text", ""))
        if out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + text}
        else:
            out.append({"type": "text", "text": text})
    if any(p["type"] == "image" for p in out):
        return out
    return "".join(p["text"] for p in out)


_JSON_KINDS = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}


def call_arguments(value: Any, field: str) -> dict:
    """A tool call's `function.arguments` as an object: OpenAI's form is a string holding a JSON
    object (what the model wrote); an object is taken as it is. ValueError naming `field` and
    saying what the value is otherwise (a parser's message alone names no field)."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            said = f"it is not JSON ({e.msg} at line {e.lineno} column {e.colno})"
        else:
            if isinstance(parsed, dict):
                return parsed
            said = f"it holds a JSON {_JSON_KINDS.get(type(parsed), type(parsed).__name__)}"
    else:
        said = f"it is a JSON {_JSON_KINDS.get(type(value), type(value).__name__)}, not a string"
    raise ValueError(
        f"{field}: must be a JSON object in a string, as the model would write it (e.g. '{{\"a\": 1}}'); {said}"
    )


def tool_calls_of(message: dict, where: str) -> list[tuple[str, dict]]:
    """(name, arguments) of each call in an assistant message's `tool_calls` (OpenAI's form);
    ValueError naming the field of the first malformed one."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls: must be a list of calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{j}].function: must be an object with a string name and arguments")
        out.append(
            (fn["name"], call_arguments(fn.get("arguments", "{}"), f"{where}.tool_calls[{j}].function.arguments"))
        )
    return out


def render_messages(
    messages: list[dict], tools: list[dict] | None, tool_choice: Any, native: bool, images: list | None = None
) -> tuple:
    """(messages, tools argument) for `apply_chat_template`. Content parts are flattened; with
    `native` the template renders tools itself, otherwise they are spelled out (module docstring).
    `tool_choice: "none"` renders no tools. An assistant's tool calls are checked either way
    (ValueError naming the field of a malformed one). `images`: a vision-language model's (see
    `flatten_content`); a user's content with images stays as parts."""
    tools = tools if tools and tool_choice != "none" else None
    out: list[dict] = []
    for i, m in enumerate(messages):
        m = dict(m)
        role = m.get("role")
        found = len(images) if images is not None else 0
        m["content"] = flatten_content(m.get("content"), f"messages[{i}]", images)
        if images is not None and len(images) > found and role != "user":
            raise ValueError(f"messages[{i}]: images are taken in user messages only, not {role!r}")
        calls = tool_calls_of(m, f"messages[{i}]") if role == "assistant" else []
        if native:
            out.append(m)
            continue
        if calls:
            m.pop("tool_calls")
            blocks = [f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls]
            m["content"] = "\n".join([m["content"], *blocks]).strip()
        elif role == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if tools and not native:
        system = _system_text(tools, tool_choice)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
        return out, None
    return out, tools
