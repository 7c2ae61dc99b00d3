"""The reward-model reward (`reward.fn: rm`): batched scores equal one-at-a-time transformers
forwards, concurrent calls share forwards, the text scored, the config's refusals, and a loop run."""

import asyncio
import statistics

import pytest
import torch
from conftest import loop_config, make_tokenizer, tiny_llama_config
from transformers import AutoModelForSequenceClassification, LlamaForSequenceClassification

import tidal.loop
from tidal.config import build_config
from tidal.options import ConfigError
from tidal.reward.options import RewardModelConfig
from tidal.reward.reward_model import MESSAGES_KEY, RewardModel
from tidal.reward.score import score_samples
from tidal.types import Sample

PROMPTS = ["2+2?", "Name a colour.", "Say hi", "Why is the sky blue? Answer in one line.", "x", "Count to 3.", "ok?"]
RESPONSES = ["4", "Blue, like the sea on a clear day", "hi", "Rayleigh scattering.", "yes " * 9, "1 2 3", ""]


def save_rm(path, pad_token_id=0):
    """A tiny random Llama with a one-label head and the byte tokenizer (chat template, pad id 0)."""
    torch.manual_seed(0)
    config = tiny_llama_config(tie_word_embeddings=False, num_labels=1, pad_token_id=pad_token_id)
    LlamaForSequenceClassification(config).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return save_rm(tmp_path_factory.mktemp("tiny_rm"))


def samples(with_messages: bool = True) -> list[Sample]:
    tok = make_tokenizer()
    out = []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        messages = [{"role": "user", "content": p}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        meta = {MESSAGES_KEY: messages} if with_messages else {}
        out.append(Sample(prompt=text, response=r, index=i, metadata=meta))
    return out


def one_at_a_time(path, texts: list[str], special: bool) -> list[float]:
    """The reference: transformers' own model, one unpadded text per forward."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = make_tokenizer()
    ids = [tok(t, add_special_tokens=special)["input_ids"] for t in texts]
    with torch.no_grad():
        return [model(torch.tensor([x])).logits[0, 0].item() for x in ids]


def test_batched_scores_equal_one_at_a_time_forwards_on_the_chat_templated_conversation(rm_dir):
    rm = RewardModel(RewardModelConfig(path=str(rm_dir), device="cpu", dtype="float32", batch_size=16))
    got = rm.score(samples())
    assert rm.forwards == 1  # 7 samples of different lengths in one padded forward
    texts = [
        f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n{r}<|im_end|>\n"
        for p, r in zip(PROMPTS, RESPONSES, strict=True)
    ]
    assert [rm.text_of(s) for s in samples()] == [(t, True) for t in texts]
    assert got == pytest.approx(one_at_a_time(rm_dir, texts, special=False), abs=1e-5)
    assert len(set(got)) == len(got)  # a random head still tells the texts apart


def test_without_messages_or_template_it_scores_prompt_text_plus_response(rm_dir):
    rm = RewardModel(RewardModelConfig(path=str(rm_dir), device="cpu", dtype="float32", chat_template=False))
    batch = samples()
    texts = [s.prompt + s.response for s in batch]
    got = rm.score(batch)
    assert [rm.text_of(s) for s in batch] == [(t, False) for t in texts]
    assert got == pytest.approx(one_at_a_time(rm_dir, texts, special=True), abs=1e-5)
    plain = RewardModel(RewardModelConfig(path=str(rm_dir), device="cpu", dtype="float32"))
    assert plain.score(samples(with_messages=False)) == pytest.approx(got, abs=1e-5)


@pytest.mark.parametrize(("batch_size", "forwards"), [(1, 7), (3, 3), (4, 2)])
def test_splitting_the_batch_differently_gives_the_same_scores(rm_dir, batch_size, forwards):
    whole = RewardModel(RewardModelConfig(path=str(rm_dir), device="cpu", dtype="float32", batch_size=16))
    split = RewardModel(RewardModelConfig(path=str(rm_dir), device="cpu", dtype="float32", batch_size=batch_size))
    assert split.score(samples()) == pytest.approx(whole.score(samples()), abs=1e-5)
    assert split.forwards == forwards


def test_a_model_saved_without_a_pad_id_pads_with_its_tokenizers(tmp_path):
    path = save_rm(tmp_path, pad_token_id=None)
    rm = RewardModel(RewardModelConfig(path=str(path), device="cpu", dtype="float32", batch_size=16))
    got = rm.score(samples())
    assert rm.model.config.pad_token_id == 0  # <|endoftext|>, the tokenizer's pad token
    # unpadded, a model without a pad id reads the last token: the same token the padded batch reads
    texts = [rm.text_of(s)[0] for s in samples()]
    assert got == pytest.approx(one_at_a_time(path, texts, special=False), abs=1e-5)


def test_long_texts_lose_their_start(rm_dir):
    rm = RewardModel(RewardModelConfig(path=str(rm_dir), device="cpu", dtype="float32", max_length=6))
    rm.load()
    s = samples()[3]
    full = make_tokenizer()(rm.text_of(s)[0], add_special_tokens=False)["input_ids"]
    assert rm.encode(s) == full[-6:] and len(full) > 6
    assert rm.score([s]) == pytest.approx(one_at_a_time(rm_dir, ["ing.<|im_end|>\n"], special=False), abs=1e-5)


def test_concurrent_reward_calls_share_forwards(rm_dir):
    """The rollout awaits one call per sample; the calls started together go through in batches."""
    cfg = RewardModelConfig(path=str(rm_dir), device="cpu", dtype="float32", batch_size=4)
    expected = RewardModel(cfg).score(samples())
    rm = RewardModel(cfg)
    batch = samples()
    failed = asyncio.run(score_samples(batch, rm))
    assert failed == 0 and rm.forwards == 2  # 7 samples, batches of 4
    assert [s.reward for s in batch] == pytest.approx(expected, abs=1e-6)

    async def direct():
        return await asyncio.gather(*(rm(s) for s in samples()))

    assert asyncio.run(direct()) == pytest.approx(expected, abs=1e-6)
    assert rm.forwards == 4


def test_a_folder_without_a_trained_head_is_refused(tiny_model_dir):
    rm = RewardModel(RewardModelConfig(path=str(tiny_model_dir), device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match=r"is not a trained sequence-classification model \(missing weights: score"):
        rm.score(samples())


def test_reward_fn_rm_needs_the_path(tmp_path):
    with pytest.raises(ConfigError) as exc:
        build_config(None, {"reward.fn": "rm"})
    assert str(exc.value) == "invalid config:\n  rm.path: reward.fn rm needs the reward model's folder"
    with pytest.raises(ConfigError) as exc:
        build_config(None, {"reward.fn": "rm", "rm.path": str(tmp_path / "nope"), "rm.dtype": "fp16"})
    assert str(exc.value) == (
        f"invalid config:\n  rm.path: {str(tmp_path / 'nope')!r} is not a folder (a Hugging Face model saved with "
        "save_pretrained)\n  rm.dtype: one of auto, float32, bfloat16, got 'fp16'"
    )
    # the rm group is only checked when the reward model scores
    assert build_config(None, {"rm.dtype": "fp16"}).rm.dtype == "fp16"


def test_grpo_run_trains_on_the_reward_models_scores(tiny_model_dir, rm_dir, tmp_path, monkeypatch):
    steps: list[list[Sample]] = []
    real = tidal.loop.RolloutManager.generate

    def spy(self, records, step):
        out = real(self, records, step)
        steps.append(out)
        return out

    monkeypatch.setattr(tidal.loop.RolloutManager, "generate", spy)
    cfg = loop_config(
        tiny_model_dir,
        tmp_path / "run",
        **{
            "train.num_steps": 2,
            "reward.fn": "rm",
            "rm.path": str(rm_dir),
            "rm.device": "cpu",
            "rm.dtype": "float32",
            "rm.batch_size": 8,
        },
    )
    history = tidal.loop.train(cfg)
    assert [h["step"] for h in history] == [1, 2] and len(steps) == 2
    reference = RewardModel(RewardModelConfig(path=str(rm_dir), device="cpu", dtype="float32"))
    for h, batch in zip(history, steps, strict=True):
        assert all(MESSAGES_KEY in s.metadata for s in batch)  # scored on the reward model's own template
        rewards = [s.reward for s in batch]
        assert rewards == pytest.approx(reference.score(batch), abs=1e-5)
        assert len(set(rewards)) > 1
        assert h["reward/mean"] == pytest.approx(statistics.fmean(rewards), abs=1e-5)
