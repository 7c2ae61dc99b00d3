"""The built-in tools: the calculator's exact values and refusals, and Python in the sandbox."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from tidal.reward import sandbox
from tidal.reward.sandbox import SandboxConfig
from tidal.rollout.builtin_tools import calculator, make_python_tool, python_tool


@pytest.mark.parametrize(
    "expression,expected",
    [
        ("2 + 3 * (4 - 1)", "11"),
        (" (3 + 4) * 2 ** 3 ", "56"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("3.5 % 2", "1.5"),
        ("-2 ** 2", "-4"),
        ("(-2) ** 3", "-8"),
        ("2 ** -1", "0.5"),
        ("2 ** 0.5", "1.4142135623730951"),
        ("1 / 3", "0.3333333333333333"),
        ("4 / 2", "2.0"),
        ("+5 - -5", "10"),
        ("2 ** 64", "18446744073709551616"),
        ("((1))", "1"),
        ("1e3 * 2", "2000.0"),
    ],
)
def test_calculator_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    "expression,expected",
    [
        ("1 / 0", "error: division by zero"),
        ("5 % 0", "error: division by zero"),
        ("0 ** -1", "error: division by zero"),
        ("x + 1", "error: unsupported expression: 'x' (only numbers, + - * / // % ** and parentheses)"),
        (
            "__import__('os').system('ls')",
            "error: unsupported expression: \"__import__('os').system('ls')\" "
            "(only numbers, + - * / // % ** and parentheses)",
        ),
        ("True + 1", "error: unsupported expression: 'True' (only numbers, + - * / // % ** and parentheses)"),
        ("'a' * 3", "error: unsupported expression: \"'a'\" (only numbers, + - * / // % ** and parentheses)"),
        ("1 < 2", "error: unsupported expression: '1 < 2' (only numbers, + - * / // % ** and parentheses)"),
        ("2 **", "error: not an arithmetic expression: '2 **'"),
        ("2 ** 100000", "error: exponent 100000 is larger than 10000"),
        ("9 ** 5000", "error: result too large (more than 10000 bits)"),
        ("(2 ** 9000) * (2 ** 9000)", "error: result too large (more than 10000 bits)"),
        ("10.0 ** 400", "error: result too large"),
        ("1e308 * 10", "error: result is not a finite number"),
        ("(-8) ** (1 / 3)", "error: result is a complex number"),
        ("1" * 1001, "error: expression longer than 1000 characters"),
    ],
)
def test_calculator_refuses(expression, expected):
    assert calculator(expression) == expected


def test_python_tool_returns_stdout():
    assert asyncio.run(python_tool("print(6 * 7)\nprint('done')")) == "42\ndone\n"


def test_python_tool_reports_errors_with_the_traceback_tail():
    out = asyncio.run(python_tool("print('before')\n1 / 0"))
    lines = out.splitlines()
    assert lines[:3] == ["before", "error: exit code 1", "Traceback (most recent call last):"]
    assert lines[3] == '  File "main.py", line 2, in <module>'  # no random workdir in the path
    assert lines[-1] == "ZeroDivisionError: division by zero"


def test_python_tool_limits():
    tool = make_python_tool(SandboxConfig(timeout=1.0, memory_mb=256))
    assert asyncio.run(tool("while True: pass")) == "error: timed out after 1 s"
    # this one must reach the memory limit before its timeout, even on a loaded machine
    tool = make_python_tool(SandboxConfig(timeout=30, memory_mb=256))
    out = asyncio.run(tool("x = bytearray(1 << 30)")).splitlines()
    assert (out[0], out[-1]) == ("error: memory limit of 256 MB exceeded", "MemoryError")
    tool = make_python_tool(SandboxConfig(max_output_bytes=100))
    assert asyncio.run(tool("print('a' * 1000)")) == "a" * 100 + "\nerror: output exceeded 100 bytes"


def test_python_tool_syntax_error_comes_back_as_text():
    out = asyncio.run(python_tool("print(1"))
    assert out.splitlines()[:2] == ["error: exit code 1", 'File "main.py", line 1']
    assert out.splitlines()[-1] == "SyntaxError: '(' was never closed"


def test_python_tool_never_raises(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox._bwrap_problem.cache_clear()
    try:
        out = asyncio.run(make_python_tool(SandboxConfig(backend="bwrap"))("print(1)"))
    finally:
        sandbox._bwrap_problem.cache_clear()
    assert out.startswith(
        "error: sandbox failed: SandboxUnavailable: sandbox backend 'bwrap' needs bubblewrap, which is not "
        "usable here: bwrap is not on PATH; install bubblewrap"
    )


def test_tool_docstrings_describe_the_arguments():
    for fn, arg in ((python_tool, "code"), (calculator, "expression")):
        assert list(inspect.signature(fn).parameters) == [arg]
        assert f"Args:\n            {arg}:" in fn.__doc__ or f"Args:\n        {arg}:" in fn.__doc__
