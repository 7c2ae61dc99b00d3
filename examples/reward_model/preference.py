"""The preference the example's reward model learns, as a check anyone can run: an answer that
states a number (has a digit) beats one that does not. It labels the reward model's training pairs
(`build_rm.py`) and, as a reward of its own, measures the policy on held-out prompts (`tidal eval
... --reward.fn examples/reward_model/preference.py:has_number`), the "true" metric beside the
reward model's score."""

from __future__ import annotations

import re

_DIGIT = re.compile(r"\d")


def states_a_number(text: str) -> bool:
    """Whether `text` holds a digit."""
    return _DIGIT.search(text) is not None


def has_number(sample) -> float:
    """tidal reward: 1.0 when the response states a number, else 0.0."""
    return float(states_a_number(sample.response))
