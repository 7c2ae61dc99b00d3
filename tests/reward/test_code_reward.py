"""The code reward: extraction of the program, the label's test shapes, and real programs
(correct, wrong, crashing, looping) run against them in the sandbox."""

from __future__ import annotations

import asyncio
import json

import pytest

from tidal.reward.code_tests import extract_code, make_code_reward, parse_tests
from tidal.reward.sandbox import SandboxConfig
from tidal.reward.score import get_reward_fn, score_samples
from tidal.types import Sample, Status

STDIO_TESTS = [
    {"input": "1 2\n", "output": "3\n"},
    {"input": "10 -4\n", "output": "6"},
    {"input": "0 0\n", "output": "0\n"},
]
# A generous timeout: a correct program must finish within it even on a loaded machine. The one
# test that needs a timeout to fire uses LOOP's: 5 s, short to keep it quick, long enough for its two
# passing programs to finish within it under load.
SANDBOX = SandboxConfig(timeout=30, memory_mb=512)
LOOP = SandboxConfig(timeout=5, memory_mb=512)


def _answer(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}\n```\nDone."


def _score(response: str, label, cfg: SandboxConfig = SANDBOX, **kw) -> dict:
    return asyncio.run(make_code_reward(cfg, **kw)(Sample(index=0, response=response, label=label)))


def test_extract_code_takes_the_last_complete_python_block():
    text = "```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```\n```bash\nls\n```\n```python\nprint(3)"
    assert extract_code(text) == "print(2)\n"  # bash skipped, the unterminated block is not an answer
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("no code here") is None


def test_parse_tests_shapes_and_errors():
    assert parse_tests(STDIO_TESTS) == [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "10 -4\n", "output": "6"},
        {"input": "0 0\n", "output": "0\n"},
    ]
    assert parse_tests(json.dumps({"inputs": ["a"], "outputs": ["b"]})) == [{"input": "a", "output": "b"}]
    assert parse_tests({"tests": ["assert f() == 1"]}) == [{"code": "assert f() == 1"}]
    assert parse_tests([{"output": "hi"}]) == [{"input": "", "output": "hi"}]
    with pytest.raises(ValueError, match="test 1 must be an assert snippet"):
        parse_tests(["assert True", {"input": "x"}])
    with pytest.raises(ValueError, match="label must be a non-empty list of tests, got NoneType"):
        parse_tests(None)
    with pytest.raises(ValueError, match="'inputs' and 'outputs' must be lists of the same length"):
        parse_tests({"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="is a string but not JSON"):
        parse_tests("print(1)")
    with pytest.raises(ValueError, match=r"needs 'tests' or 'inputs'\+'outputs', got keys \['cases'\]"):
        parse_tests({"cases": []})


def test_correct_program_passes_every_test():
    program = "a, b = map(int, input().split())\nprint(a + b)"
    assert _score(_answer(program), STDIO_TESTS) == {"score": 1.0, "passed": 3, "total": 3, "error": ""}


def test_wrong_program_scores_the_fraction_passed():
    program = "a, b = map(int, input().split())\nprint(a + b if a >= 0 and b >= 0 else a - b)"
    expected_error = "test 2: wrong output: expected '6', got '14\\n'"
    assert _score(_answer(program), STDIO_TESTS) == {"score": 2 / 3, "passed": 2, "total": 3, "error": expected_error}
    assert _score(_answer(program), STDIO_TESTS, all_or_nothing=True)["score"] == 0.0


def test_crashing_program():
    program = "a, b = map(int, input().split())\nprint(a // b)"
    r = _score(_answer(program), STDIO_TESTS)
    # 1//2 = 0 (wrong), 10//-4 = -3 (wrong), 0//0 raises
    assert (r["score"], r["passed"], r["total"]) == (0.0, 0, 3)
    assert r["error"] == "test 1: wrong output: expected '3\\n', got '0\\n'"
    r = _score(_answer("raise RuntimeError('boom')"), STDIO_TESTS[:1])
    assert r == {"score": 0.0, "passed": 0, "total": 1, "error": "test 1: exit code 1: RuntimeError: boom"}


def test_infinite_loop_times_out_and_the_other_tests_still_count():
    program = "a, b = map(int, input().split())\nwhile a == 0: pass\nprint(a + b)"
    r = _score(_answer(program), STDIO_TESTS, LOOP)
    assert r == {"score": 2 / 3, "passed": 2, "total": 3, "error": "test 3: timed out after 5 s"}


def test_assert_style_tests():
    program = "def add(a, b):\n    return a + b if a != 5 else 0"
    tests = ["assert add(1, 2) == 3", "assert add(5, 1) == 6", "assert add(-1, 1) == 0"]
    r = _score(_answer(program), tests)
    assert (r["score"], r["passed"], r["total"]) == (2 / 3, 2, 3)
    assert r["error"] == "test 2: exit code 1: AssertionError"


def test_no_code_block():
    assert _score("I think the answer is 3.", STDIO_TESTS) == {
        "score": 0.0,
        "passed": 0,
        "total": 3,
        "error": "no ```python code block in the response",
    }


def test_registered_as_builtin_code_tests():
    good = Sample(index=0, response=_answer("print(sum(map(int, input().split())))"), label=STDIO_TESTS)
    bad_label = Sample(index=1, response=_answer("print(1)"), label={"cases": []})
    failed = asyncio.run(score_samples([good, bad_label], get_reward_fn("code_tests")))
    assert failed == 1
    assert good.reward == {"score": 1.0, "passed": 3, "total": 3, "error": ""}
    assert bad_label.status == Status.FAILED
    assert bad_label.metadata["error"].startswith("ValueError: code tests label: a dict needs 'tests'")
