"""Procedural environments: the arithmetic generator and the env registry."""

from __future__ import annotations

import re

import pytest

from tidal.data.dataset import build_prompts
from tidal.data.envs import ENVS, make_env_rows
from tidal.data.envs.arithmetic import make_problems

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

# level -> {op: (range of a, range of b)}
LEVEL_RANGES = {
    1: {"+": (range(0, 10), range(0, 10))},
    2: {"+": (range(0, 10), range(0, 10)), "-": (range(0, 10), range(0, 10))},
    3: {"+": (range(10, 100), range(0, 10))},
    4: {"+": (range(10, 100), range(10, 100)), "-": (range(10, 100), range(10, 100))},
    5: {
        "*": (range(0, 10), range(0, 10)),
        "+": (range(10, 100), range(10, 100)),
        "-": (range(10, 100), range(10, 100)),
    },
    6: {"+": (range(100, 1000), range(100, 1000)), "-": (range(100, 1000), range(100, 1000))},
}


def test_example_shape():
    p = make_problems(n=1, level=1, seed=0)[0]
    m = p["metadata"]
    assert set(p) == {"prompt", "label", "metadata"}
    assert set(m) == {"level", "a", "b", "op"}
    assert p["prompt"] == f"What is {m['a']} + {m['b']}?"
    assert p["label"] == str(m["a"] + m["b"])
    assert m["level"] == 1


def test_deterministic_for_a_seed():
    assert make_problems(n=50, level=5, seed=7) == make_problems(n=50, level=5, seed=7)
    assert make_problems(n=50, level=5, seed=7) != make_problems(n=50, level=5, seed=8)
    # A longer list starts with the shorter one, so n can grow without reshuffling earlier items.
    assert make_problems(n=80, level=5, seed=7)[:50] == make_problems(n=50, level=5, seed=7)


def test_defaults():
    problems = make_problems()
    assert len(problems) == 1000
    assert {p["metadata"]["level"] for p in problems} == {1}
    assert make_problems(n=0) == []


@pytest.mark.parametrize("level", sorted(LEVEL_RANGES))
def test_labels_prompts_and_ranges(level):
    problems = make_problems(n=400, level=level, seed=level)
    ranges = LEVEL_RANGES[level]
    seen_ops = set()
    for p in problems:
        m = p["metadata"]
        a, b, op = m["a"], m["b"], m["op"]
        assert m["level"] == level
        assert op in ranges
        a_range, b_range = ranges[op]
        assert a in a_range and b in b_range
        assert p["prompt"] == f"What is {a} {op} {b}?"
        assert re.fullmatch(r"What is \d+ [+\-*] \d+\?", p["prompt"])
        assert p["label"] == str(OPS[op](a, b))
        seen_ops.add(op)
    assert seen_ops == set(ranges)  # every operator of the level shows up


def test_subtraction_can_go_negative():
    labels = [int(p["label"]) for p in make_problems(n=200, level=2, seed=0)]
    assert min(labels) < 0


@pytest.mark.parametrize("level", [0, 7, -1])
def test_bad_level(level):
    with pytest.raises(ValueError, match=rf"arithmetic level must be one of 1, 2, 3, 4, 5, 6, got {level}"):
        make_problems(n=1, level=level)


def test_negative_n():
    with pytest.raises(ValueError, match="n must be >= 0, got -1"):
        make_problems(n=-1)


def test_make_env_rows_shape_and_kwargs():
    rows = make_env_rows("arithmetic", n=5, level=3, seed=2)
    assert [number for number, _ in rows] == [1, 2, 3, 4, 5]
    assert [row for _, row in rows] == make_problems(n=5, level=3, seed=2)
    assert "arithmetic" in ENVS


def test_env_rows_feed_build_prompts(tokenizer):
    records, dropped = build_prompts(make_env_rows("arithmetic", n=3, seed=1), tokenizer, source="env:arithmetic")
    problems = make_problems(n=3, seed=1)
    assert dropped == 0
    assert [r.label for r in records] == [p["label"] for p in problems]
    assert [r.metadata for r in records] == [p["metadata"] for p in problems]
    assert records[0].text == f"<|im_start|>user\n{problems[0]['prompt']}<|im_end|>\n<|im_start|>assistant\n"


def test_unknown_env():
    with pytest.raises(ValueError) as exc:
        make_env_rows("chess")
    assert str(exc.value) == "unknown env 'chess'; known envs: arithmetic"


def test_unknown_env_kwarg():
    with pytest.raises(ValueError) as exc:
        make_env_rows("arithmetic", n=3, difficulty=2)
    assert str(exc.value) == "env 'arithmetic' got unknown argument(s) difficulty; accepted: n, level, seed"
