"""A calculator agent written with the OpenAI Agents SDK (`pip install openai-agents`).

    echo "What is 37 * 28?" | python agent.py       # the task on stdin (or as arguments)

It reads its task, lets the model answer, with a `calculate` tool for arithmetic, and prints the
final answer. It knows nothing of where its model runs: the SDK's client reads OPENAI_BASE_URL
and OPENAI_API_KEY from the environment, so it runs against api.openai.com as it is (with
`AGENT_MODEL` naming a model there if the default does not suit) and against any server speaking
the same API.
"""

from __future__ import annotations

import ast
import asyncio
import operator
import os
import sys

from agents import Agent, Runner, function_tool, set_default_openai_api

# This program talks to its model through chat completions (the SDK's default is the Responses
# API, on which the SDK raises when an answer is cut at its token limit): the choice is the
# program's, made here once.
set_default_openai_api("chat_completions")

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def evaluate(node: ast.AST) -> float:
    """The value of an arithmetic expression's tree: numbers, + - * / and parentheses only."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.operand))
    raise ValueError("only numbers, + - * / and parentheses are allowed")


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression such as '37 * 28' or '(4 + 5) / 3'."""
    try:
        value = evaluate(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else str(value)


AGENT = Agent(
    name="calculator",
    instructions="Reply with the number only. Call the calculate tool for multiplication.",
    tools=[calculate],
    model=os.environ.get("AGENT_MODEL", "gpt-4.1-mini"),
)


async def main() -> None:
    task = " ".join(sys.argv[1:]) or sys.stdin.read()
    result = await Runner.run(AGENT, task, max_turns=3)
    print(result.final_output)


if __name__ == "__main__":
    asyncio.run(main())
