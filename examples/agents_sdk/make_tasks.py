"""Write the calculator tasks: additions of two single digits (done in one's head) and products
of two two-digit numbers (where the calculate tool helps), half and half.

    python examples/agents_sdk/make_tasks.py        # -> examples/agents_sdk/tasks.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def task(rng: random.Random, k: int) -> dict:
    if k % 2 == 0:
        a, b = rng.randrange(1, 10), rng.randrange(1, 10)
        return {"prompt": f"What is {a} + {b}?", "label": str(a + b)}
    a, b = rng.randrange(11, 100), rng.randrange(11, 100)
    return {"prompt": f"What is {a} * {b}?", "label": str(a * b)}


def main() -> None:
    rng = random.Random(46)
    rows = [task(rng, k) for k in range(200)]
    out = Path(__file__).with_name("tasks.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} tasks -> {out}")


if __name__ == "__main__":
    main()
