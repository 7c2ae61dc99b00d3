"""Agents for the agent-door tests, written as any `openai` user would write them (loaded by
`agent.fn: <this file>:<name>`)."""

from __future__ import annotations

import asyncio
import json
import sys

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]

seen_urls: list[str] = []  # the tests check the door is gone afterwards


async def tool_agent(client, prompt, label, max_tokens=200):
    """Ask, run the tool calls the model makes (or tell it to try again), ask once more; the
    reward is whether the last answer contains the label."""
    seen_urls.append(str(client.base_url))
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        resp = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, temperature=0.0, max_tokens=max_tokens
        )
        message = resp.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                args = json.loads(call.function.arguments)
                result = str(args["a"] + args["b"]) if call.function.name == "add" else "unknown tool"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        else:
            messages.append({"role": "user", "content": "That is wrong, try again."})
    return float(str(label) in (message.content or ""))


ANTHROPIC_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (t["function"] for t in TOOLS)
]


def anthropic_client(client):
    """An `anthropic` client on the same session: the session's URL without `/v1` (the package
    adds `/v1/messages`), its token as the API key."""
    import anthropic

    base_url = str(client.base_url).rstrip("/").removesuffix("/v1")
    return anthropic.AsyncAnthropic(base_url=base_url, api_key=client.api_key, max_retries=0)


async def anthropic_tool_agent(client, prompt, label, max_tokens=200):
    """`tool_agent` written against Anthropic's Messages API."""
    async with anthropic_client(client) as claude:
        messages = [{"role": "user", "content": prompt}]
        for _ in range(2):
            resp = await claude.messages.create(
                model="policy", max_tokens=max_tokens, messages=messages, tools=ANTHROPIC_TOOLS
            )
            messages.append({"role": "assistant", "content": resp.content})
            uses = [b for b in resp.content if b.type == "tool_use"]
            if uses:
                results = []
                for use in uses:
                    result = str(use.input["a"] + use.input["b"]) if use.name == "add" else "unknown tool"
                    results.append({"type": "tool_result", "tool_use_id": use.id, "content": result})
                messages.append({"role": "user", "content": results})
            else:
                messages.append({"role": "user", "content": "That is wrong, try again."})
    text = "".join(b.text for b in resp.content if b.type == "text")
    return float(str(label) in text)


async def rebuilding_agent(client, prompt, label):
    """Keeps its own history: the model's calls rebuilt from their parsed arguments (new ids, its
    own JSON), as agent frameworks with their own message types do."""
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        resp = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = resp.choices[0].message
        if not message.tool_calls:
            break
        args = json.loads(message.tool_calls[0].function.arguments)
        call = {"id": "x", "type": "function", "function": {"name": "add", "arguments": json.dumps(args)}}
        messages.append({"role": "assistant", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": "x", "content": str(args["a"] + args["b"])})
    return float(str(label) in (message.content or ""))


async def short_tool_agent(client, prompt, label):
    return await tool_agent(client, prompt, label, max_tokens=8)


async def scorer_agent(client, prompt, label):
    """Two turns; the reward is left to reward.fn."""
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        resp = await client.chat.completions.create(model="policy", messages=messages, max_tokens=50)
        messages += [resp.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    return None


async def greedy_agent(client, prompt, label):
    """Calls until the door refuses (the response budget is spent)."""
    messages = [{"role": "user", "content": prompt}]
    while True:
        resp = await client.chat.completions.create(model="policy", messages=messages)
        messages += [resp.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]


async def idle_agent(client, prompt, label):
    return 1.0


EXTERNAL = """
import openai, sys
client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)
messages = [{"role": "user", "content": sys.argv[3]}]
for _ in range(2):
    resp = client.chat.completions.create(model="policy", messages=messages)
    messages += [resp.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
print(resp.choices[0].message.content)
"""


async def external_agent(client, prompt, label):
    """Hands the session to another program (a subprocess with the sync `openai` client), awaited
    without blocking the event loop the door runs in."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        EXTERNAL,
        str(client.base_url),
        client.api_key,
        prompt,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(err.decode())
    return {"score": 0.5, "chars": float(len(out))}
