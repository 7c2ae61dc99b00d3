"""A coding agent written against the `openai` package, with nothing of tidal in its loop.

It is given a task, may run Python through a `run_python` tool, and answers with a program in a
fenced block. The tool runs in tidal's code sandbox (bubblewrap, time and memory limits): the
agent's one import from tidal, as an agent would import any sandbox it trusts. During RL the
client points at the sample's session on tidal's agent door, so every completion becomes a
token-exact training sample; the hidden tests (`reward.fn: code_tests`) score the last
program of the answer.
"""

from __future__ import annotations

import json

from tidal.rollout.builtin_tools import python_tool

SYSTEM = (
    "You write short Python programs. Answer with one ```python code block holding a program that "
    "prints the requested value and nothing else, for example:\n```python\nprint(3 * 4)\n```\n"
    "You can run code with the run_python tool before answering."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run a Python program and return what it printed.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the complete program"}},
                "required": ["code"],
            },
        },
    }
]


async def agent(client, prompt, label, turns: int = 2):
    """Ask; run the tool calls the model makes and ask again (at most `turns` calls). Returns None:
    the hidden tests score the answer."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    for _ in range(turns):
        # no max_tokens: each call gets the rollout's max_new_tokens (within its response budget)
        resp = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = resp.choices[0].message
        if not message.tool_calls:
            return None
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                code = json.loads(call.function.arguments).get("code", "")
                result = await python_tool(str(code))
            except (ValueError, AttributeError) as e:
                result = f"error: bad arguments: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
