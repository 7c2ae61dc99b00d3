"""A feedback-turn task: the model answers; when the answer is wrong, the user says so and it
tries again, up to `rollout.max_turns` answers. Every answer it sampled is trained on; the user's
turns are environment tokens (loss mask 0).

    rollout.generate: examples/feedback_turns/generate.py:retry_until_right

Reward: 1.0 for a right first answer, 0.5 for a right second one, 0.25 for a right third one, else 0.
"""

from __future__ import annotations

import dataclasses

from tidal.reward.verifiers import math_verify
from tidal.rollout.generate import turn_seed
from tidal.rollout.multi_turn import TurnRenderer

FEEDBACK = "That is wrong. Think again and give only the number."


async def retry_until_right(ctx, sample, sampling):
    renderer = ctx.extra.get("feedback") or ctx.extra.setdefault("feedback", TurnRenderer(ctx.tokenizer, {}))
    stop_ids = set(sampling.stop_token_ids) | {ctx.tokenizer.eos_token_id}
    budget = ctx.rollout.response_budget
    score = 0.0
    for turn in range(ctx.rollout.max_turns):
        left = budget - sample.response_length
        params = dataclasses.replace(
            sampling, seed=turn_seed(sampling.seed, turn), max_new_tokens=min(sampling.max_new_tokens, left)
        )
        out = await ctx.generate(sample.tokens, params)
        sample.append_policy(out.token_ids, out.log_probs, out.weight_version, out.text)
        if math_verify(out.text, sample.label):
            score = 0.5**turn
            break
        env_ids, env_text = renderer.after_turn(out.token_ids, [{"role": "user", "content": FEEDBACK}], stop_ids)
        if turn == ctx.rollout.max_turns - 1 or sample.response_length + len(env_ids) + 8 > budget:
            break
        sample.append_env(env_ids, env_text)
    sample.metadata["finish_reason"] = out.finish_reason
    sample.reward = {"score": score, "correct": float(score > 0), "first_try": float(score == 1.0), "turns": turn + 1}
    return sample
