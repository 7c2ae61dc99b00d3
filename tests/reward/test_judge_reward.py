"""reward.fn judge: the request it sends, reading the score, the concurrency limit, retries, a
judge that times out (that sample fails, the others are scored), and a real `tidal serve` as judge.

Most tests use a stand-in judge: a FastAPI app answering OpenAI chat completions with text the test
chose, from the prompt it was sent (`score=<x>` in the response under judgement). No test depends on
how fast the machine is: the concurrency test waits for whole batches to arrive rather than timing
them, and the timeout test's judge holds its answer until the test ends."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx
import pytest
from fastapi import FastAPI, Request

from tidal.config import Config, validate
from tidal.options import ConfigError
from tidal.reward.failures import ErrorLog
from tidal.reward.judge import JudgeReward, read_score
from tidal.reward.options import JudgeConfig, RewardConfig
from tidal.reward.score import score_rollout
from tidal.rollout.manager import load_rewards
from tidal.server.app import BackgroundServer
from tidal.server.options import ServerConfig
from tidal.types import Sample, Status

KEY = "sk-judge-7f3a9c"
TEMPLATE = "Q: {prompt}\nA: {response}\nRef: {label}\nScore it."


class StandIn:
    """A stand-in judge. It answers ``score is <x>`` for a response holding ``score=<x>``, and:
    ``fail=<n>``: HTTP 500 to the first n requests for that response; ``bad``: HTTP 400; ``slow``:
    no answer until `release` is set; ``batch``: wait until the `batch` requests of its batch arrived."""

    def __init__(self, batch: int = 0) -> None:
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.seen: dict[str, int] = {}
        self.active = self.max_active = self.arrived = 0
        self.batch = batch
        self.release = False
        app = FastAPI()
        app.post("/v1/chat/completions")(self.chat)
        self.server = BackgroundServer(app).start()
        self.url = f"{self.server.url}/v1"

    async def wait_for(self, ok) -> None:
        deadline = time.monotonic() + 60
        while not ok() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def chat(self, request: Request) -> dict:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("authorization"))
        text = body["messages"][0]["content"]
        self.seen[text] = self.seen.get(text, 0) + 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.batch:
                self.arrived += 1
                last = -(-self.arrived // self.batch) * self.batch  # the end of this request's batch
                await self.wait_for(lambda: self.arrived >= last)
            if "slow" in text:
                await self.wait_for(lambda: self.release)
            fail = re.search(r"fail=(\d+)", text)
            if fail and self.seen[text] <= int(fail.group(1)):
                from fastapi.responses import JSONResponse

                return JSONResponse({"error": "overloaded"}, status_code=500)
            if "bad" in text:
                from fastapi.responses import JSONResponse

                return JSONResponse({"error": "no such model"}, status_code=400)
            score = re.search(r"score=(\S+)", text)
            content = f"Reasoning... score is {score.group(1)}" if score else "I cannot say."
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}
        finally:
            self.active -= 1

    def close(self) -> None:
        self.release = True
        self.server.stop()


@pytest.fixture
def stand_in():
    judges: list[StandIn] = []

    def make(**kw) -> StandIn:
        judges.append(StandIn(**kw))
        return judges[-1]

    yield make
    for j in judges:
        j.close()


REWARD = RewardConfig(fn="judge", backoff=0.0)


def config(url: str, **kw) -> JudgeConfig:
    return JudgeConfig(url=url, **{"prompt_template": TEMPLATE, "model": "judge-m", **kw})


def judge_of(cfg: JudgeConfig):
    return load_rewards(REWARD, cfg)


def samples(*responses: str) -> list[Sample]:
    return [Sample(prompt=f"p{i}", response=r, label=i, index=i, group_index=i) for i, r in enumerate(responses)]


def score(cfg: JudgeConfig, batch: list[Sample], errors: ErrorLog | None = None) -> int:
    reward_fn, group_fn = judge_of(cfg)
    assert isinstance(reward_fn, JudgeReward) and group_fn is None
    return asyncio.run(score_rollout(batch, reward_fn, REWARD, 1.0, errors or ErrorLog()))


def test_read_score():
    assert read_score("so the score is 0.8.") == 0.8
    assert read_score("1 of 2 tries; overall 7/10") == 0.7
    assert read_score("score: 3") == 1.0  # clipped
    assert read_score("score: -2") == 0.0
    assert read_score("no idea") is None
    assert read_score("1 2 SCORE: 0.25 then 9", r"SCORE: (\S+)") == 0.25
    assert read_score("[[0.5]] and [[0.75]]", r"\[\[[\d.]+\]\]") is None  # the whole match is not a number
    assert read_score("[[0.5]] and [[0.75]]", r"\[\[([\d.]+)\]\]") == 0.75


def test_request_shape_key_and_scores(stand_in, monkeypatch, caplog):
    judge = stand_in()
    monkeypatch.setenv("TIDAL_JUDGE_API_KEY", KEY)
    batch = samples("x score=0.75", "y score=1", "nothing to read")
    with caplog.at_level(logging.WARNING):
        assert score(config(judge.url, max_tokens=32), batch) == 1
    assert next(b for b in judge.bodies if "p0" in b["messages"][0]["content"]) == {
        "model": "judge-m",
        "messages": [{"role": "user", "content": "Q: p0\nA: x score=0.75\nRef: 0\nScore it."}],
        "max_tokens": 32,
        "temperature": 0.0,
    }
    assert judge.auth == [f"Bearer {KEY}"] * 3
    assert [s.reward for s in batch] == [0.75, 1.0, 0.0]
    assert [s.status for s in batch] == [Status.COMPLETED, Status.COMPLETED, Status.FAILED]
    assert batch[2].metadata["error"] == (
        f"JudgeError: judge {judge.url} answered without a score (a number): 'I cannot say.'"
    )
    assert KEY not in caplog.text and KEY not in repr(judge_of(config(judge.url))[0])


def test_concurrency_limit_is_reached_and_never_exceeded(stand_in):
    judge = stand_in(batch=3)  # each request waits for its batch of 3: a serial client would time out
    batch = samples(*[f"r{i} score=0.5" for i in range(9)])
    assert score(config(judge.url, concurrency=3, timeout=60.0), batch) == 0
    assert [s.reward for s in batch] == [0.5] * 9
    assert (judge.arrived, judge.max_active) == (9, 3)


def test_retries_after_a_server_error_and_not_after_a_client_error(stand_in):
    judge = stand_in()
    batch = samples("a fail=1 score=0.25", "b fail=5 score=1", "bad")
    assert score(config(judge.url, retries=1), batch) == 2
    assert batch[0].reward == 0.25 and batch[0].status == Status.COMPLETED
    assert (
        batch[1].metadata["error"]
        == f"""JudgeError: judge {judge.url} answered HTTP 500 (2 tries): '{{"error":"overloaded"}}'"""
    )
    assert batch[2].metadata["error"] == (
        f"""JudgeError: judge {judge.url} answered HTTP 400: '{{"error":"no such model"}}'"""
    )
    assert sorted(judge.seen.values()) == [1, 2, 2]  # the 400 is not tried again


def test_a_judge_that_times_out_fails_only_its_sample(stand_in):
    judge = stand_in()
    batch = samples("x score=0.5", "slow score=1", "z score=0.25")
    errors = ErrorLog()
    # judge_timeout bounds each request; reward.timeout (60 s) and its retries are not added
    assert score(config(judge.url, timeout=10.0, retries=1), batch, errors) == 1
    assert [s.status for s in batch] == [Status.COMPLETED, Status.FAILED, Status.COMPLETED]
    assert [s.reward for s in batch] == [0.5, 0.0, 0.25]
    assert batch[1].metadata["error"] == f"TimeoutError: judge {judge.url} did not answer within 10 s (2 tries)"
    assert judge.seen["Q: p1\nA: slow score=1\nRef: 1\nScore it."] == 2  # judge_retries + 1, no more
    assert errors.total == {"TimeoutError": 1}


def test_config_names_the_keys():
    cfg = Config()
    cfg.reward.fn = "judge"
    cfg.judge.prompt_template = "{prompt} {answer}"
    cfg.judge.score_regex = "("
    cfg.judge.concurrency = 0
    with pytest.raises(ConfigError) as exc:
        validate(cfg)
    assert str(exc.value).split("\n")[1:] == [
        "  judge.url: reward.fn judge needs the judge's http(s):// base URL (or judge.path, a local model tidal "
        "serves), got ''",
        "  judge.prompt_template: a format string with only {prompt}, {response} and {label} (write other "
        "braces twice), failed with KeyError: 'answer'",
        "  judge.score_regex: not a regular expression (missing ), unterminated subpattern at position 0)",
        "  judge.concurrency: must be >= 1, got 0",
    ]


def test_a_real_tidal_serve_as_judge(tiny_model_dir, monkeypatch):
    """The request shape works end to end: the judge's answer is exactly what the server answers the
    same chat request (greedy), and the key is sent (the server refuses requests without it)."""
    from tidal.adapters.async_engine import AsyncEngine
    from tidal.convert import load_tokenizer
    from tidal.engine.llm_engine import LLMEngine
    from tidal.server.app import build_app

    core = LLMEngine(tiny_model_dir, load_tokenizer(tiny_model_dir), dtype="float32", kv_cache_tokens=4096)
    served = AsyncEngine(core)
    server = BackgroundServer(build_app(served, "tiny", ServerConfig(api_key=KEY))).start()
    try:
        url = f"{server.url}/v1"
        cfg = config(url, model="tiny", max_tokens=8, score_regex=r"(.+)")
        batch = samples("4")
        judge = judge_of(cfg)[0]
        body = judge.request(batch[0])
        direct = httpx.post(
            f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        )
        answer = direct.json()["choices"][0]["message"]["content"]
        assert direct.json()["usage"]["completion_tokens"] <= 8

        monkeypatch.delenv("TIDAL_JUDGE_API_KEY", raising=False)
        refused = samples("4")
        score(cfg, refused)
        assert refused[0].metadata["error"].startswith(f"JudgeError: judge {url} answered HTTP 401: ")

        monkeypatch.setenv("TIDAL_JUDGE_API_KEY", KEY)
        score(cfg, batch)
        expected = read_score(answer, r"(.+)")
        if expected is None:  # the tiny random model's greedy text is rarely a number
            assert batch[0].metadata["error"] == (
                f"JudgeError: judge {url} answered without a score (a match of '(.+)'): {answer[-200:]!r}"
            )
        else:
            assert batch[0].reward == expected
    finally:
        server.stop()
        served.close()
