"""The agent door with a vision-language model: an `openai` agent given a prompt with a picture
(each image part handed over as an `image_url` data: URI) sends it back; the door reads it with
the model's processor, the engine samples with it, and the sample keeps the images (the same
digests as the dataset's) with the in-process engine's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import door_agents
import pytest
from vision_models import picture, processor, tiny_vlm

from tidal import vision
from tidal.adapters.async_engine import AsyncEngine
from tidal.contracts import SamplingParams
from tidal.data.dataset import PromptRecord
from tidal.data.images import ImageReader
from tidal.engine.llm_engine import LLMEngine
from tidal.reward.options import RewardConfig
from tidal.rollout.manager import RolloutManager
from tidal.rollout.options import AgentConfig, RolloutConfig, SamplingConfig

FAMILY = "llava"
pytestmark = pytest.mark.usefixtures("one_thread")


def test_an_agent_sends_the_prompts_picture_through_the_door(tmp_path):
    picture(4).save(tmp_path / "p.png")
    reader = ImageReader(processor(FAMILY), vision.FAMILIES[FAMILY], tmp_path)
    content = [{"type": "image", "image": "p.png"}, {"type": "text", "text": "what?"}]
    messages, text, ids, images = reader.prompt([{"role": "user", "content": content}], "t")
    record = PromptRecord(index=0, prompt=messages, text=text, input_ids=ids, label="x", images=images)

    def new_engine():
        return LLMEngine(tiny_vlm(FAMILY), reader.processor.tokenizer, dtype="float32", kv_cache_tokens=1024)

    engine = AsyncEngine(new_engine())
    try:
        groups = {
            "sampling": SamplingConfig(temperature=0.0),
            "reward": RewardConfig(fn="exact_match"),
            "agent": AgentConfig(fn=f"{Path(door_agents.__file__)}:picture_agent"),
        }
        config = RolloutConfig(n_samples_per_prompt=2, generate="agent", max_new_tokens=6)
        manager = RolloutManager(engine, config, reader.processor.tokenizer, images=reader, **groups)
        samples = manager.generate([record], step=0)
    finally:
        engine.close()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    (want,) = new_engine().generate_batch([ids], [greedy], [images])
    assert len(samples) == 2
    for s in samples:
        assert [im.digest for im in s.images] == [im.digest for im in images]  # read back from the data: URI
        assert s.tokens == ids + want.token_ids
        assert s.metadata["agent_calls"][0]["case"] == "extend"  # the door rendered the dataset's prompt
