"""The examples as a user runs them: every example config is a valid config whose user code loads
(from the checkout's root, or from its own folder where its README runs it there), the
feedback-turns generate function trains on its answers and not on the user's feedback, the
reverse-word task's data and reward (a module of the user's own) do what docs/your-task.md
says, and the Python API example runs."""

from __future__ import annotations

import sys
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
# examples laid out as a user's own project: run from their folder, user code found from there
RUN_IN_OWN_FOLDER = {"reverse_word"}
REVERSE_WORD = ROOT / "examples" / "reverse_word"
# what an example's own script writes before its run (examples/reward_model: build_rm.py writes the
# reward model; examples/vision_shapes: build.py the model and the pictures' data file), stood in
# for by an empty folder or file: the config is checked, not run
BUILT_FIRST = {"reward_model": {"rm.path": "folder"}, "vision_shapes": {"train.model": "folder", "data.path": "file"}}


def forget_user_package(name: str = "myrl") -> None:
    """Drop the user package `name` (and its modules) from the imported modules: tests of other
    projects use the same name for their own package."""
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


@pytest.fixture(autouse=True)
def _no_user_package_left_behind():
    yield
    forget_user_package()


def enter(folder: Path, monkeypatch) -> None:
    """Work in `folder` with it on the import path, as `tidal train` started there has it."""
    forget_user_package()
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))


@pytest.mark.parametrize("config", CONFIGS, ids=[p.parent.name for p in CONFIGS])
def test_every_example_config_is_valid_and_its_user_code_loads(config, monkeypatch, tmp_path):
    built = {}
    for key, kind in BUILT_FIRST.get(config.parent.name, {}).items():
        path = tmp_path / key
        path.mkdir() if kind == "folder" else path.write_text("")
        built[key] = str(path)
    if config.parent.name in RUN_IN_OWN_FOLDER:
        enter(config.parent, monkeypatch)
        check_user_code(build_config(config.name, built))
    else:
        monkeypatch.chdir(ROOT)
        check_user_code(build_config(str(config.relative_to(ROOT)), built))


def test_the_reverse_word_data_is_forty_words_each_labelled_with_its_reverse(monkeypatch):
    from tidal.data.load import load_data

    enter(REVERSE_WORD, monkeypatch)
    # the test tokenizer spends a token per byte: room for the prompts SmolLM2 reads in ~60 tokens
    cfg = build_config("config.yaml", {"data.max_prompt_length": 512})
    records = load_data(cfg.data, make_tokenizer())
    words = [r.metadata["word"] for r in records]
    assert len(records) == 40 and len(set(words)) == 40
    for r in records:
        word = r.metadata["word"]
        assert r.label == word[::-1] and isinstance(r.prompt, str) and f'"{word}"' in r.prompt
        assert r.text.startswith("<|im_start|>user\n") and r.text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("response", "score", "parts"),
    [
        ("elppa", 1.0, {"exact": 1.0, "letters_in_place": 1.0, "short": 1.0}),
        ('The word "apple" backwards is "elppa".', 1.0, {"exact": 1.0, "short": 0.0}),
        ("elpap", 0.5 * 3 / 5 + 0.25, {"exact": 0.0, "letters_in_place": 3 / 5, "short": 1.0}),
        ("apple", 0.5 * 1 / 5 + 0.25, {"exact": 0.0, "letters_in_place": 1 / 5, "short": 1.0}),
        ("I cannot do that, sorry about it", 0.0, {"exact": 0.0, "letters_in_place": 0.0, "short": 0.0}),
        ("", 0.0, {"exact": 0.0, "letters_in_place": 0.0, "short": 0.0}),
        ("...", 0.0, {"exact": 0.0, "letters_in_place": 0.0, "short": 0.0}),
    ],
)
def test_the_reverse_word_reward_scores_through_tidals_loader(response, score, parts, monkeypatch):
    import asyncio

    from tidal.reward.score import get_reward_fn, score_samples
    from tidal.types import Sample, Status

    enter(REVERSE_WORD, monkeypatch)
    cfg = build_config("config.yaml", {})
    reward = get_reward_fn(cfg.reward.fn, workers=0)  # a thread: the pool's processes are tested elsewhere
    sample = Sample(prompt="p", response=response, label="elppa")
    assert asyncio.run(score_samples([sample], reward)) == 0
    assert sample.status == Status.COMPLETED
    assert sample.reward["score"] == pytest.approx(score)
    for key, value in parts.items():
        assert sample.reward[key] == pytest.approx(value), key


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


def python_api_script():
    """examples/python_api/train.py as a module: its main() runs only when called (it guards its entry point)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("python_api_train", ROOT / "examples/python_api/train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_python_api_example_trains_and_prints_each_steps_reward(tiny_model_dir, tmp_path, capsys):
    import json

    script = python_api_script()
    tiny = {
        "train.model": str(tiny_model_dir),
        "train.dtype": "float32",
        "engine.dtype": "float32",
        "train.num_threads": 0,  # leave the test process's threads as conftest set them
        "rollout.max_new_tokens": 8,
        "reward.fn": "conftest:token_parity_reward",
        "log.tensorboard": "false",
        "log.console": "false",
    }
    sets = [a for key, value in tiny.items() for a in ("--set", f"{key}={value}")]
    out = tmp_path / "run"
    assert script.main(["--steps", "2", "--out", str(out), *sets]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"2 steps into {out}"
    assert [line.split(",")[0] for line in printed[1:]] == [
        f"step {r['step']}: reward {r['reward/mean']:.3f}" for r in rows
    ]
    assert [r["step"] for r in rows] == [1, 2]


def test_the_python_api_example_prints_a_bad_option_as_the_command_line_does(capsys):
    script = python_api_script()
    assert script.main(["--set", "rollout.n_samples_per_prompt=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: invalid config:\n  rollout.n_samples_per_prompt: grpo compares samples")


def test_the_reward_model_example_trains_on_the_text_tidal_scores(monkeypatch):
    """build_rm.py's training text is what `reward.fn: rm` scores (the conversation in the reward
    model's chat template), and its pairs put an answer stating a number first."""
    import random

    from tidal.reward.options import RewardModelConfig
    from tidal.reward.reward_model import MESSAGES_KEY, RewardModel
    from tidal.types import Sample

    monkeypatch.syspath_prepend(str(ROOT / "examples" / "reward_model"))
    import build_rm
    import preference

    tok = make_tokenizer()
    messages = [{"role": "user", "content": "Tell me one fact about the Moon."}]
    answer = "It is about 384,400 km from Earth."
    rm = RewardModel(RewardModelConfig(path="unused"))
    rm.tokenizer = tok  # encode needs the tokenizer only
    scored = rm.encode(Sample(prompt="", response=answer, metadata={MESSAGES_KEY: messages}))
    assert build_rm.encode(tok, messages, answer) == scored
    record = PromptRecord(index=0, prompt="p", text="p", input_ids=[1], messages=messages)
    pairs = build_rm.make_pairs([record], [["No digits.", "In 1969.", "Far away.", "2 km"]], 3, random.Random(0))
    assert len({(c, r) for _, c, r in pairs}) == 3  # 3 distinct pairs of the 4 possible
    for m, chosen, rejected in pairs:
        assert m == messages and preference.states_a_number(chosen) and not preference.states_a_number(rejected)
    assert preference.has_number(Sample(response="x2")) == 1.0 and preference.has_number(Sample(response="x")) == 0.0
