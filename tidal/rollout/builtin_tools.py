"""Built-in tools for multi-turn rollouts: Python execution in the sandbox and a calculator.

Both return a string for the model and never raise: a failure is a message starting with
``error:``. Their Google-style docstrings describe the arguments, from which the tool loop
derives the JSON schemas shown to the model.
"""

from __future__ import annotations

import ast
import math
import operator

from tidal.reward.sandbox import SandboxConfig, arun_code

__all__ = ["PYTHON_TOOL_SANDBOX", "calculator", "make_python_tool", "python_tool"]

PYTHON_TOOL_SANDBOX = SandboxConfig(timeout=5.0, memory_mb=512, max_output_bytes=8192)
_STDERR_SHOWN = 2000  # the tail of a traceback is the useful part

# calculator bounds: long inputs and huge integers would let one call eat the CPU.
MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 10_000  # ~3000 digits, well under Python's 4300-digit str() limit
MAX_EXPONENT = 10_000

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def make_python_tool(config: SandboxConfig = PYTHON_TOOL_SANDBOX):
    """A `python_tool` running under the given sandbox limits."""

    async def python_tool(code: str) -> str:
        """Run a Python program and return what it printed.

        Args:
            code: the complete Python program; use print() to show results.

        Returns:
            The program's standard output, or "error: <what happened>" followed by the end of
            its traceback when it failed, timed out or used too much memory.
        """
        try:
            result = await arun_code(code, config=config)
        except Exception as e:  # the tool must answer the model, never crash the rollout
            return f"error: sandbox failed: {type(e).__name__}: {e}"
        if result.ok:
            return result.stdout
        # Tracebacks name the random working directory; the model needs only the file name.
        stderr = result.stderr.replace(result.workdir + "/", "").strip()
        parts = [result.stdout.rstrip("\n")] if result.stdout else []
        parts.append(f"error: {result.reason}")
        if stderr:
            parts.append(stderr[-_STDERR_SHOWN:])
        return "\n".join(parts)

    return python_tool


python_tool = make_python_tool()


def _bounded(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"result too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not a finite number")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} is larger than {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        # Decide from the sizes before computing, so 9**9999 never gets built at full size.
        if (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
            raise ValueError(f"result too large (more than {MAX_INT_BITS} bits)")
    result = base**exponent
    if isinstance(result, complex):
        raise ValueError("result is a complex number")
    return result


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression: {ast.unparse(node)!r} (only numbers, + - * / // % ** and parentheses)")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly as Python would.

    Args:
        expression: numbers combined with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2 ** 3".

    Returns:
        The value ("56", "0.5"), or "error: <reason>" for anything else.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return f"error: not an arithmetic expression: {expression!r}"
    try:
        return repr(_evaluate(tree))
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:
        return "error: result too large"
    except RecursionError:
        return "error: expression nested too deeply"
    except ValueError as e:
        return f"error: {e}"
