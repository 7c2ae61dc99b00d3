"""Write the coding tasks: one-line Python programs that print the value of a stated expression.

    python examples/coding_agent/make_tasks.py        # -> examples/coding_agent/tasks.jsonl

Each row is a task in words and hidden tests for `reward.fn: code_tests`: the program runs
with no input and must print the value. The model never sees the expected output.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["apple", "banana", "cherry", "python", "tidal", "river", "stone", "window", "garden", "planet"]


def task(rng: random.Random) -> tuple[str, str]:
    """(what to print, in words and a Python expression, and the value it prints)."""
    kind = rng.randrange(5)
    a, b, c = rng.randrange(2, 50), rng.randrange(2, 50), rng.randrange(2, 50)
    w = rng.choice(WORDS)
    if kind == 0:
        return f"the value of {a} + {b}", str(a + b)
    if kind == 1:
        return f"the value of {a} * {b}", str(a * b)
    if kind == 2:
        return f"the value of {a} - {b}", str(a - b)
    if kind == 3:
        return f"the length of the string '{w}'", str(len(w))
    return f"the largest of the numbers {a}, {b} and {c}", str(max(a, b, c))


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).with_name("tasks.jsonl")
    with out.open("w") as f:
        for _ in range(600):
            what, value = task(rng)
            prompt = f"Write a Python program that prints {what}."
            f.write(json.dumps({"prompt": prompt, "label": [{"input": "", "output": value + "\n"}]}) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
