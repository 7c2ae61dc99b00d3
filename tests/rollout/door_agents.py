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
replies: list = []  # what the recording agents were answered, call by call
sampling: list = []  # set by a test's engine while it samples (impatient_agent waits for it)


async def ask(client, stream: bool, **kw) -> dict:
    """One chat call; the answer as the message the agent sends back: the non-streamed message as
    the package dumps it, or the one assembled from the chunks of a stream (text deltas joined,
    tool-call pieces joined by their index)."""
    if not stream:
        resp = await client.chat.completions.create(**kw)
        return resp.choices[0].message.model_dump(exclude_none=True)
    content, calls = "", {}
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": "", "type": "function", "function": {}})
                call["id"] += piece.id or ""
                for key in ("name", "arguments"):
                    part = getattr(piece.function, key) or ""
                    call["function"][key] = call["function"].get(key, "") + part
    message = {"role": "assistant", "content": content} if content or not calls else {"role": "assistant"}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return message


async def tool_agent(client, prompt, label, max_tokens=200, stream=False):
    """Ask, run the tool calls the model makes (or tell it to try again), ask once more; the
    reward is whether the last answer contains the label."""
    seen_urls.append(str(client.base_url))
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        message = await ask(
            client, stream, model="policy", messages=messages, tools=TOOLS, temperature=0.0, max_tokens=max_tokens
        )
        replies.append(message)
        messages.append(message)
        for call in message.get("tool_calls", []):
            args = json.loads(call["function"]["arguments"])
            result = str(args["a"] + args["b"]) if call["function"]["name"] == "add" else "unknown tool"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        if "tool_calls" not in message:
            messages.append({"role": "user", "content": "That is wrong, try again."})
    return float(str(label) in (message.get("content") or ""))


async def streaming_tool_agent(client, prompt, label):
    """`tool_agent` with `stream=True`."""
    return await tool_agent(client, prompt, label, stream=True)


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


async def anthropic_ask(claude, stream: bool, **kw) -> list:
    """One Messages call; its content blocks, recorded in `replies` with the answer's text (from
    `text_stream` when streamed)."""
    if stream:
        async with claude.messages.stream(**kw) as events:
            text = "".join([piece async for piece in events.text_stream])
            resp = await events.get_final_message()
    else:
        resp = await claude.messages.create(**kw)
        text = "".join(b.text for b in resp.content if b.type == "text")
    replies.append({"text": text, "content": [b.model_dump(exclude_none=True) for b in resp.content]})
    return resp.content


async def anthropic_tool_agent(client, prompt, label, max_tokens=200, stream=False):
    """`tool_agent` written against Anthropic's Messages API."""
    async with anthropic_client(client) as claude:
        messages = [{"role": "user", "content": prompt}]
        for _ in range(2):
            content = await anthropic_ask(
                claude, stream, model="policy", max_tokens=max_tokens, messages=messages, tools=ANTHROPIC_TOOLS
            )
            messages.append({"role": "assistant", "content": content})
            uses = [b for b in content if b.type == "tool_use"]
            if uses:
                results = []
                for use in uses:
                    result = str(use.input["a"] + use.input["b"]) if use.name == "add" else "unknown tool"
                    results.append({"type": "tool_result", "tool_use_id": use.id, "content": result})
                messages.append({"role": "user", "content": results})
            else:
                messages.append({"role": "user", "content": "That is wrong, try again."})
    text = "".join(b.text for b in content if b.type == "text")
    return float(str(label) in text)


async def anthropic_streaming_tool_agent(client, prompt, label):
    """`anthropic_tool_agent` streaming its answers (`messages.stream`)."""
    return await anthropic_tool_agent(client, prompt, label, stream=True)


async def logprob_agent(client, prompt, label, stream=False):
    """One call asking for log-probs (and, streamed, the usage chunk); records what it got."""
    kw = {"model": "policy", "messages": [{"role": "user", "content": prompt}], "logprobs": True}
    if not stream:
        resp = await client.chat.completions.create(**kw)
        (choice,) = resp.choices
        content, entries, reason, usage = (
            choice.message.content,
            choice.logprobs.content,
            choice.finish_reason,
            resp.usage,
        )
    else:
        content, entries, reason, usage = "", [], None, None
        chunks = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
        async for chunk in chunks:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                entries += choice.logprobs.content if choice.logprobs else []
                reason = choice.finish_reason or reason
    logprobs = [(e.token, e.logprob) for e in entries]
    replies.append(
        {
            "content": content,
            "logprobs": logprobs,
            "finish_reason": reason,
            "usage": usage.model_dump(exclude_none=True),
        }
    )


async def streaming_logprob_agent(client, prompt, label):
    return await logprob_agent(client, prompt, label, stream=True)


async def hanging_up_agent(client, prompt, label):
    """Reads the first chunk of a streamed answer and goes away; then asks the same again, whole."""
    messages = [{"role": "user", "content": prompt}]
    chunks = await client.chat.completions.create(model="policy", messages=messages, stream=True)
    async for _ in chunks:
        break
    await chunks.close()
    resp = await client.chat.completions.create(model="policy", messages=messages)
    replies.append(resp.choices[0].message.content)


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


async def impatient_agent(client, prompt, label):
    """Gives up on its first call (closing the connection) once the engine is sampling its answer
    (the test's engine appends to `sampling`), then asks the same again."""
    messages = [{"role": "user", "content": prompt}]
    first = asyncio.ensure_future(client.chat.completions.create(model="policy", messages=messages))
    while not sampling and not first.done():
        await asyncio.sleep(0.01)
    first.cancel()
    try:
        await first
    except asyncio.CancelledError:
        replies.append("gave up")
    resp = await client.chat.completions.create(model="policy", messages=messages)
    replies.append(resp.choices[0].message.content)


# ---------------------------------------------------------------------------- the Responses API
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses shape


async def respond(client, stream: bool, **kw):
    """One Responses call; the response, whole or the one the stream's last event carries (its
    text deltas joined must be its text)."""
    if not stream:
        return await client.responses.create(**kw)
    events = [e async for e in await client.responses.create(stream=True, **kw)]
    final = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    return final


async def responses_tool_agent(client, prompt, label, stream=False, chain=False):
    """`tool_agent` written against the Responses API: the items sent back each time, or (`chain`)
    only the new ones, after `previous_response_id`."""
    items = [{"role": "user", "content": prompt}]
    previous = None
    for _ in range(2):
        resp = await respond(
            client,
            stream,
            model="policy",
            input=items,
            tools=RESPONSES_TOOLS,
            previous_response_id=previous,
            max_output_tokens=200,  # as `tool_agent` asks
        )
        output = [o.model_dump(exclude_none=True) for o in resp.output]
        replies.append([{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in output])
        new = []
        for call in (o for o in output if o["type"] == "function_call"):
            args = json.loads(call["arguments"])
            result = str(args["a"] + args["b"]) if call["name"] == "add" else "unknown tool"
            new.append({"type": "function_call_output", "call_id": call["call_id"], "output": result})
        if not new:
            new.append({"role": "user", "content": "That is wrong, try again."})
        items, previous = (new, resp.id) if chain else ([*items, *output, *new], None)
    return float(str(label) in resp.output_text)


async def responses_streaming_tool_agent(client, prompt, label):
    return await responses_tool_agent(client, prompt, label, stream=True)


async def responses_chained_tool_agent(client, prompt, label):
    return await responses_tool_agent(client, prompt, label, chain=True)


async def responses_logprob_agent(client, prompt, label, stream=False):
    """One call asking for the sampled tokens' log-probs; records what it got."""
    kw = {"model": "policy", "input": prompt, "include": ["message.output_text.logprobs"]}
    resp = await respond(client, stream, **kw)
    part = resp.output[0].content[0]
    replies.append(
        {
            "text": part.text,
            "logprobs": [(e.token, e.logprob) for e in part.logprobs],
            "status": resp.status,
            "incomplete": resp.incomplete_details.model_dump() if resp.incomplete_details else None,
            "usage": resp.usage.model_dump(exclude_none=True),
        }
    )


async def responses_streaming_logprob_agent(client, prompt, label):
    return await responses_logprob_agent(client, prompt, label, stream=True)


async def agents_sdk_agent(client, prompt, label, stream=False):
    """An agent of the OpenAI Agents SDK, unmodified, with a function tool: its default model,
    the Responses API, on the session's client (no tracing: nothing outside can be reached)."""
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    model = OpenAIResponsesModel(model="policy", openai_client=client)
    agent = Agent(name="adder", model=model, tools=[add])
    if stream:
        result = Runner.run_streamed(agent, prompt, max_turns=3)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, prompt, max_turns=3)
    replies.append(result.final_output)
    return float(str(label) in result.final_output)


async def agents_sdk_streaming_agent(client, prompt, label):
    return await agents_sdk_agent(client, prompt, label, stream=True)


async def responses_short_agent(client, prompt, label):
    """Two short calls, the first answer's items sent back with another question."""
    items = [{"role": "user", "content": prompt}]
    for _ in range(2):
        resp = await client.responses.create(model="policy", input=items, max_output_tokens=8)
        items += [*(o.model_dump(exclude_none=True) for o in resp.output), {"role": "user", "content": "again"}]


async def picture_agent(client, prompt, label):
    """Send the prompt's messages (a picture among them, as an `image_url` part) once; the reward
    is whether the answer is non-empty."""
    seen_urls.append(str(client.base_url))
    resp = await client.chat.completions.create(model="policy", messages=prompt, max_tokens=6)
    replies.append(resp.choices[0].message.model_dump(exclude_none=True))
    return float(bool(resp.choices[0].message.content))
