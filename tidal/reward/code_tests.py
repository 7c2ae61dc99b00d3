"""A reward for code: run the response's program against the label's tests in the sandbox.

The program is the last fenced block of the response tagged ``python`` or ``py`` (an untagged
block counts too; an unterminated final fence does not, as a cut-off program is not an answer).
The label (``sample.label``) holds the tests, in one of these shapes, or as a JSON string of one:

- ``[{"input": "1 2\\n", "output": "3\\n"}, ...]``: stdin/stdout tests. The outputs match when
  they are equal line by line after stripping trailing whitespace from each line and blank lines
  from both ends.
- ``["assert add(1, 2) == 3", ...]``: each snippet is appended to the program and the test passes
  when the whole runs without error.
- ``{"tests": [...]}`` with either list above, or ``{"inputs": [...], "outputs": [...]}`` (the
  APPS/TACO ``input_output`` layout).

The reward is a dict: ``score`` (fraction of tests passed, or 1/0 with ``all_or_nothing``),
``passed``, ``total`` and ``error`` (why the first failing test failed; "" when all pass).
Registered as the built-in reward ``code_tests``.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from tidal.reward.sandbox import SandboxConfig, SandboxResult, arun_code
from tidal.types import Sample

__all__ = ["code_reward", "extract_code", "make_code_reward", "parse_tests"]

_FENCE_RE = re.compile(r"```(?P<tag>[\w+-]*)[ \t]*\n(?P<body>.*?)```", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3", ""}
# Per test: a model program gets a few seconds, not the sandbox's general default.
DEFAULT_TEST_SANDBOX = SandboxConfig(timeout=5.0, memory_mb=1024)
_SHOWN = 200  # characters of expected/actual output quoted in an error


def extract_code(text: str) -> str | None:
    """The last complete fenced Python block in `text` (tag python/py/python3 or none), or None."""
    blocks = [m.group("body") for m in _FENCE_RE.finditer(text) if m.group("tag").lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else None


def parse_tests(label: Any) -> list[dict[str, str]]:
    """Normalise a label into tests: ``{"input", "output"}`` (stdio) or ``{"code"}`` (asserts).

    Raises:
        ValueError: the label is not one of the shapes in the module docstring; the message says
            which test and field is wrong.
    """
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except json.JSONDecodeError as e:
            raise ValueError(f"code tests label is a string but not JSON: {e}") from None
    if isinstance(label, dict):
        if "tests" in label:
            label = label["tests"]
        elif "inputs" in label and "outputs" in label:
            inputs, outputs = label["inputs"], label["outputs"]
            if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
                raise ValueError("code tests label: 'inputs' and 'outputs' must be lists of the same length")
            label = [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)]
        else:
            raise ValueError(f"code tests label: a dict needs 'tests' or 'inputs'+'outputs', got keys {sorted(label)}")
    if not isinstance(label, list) or not label:
        raise ValueError(f"code tests label must be a non-empty list of tests, got {type(label).__name__}")
    tests = []
    for i, test in enumerate(label):
        if isinstance(test, str):
            tests.append({"code": test})
        elif isinstance(test, dict) and isinstance(test.get("output"), str) and isinstance(test.get("input", ""), str):
            tests.append({"input": test.get("input", ""), "output": test["output"]})
        else:
            raise ValueError(
                f"code tests label: test {i} must be an assert snippet (str) or "
                f"{{'input': str, 'output': str}}, got {test!r:.100}"
            )
    return tests


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip("\n").splitlines()] if text.strip() else []


def _failure(test: dict[str, str], result: SandboxResult) -> str | None:
    """Why `result` fails `test`, or None when it passes."""
    if not result.ok:
        last = result.stderr.strip().splitlines()[-1:] if result.stderr.strip() else []
        return result.reason + (f": {last[0][:_SHOWN]}" if last else "")
    if "output" in test and _lines(result.stdout) != _lines(test["output"]):
        return f"wrong output: expected {test['output'][:_SHOWN]!r}, got {result.stdout[:_SHOWN]!r}"
    return None


async def run_tests(
    program: str, tests: list[dict[str, str]], config: SandboxConfig = DEFAULT_TEST_SANDBOX, max_concurrency: int = 4
) -> tuple[int, str]:
    """(number of tests passed, why the first failing one failed or "") for `program`."""
    semaphore = asyncio.Semaphore(max_concurrency)

    async def one(test: dict[str, str]) -> str | None:
        async with semaphore:
            if "code" in test:
                result = await arun_code(f"{program}\n\n{test['code']}\n", config=config)
            else:
                result = await arun_code(program, stdin=test["input"], config=config)
        return _failure(test, result)

    failures = await asyncio.gather(*(one(t) for t in tests))
    first = next((f"test {i + 1}: {f}" for i, f in enumerate(failures) if f is not None), "")
    return sum(f is None for f in failures), first


def make_code_reward(
    config: SandboxConfig = DEFAULT_TEST_SANDBOX, *, all_or_nothing: bool = False, max_concurrency: int = 4
):
    """A reward function ``async (sample) -> dict`` that runs the tests of ``sample.label``.

    Args:
        config: the sandbox limits of each test run.
        all_or_nothing: score 1.0 only when every test passes (else the fraction passed).
        max_concurrency: test runs of one sample that may run at once.
    """

    async def code_tests(sample: Sample) -> dict:
        tests = parse_tests(sample.label)
        program = extract_code(sample.response)
        if program is None:
            return {"score": 0.0, "passed": 0, "total": len(tests), "error": "no ```python code block in the response"}
        passed, error = await run_tests(program, tests, config, max_concurrency)
        total = len(tests)
        score = float(passed == total) if all_or_nothing else passed / total
        return {"score": score, "passed": passed, "total": total, "error": error}

    return code_tests


code_reward = make_code_reward()
