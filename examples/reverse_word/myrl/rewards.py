"""The reward of the reverse-a-word task, as a user writes one in a module of their own.

tidal calls `reverse_reward(sample)` once per sampled response (`reward.fn:
myrl.rewards:reverse_reward`, found from the working directory). It reads `sample.response` (the
model's text) and `sample.label` (the row's `label`: the reversed word) and returns a dict:
`reward.key` (default "score") is what GRPO trains on, and every entry is logged as
`rewards/<name>` in metrics.jsonl.
"""

from __future__ import annotations

import re

from tidal import Sample


def answer(response: str) -> str:
    """The model's answer: the last run of letters in the response, lower-cased ("" if none), so
    `The reversed word is "elppa".` answers "elppa"."""
    words = re.findall(r"[A-Za-z]+", response)
    return words[-1].lower() if words else ""


def letters_in_place(got: str, target: str) -> float:
    """The share of the target's letters that `got` has at the same position (0 to 1); extra
    letters count against it, as the longer of the two is the denominator."""
    if not got or not target:
        return 0.0
    same = sum(a == b for a, b in zip(got, target, strict=False))
    return same / max(len(got), len(target))


def reverse_reward(sample: Sample) -> dict[str, float]:
    """1 for the exact reversed word. A wrong answer earns partial credit, so that the answers to
    one prompt differ even while none is right (GRPO learns only from differences within a group):
    half the share of letters in place, plus 0.25 for a reply of at most three words (one with a
    word in it), as asked."""
    target = str(sample.label).lower()
    got = answer(sample.response)
    exact = float(got == target)
    in_place = letters_in_place(got, target)
    short = float(bool(got) and len(sample.response.split()) <= 3)  # an empty reply is not an answer
    score = 1.0 if exact else 0.5 * in_place + 0.25 * short
    return {"score": score, "exact": exact, "letters_in_place": in_place, "short": short}
