"""Arithmetic problems ("What is 3 + 5?") with exact integer answers.

Levels (operands are drawn uniformly from the ranges given):

1. single-digit addition: a, b in 0..9
2. single-digit addition and subtraction: a, b in 0..9, results may be negative
3. two-digit plus one-digit addition: a in 10..99, b in 0..9
4. two-digit addition and subtraction: a, b in 10..99
5. a mix of single-digit multiplication (a, b in 0..9) and two-digit addition/subtraction
   (a, b in 10..99), each of the three operators equally likely
6. three-digit addition and subtraction: a, b in 100..999

The label is the answer as a decimal string (e.g. "-4"); metadata holds the level, operands and
operator so a reward function or test can recompute it.
"""

from __future__ import annotations

import random

from tidal.data.dataset import DataError

LEVELS = (1, 2, 3, 4, 5, 6)

_ONE = (0, 9)
_TWO = (10, 99)
_THREE = (100, 999)

# level -> list of (operator, range of a, range of b); one entry is picked uniformly per problem.
_SPECS: dict[int, list[tuple[str, tuple[int, int], tuple[int, int]]]] = {
    1: [("+", _ONE, _ONE)],
    2: [("+", _ONE, _ONE), ("-", _ONE, _ONE)],
    3: [("+", _TWO, _ONE)],
    4: [("+", _TWO, _TWO), ("-", _TWO, _TWO)],
    5: [("*", _ONE, _ONE), ("+", _TWO, _TWO), ("-", _TWO, _TWO)],
    6: [("+", _THREE, _THREE), ("-", _THREE, _THREE)],
}


def apply_op(a: int, op: str, b: int) -> int:
    """Evaluate `a op b` for op in '+', '-', '*'."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}")


def make_problems(n: int = 1000, level: int = 1, seed: int = 0) -> list[dict]:
    """Generate `n` problems of the given level; the same (n, level, seed) gives the same list."""
    if level not in _SPECS:
        raise DataError(f"arithmetic level must be one of {', '.join(map(str, LEVELS))}, got {level!r}")
    if n < 0:
        raise DataError(f"n must be >= 0, got {n}")
    # A private Random keeps the output independent of the global RNG and of other callers.
    rng = random.Random(seed)
    specs = _SPECS[level]
    problems = []
    for _ in range(n):
        op, (a_lo, a_hi), (b_lo, b_hi) = specs[rng.randrange(len(specs))]
        a = rng.randint(a_lo, a_hi)
        b = rng.randint(b_lo, b_hi)
        problems.append(
            {
                "prompt": f"What is {a} {op} {b}?",
                "label": str(apply_op(a, op, b)),
                "metadata": {"level": level, "a": a, "b": b, "op": op},
            }
        )
    return problems
