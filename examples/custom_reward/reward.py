"""A user reward for the custom_reward recipe: correctness plus a small bonus for a short answer.

tidal calls `score(sample)` once per response; it may be sync or async and may return a float or a
dict. With a dict, `reward.key` names the entry GRPO trains on; every numeric entry is
logged as `rewards/<key>`.
"""

from tidal.reward.verifiers import math_verify


async def score(sample) -> dict:
    correct = math_verify(sample.response, sample.label)
    short = 1.0 if sample.response_length <= 20 else 0.0
    # the brevity bonus only counts for right answers, so an empty reply earns nothing
    return {"score": correct * (1.0 + 0.2 * short), "correct": correct, "short": short}
