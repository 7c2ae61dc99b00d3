"""An agent run's kept samples carry their metadata (the calls the door recorded, who scored
them), and its report names the agent's reward rather than reward.fn."""

from pathlib import Path

from conftest import loop_config

import tidal.loop
from tidal.report import build_report
from tidal.samples_log import read_samples


async def scoring_agent(client, prompt, label):
    """Two calls on one conversation; the reward is the agent's own."""
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        resp = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        messages += [resp.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    return 0.5


def test_saved_agent_samples_keep_the_calls_and_the_report_names_the_agents_reward(tiny_model_dir, tmp_path):
    agent = f"{Path(__file__)}:scoring_agent"
    over = {
        "train.num_steps": 1,
        "rollout.generate": "agent",
        "agent.fn": agent,
        "rollout.rollout_batch_size": 2,
        "rollout.n_samples_per_prompt": 2,
        "train.global_batch_size": 4,
        # room for both calls whatever bytes the tiny model samples: "again" and the re-rendered
        # history are environment tokens of the sample, which the default budget (8 x turns) may not hold
        "rollout.max_response_tokens": 256,
    }
    tidal.loop.train(loop_config(tiny_model_dir, tmp_path, **over))
    rows = read_samples(tmp_path)[1]
    assert len(rows) == 4
    for row in rows:
        meta = row["metadata"]
        assert meta["reward_from"] == "agent.fn" and row["reward"] == 0.5
        calls = meta["agent_calls"]
        assert 1 <= len(calls) <= 2  # the last sample of the trajectory: one or both calls
        for call in calls:
            assert set(call) == {"case", "at", "sampled", "finish_reason"}
            assert call["case"] in ("new", "extend", "realign") and 1 <= call["sampled"] <= 4
        assert meta["finish_reason"] == calls[-1]["finish_reason"]
    page = build_report(tmp_path)
    assert f"reward: the agent&#x27;s own ({agent})" in page
    assert "reward math" not in page and "math (built-in reward.fn)" not in page
