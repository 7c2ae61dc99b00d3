"""The examples as a user runs them: every example config is a valid config whose user code loads
(from the checkout's root, as their READMEs run them), and the feedback-turns generate function
trains on its answers and not on the user's feedback."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_tokenizer

from tidal.config import build_config
from tidal.contracts import GenerationOutput
from tidal.data.dataset import PromptRecord
from tidal.hooks import check_user_code
from tidal.rollout.manager import RolloutManager
from tidal.rollout.options import RolloutConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(ROOT.glob("examples/*/config.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[p.parent.name for p in CONFIGS])
def test_every_example_config_is_valid_and_its_user_code_loads(config, monkeypatch):
    monkeypatch.chdir(ROOT)
    check_user_code(build_config(str(config.relative_to(ROOT)), {}))


class Answers:
    """An engine that answers the i-th call with `texts[i]` and the end of the turn."""

    weight_version = 0

    def __init__(self, tok, texts: list[str]) -> None:
        self.tok, self.texts, self.calls = tok, texts, 0

    async def generate(self, input_ids, sampling, *, request_id=None, group=None) -> GenerationOutput:
        text = self.texts[self.calls]
        self.calls += 1
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        return GenerationOutput(ids, [-0.5] * len(ids), "stop", text, 0)


def test_the_feedback_turns_example_trains_its_answers_not_the_feedback(monkeypatch):
    monkeypatch.chdir(ROOT)
    tok = make_tokenizer()
    cfg = RolloutConfig(
        n_samples_per_prompt=1,
        max_new_tokens=16,
        max_turns=3,
        max_response_tokens=400,
        generate="examples/feedback_turns/generate.py:retry_until_right",
    )
    engine = Answers(tok, ["It is 4.", "5"])
    record = PromptRecord(index=0, prompt="What is 2 + 3?", text="q", input_ids=tok.encode("q"), label="5")
    (sample,) = RolloutManager(engine, cfg, tok).generate([record], step=0)
    assert engine.calls == 2 and sample.reward["score"] == 0.5 and sample.reward["turns"] == 2
    first, second = (len(tok.encode(t, add_special_tokens=False)) + 1 for t in ("It is 4.", "5"))
    mask = sample.loss_mask
    assert mask[:first] == [1] * first and mask[-second:] == [1] * second  # the answers are trained on
    assert set(mask[first:-second]) == {0}  # the user's feedback between them is not
