"""The reward of examples/vision_shapes: 1 when the first colour word of the answer (red, green
or blue) is the shape's colour (the row's label), else 0. An answer naming no colour earns 0."""

from __future__ import annotations

import re

WORDS = re.compile(r"\b(red|green|blue)\b")


def reward(sample) -> float:
    found = WORDS.search(sample.response.lower())
    return float(found is not None and found.group(1) == sample.label)
