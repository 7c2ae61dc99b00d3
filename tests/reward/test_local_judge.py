"""reward.fn judge with judge.path: tidal serves the judge model itself. Its scores equal the score
read from transformers' greedy answer to the same rendered chat prompt, an answer with no score
fails its sample with the exact message, the config's refusals, the server shared and stopped
with its last user, and a GRPO run judged by a local model.

The judge is a tiny random Llama whose output rows for ``0``, ``1`` and ``x`` are made large (the
generator seed picked so that answers start ``10``, ``11`` or ``110``, depending on the prompt):
with ``score_regex: ^1(\\d)`` some answers score 0, some 1; with ``^1(1)`` some fail."""

from __future__ import annotations

import asyncio
import statistics

import httpx
import pytest
import torch
from conftest import hf_greedy, loop_config, make_model, make_tokenizer

import tidal.loop
from tidal.config import Config, validate
from tidal.options import ConfigError
from tidal.reward import local_judge
from tidal.reward.failures import ErrorLog
from tidal.reward.judge import JudgeReward, read_score
from tidal.reward.options import JudgeConfig, RewardConfig
from tidal.reward.score import score_rollout
from tidal.types import Sample, Status

TEMPLATE = "Q: {prompt}\nA: {response}\nRef: {label}\nScore it."
REWARD = RewardConfig(fn="judge")


def make_judge_model():
    """The tiny judge: untied output rows for 0, 1 and x scaled up, so it answers in those."""
    tok = make_tokenizer()
    model = make_model(seed=0, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        scale = 20 * model.lm_head.weight.std()
        for ch in "01x":
            row = tok.convert_tokens_to_ids(tok.tokenize(ch))[0]
            model.lm_head.weight[row] = scale * torch.randn(model.lm_head.weight.shape[1], generator=g)
    return model


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_judge")
    make_judge_model().save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def judge_model():
    return make_judge_model().eval()


def config(path, **kw) -> JudgeConfig:
    values = {"prompt_template": TEMPLATE, "device": "cpu", "dtype": "float32", "max_tokens": 4}
    return JudgeConfig(path=str(path), kv_cache_tokens=4096, **{**values, **kw})


def samples(n: int = 12) -> list[Sample]:
    return [
        Sample(prompt=f"What is {i}+{i}?", response=f"It is {i * 7}", label=i, index=i, group_index=i) for i in range(n)
    ]


def direct_answer(model, cfg: JudgeConfig, sample: Sample) -> str:
    """transformers' greedy answer to the judge prompt, rendered with the judge's chat template."""
    tok = make_tokenizer()
    content = cfg.prompt_template.format(prompt=sample.prompt, response=sample.response, label=sample.label)
    messages = [{"role": "user", "content": content}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return tok.decode(hf_greedy(model, ids["input_ids"], cfg.max_tokens), skip_special_tokens=True)


def check_scores(model, cfg: JudgeConfig, batch: list[Sample], url: str) -> list[float | None]:
    """Each sample's reward is the score read from the direct answer; one with none failed with the
    judge's message. The direct scores, None for the failed."""
    expected = []
    for s in batch:
        answer = direct_answer(model, cfg, s)
        score = read_score(answer, cfg.score_regex)
        expected.append(score)
        if score is None:
            assert s.status == Status.FAILED
            assert s.metadata["error"] == (
                f"JudgeError: judge {url} answered without a score (a match of {cfg.score_regex!r}): {answer!r}"
            )
        else:
            assert s.status != Status.FAILED and s.reward == score
    return expected


@pytest.mark.parametrize("regex", [r"^1(\d)", r"^1(1)"])
def test_local_judge_scores_equal_the_direct_greedy_answers(judge_dir, judge_model, regex):
    cfg = config(judge_dir, score_regex=regex)
    judge = JudgeReward(cfg, backoff=0.0)
    try:
        assert judge.url.startswith("http://127.0.0.1:") and judge.url.endswith("/v1")
        batch = samples()
        asyncio.run(score_rollout(batch, judge, REWARD, 1.0, ErrorLog()))
        expected = check_scores(judge_model, cfg, batch, judge.url)
    finally:
        judge.close()
    if regex == r"^1(\d)":  # the answers differ by prompt: both scores occur
        assert set(expected) == {0.0, 1.0}
    else:  # answers starting 10 have no match: those samples fail, the others score 1
        assert set(expected) == {None, 1.0}


def test_one_server_per_process_stopped_by_its_last_user(judge_dir):
    first = JudgeReward(config(judge_dir))
    second = JudgeReward(config(judge_dir, score_regex="(.+)"))  # the same model: the same server
    assert first.url == second.url and len(local_judge.running()) == 1
    server = local_judge.running()[0]
    assert server.users == 2
    # a request without the server's key is refused: the loopback port is no open door
    refused = httpx.post(f"{first.url}/chat/completions", json=first.request(samples(1)[0]), timeout=60)
    assert refused.status_code == 401
    first.close()
    first.close()  # twice is harmless
    assert local_judge.running() == [server] and server.users == 1
    second.close()
    assert local_judge.running() == []
    assert not server.server.thread.is_alive() and not server.engine._thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{first.url}/models", timeout=5)


def test_config_refusals(judge_dir, tmp_path):
    cfg = Config()
    cfg.reward.fn = "judge"
    cfg.judge.url = "http://127.0.0.1:8000/v1"
    cfg.judge.path = str(tmp_path)
    cfg.judge.device = "tpu"
    cfg.judge.dtype = "float16"
    cfg.judge.max_model_len = -1
    cfg.judge.kv_cache_tokens = 0
    with pytest.raises(ConfigError) as exc:
        validate(cfg)
    assert str(exc.value).split("\n")[1:] == [
        "  judge.url: set judge.url (a judge server) or judge.path (a model tidal serves), not both; got url "
        f"'http://127.0.0.1:8000/v1' and path {str(tmp_path)!r}",
        f"  judge.path: {str(tmp_path)!r} is not a model folder (a Hugging Face folder with config.json) or smollm2",
        "  judge.device: one of auto, cpu, cuda, got 'tpu'",
        "  judge.dtype: one of auto, float32, bfloat16, got 'float16'",
        "  judge.max_model_len: must be >= 0 (0 = the model's), got -1",
        "  judge.kv_cache_tokens: must be >= 1, got 0",
    ]
    cfg = Config()
    cfg.reward.fn = "judge"
    cfg.judge.path = str(judge_dir)
    validate(cfg)  # a model folder alone is a complete judge
    cfg.judge.path = "SmolLM2"
    validate(cfg)


def test_grpo_run_judged_by_a_local_model(tiny_model_dir, judge_dir, judge_model, tmp_path, monkeypatch):
    steps: list[list[Sample]] = []
    urls: list[str] = []
    real = tidal.loop.RolloutManager.generate

    def spy(self, records, step):
        out = real(self, records, step)
        steps.append(out)
        urls.append(self.reward_fn.url)
        return out

    monkeypatch.setattr(tidal.loop.RolloutManager, "generate", spy)
    values = {"path": str(judge_dir), "device": "cpu", "dtype": "float32", "max_tokens": 4, "kv_cache_tokens": 4096}
    run = loop_config(
        tiny_model_dir,
        tmp_path / "run",
        **{
            "train.num_steps": 2,
            "reward.fn": "judge",
            "judge.prompt_template": TEMPLATE,
            "judge.score_regex": r"^1(\d)",
            **{f"judge.{k}": v for k, v in values.items()},
        },
    )
    history = tidal.loop.train(run)
    assert [h["step"] for h in history] == [1, 2] and len(steps) == 2
    cfg = config(judge_dir, score_regex=r"^1(\d)")
    for h, batch in zip(history, steps, strict=True):
        expected = check_scores(judge_model, cfg, batch, urls[0])
        assert None not in expected  # every answer starts 1 and a digit: no sample failed
        assert h["reward/mean"] == pytest.approx(statistics.fmean(expected))
    # the judge's server ended with the run: no server left, its port closed
    assert local_judge.running() == []
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{urls[0]}/models", timeout=5)
