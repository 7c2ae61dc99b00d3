"""The calculator agent's reward: 1 when the last number the program printed is the answer."""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def reward(sample) -> float:
    """`sample.metadata["agent_output"]` is what `agent.py` printed (its final answer)."""
    numbers = NUMBER.findall(sample.metadata["agent_output"].replace(",", ""))
    return float(bool(numbers) and float(numbers[-1]) == float(sample.label))
