"""The LLM-judge reward (`reward.fn: judge`): each sample's prompt, response and label are
written into `judge.prompt_template` and sent as one chat message to an OpenAI-compatible
server (`judge.url`, e.g. another `tidal serve`); the score is read from the answer.

Requests are greedy (temperature 0), at most `judge.concurrency` in flight. A request that
times out (`judge.timeout`), loses its connection or gets HTTP 429/5xx is tried again up to
`judge.retries` times after ``reward.backoff * 2**k`` seconds; one that still fails,
any other HTTP error, or an answer with no score fails that sample only (status FAILED, the error
naming the judge's URL), like any failed reward. The API key is read from the environment variable
named by `judge.api_key_env` and only ever put in the Authorization header.

With `judge.path` instead of `judge.url`, tidal serves the judge model itself for the run
(`tidal.reward.local_judge`): the same requests go to that server on a loopback port, with the
key it was started with; `close()` gives it back, and the last judge to close stops it.
"""

from __future__ import annotations

import asyncio
import os
import re
import weakref

import httpx

from tidal.reward.options import JudgeConfig
from tidal.reward.verifiers import _TEXT_NUMBER_RE, parse_number
from tidal.types import Sample

__all__ = ["JudgeError", "JudgeReward", "read_score"]

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class JudgeError(RuntimeError):
    """The judge answered, but not with a score: an HTTP error, a malformed body, no number."""


def read_score(answer: str, regex: str = "") -> float | None:
    """The score in a judge's answer, clipped to [0, 1]; None when there is none.

    With `regex` the last match counts (its first group when it has groups); without, the last
    number in the text (integers, decimals, fractions such as ``3/4``)."""
    if regex:
        matches = list(re.finditer(regex, answer))
        if not matches:
            return None
        last = matches[-1]
        text = last.group(1) if last.re.groups else last.group(0)
        value = parse_number(text or "")
    else:
        last = None
        for last in _TEXT_NUMBER_RE.finditer(answer):  # noqa: B007 - only the final match is wanted
            pass
        value = None if last is None else parse_number((last.group("sign") or "") + last.group("body"))
    if value is None:
        return None
    return min(1.0, max(0.0, float(value)))


class JudgeReward:
    """``await judge(sample) -> float``: one judge request per sample (see the module docstring).

    It bounds its own calls (``own_limits``), so `score_rollout` does not add
    `reward.timeout` and `reward.retries` on top of the judge's own."""

    own_limits = True
    __name__ = "judge"

    def __init__(self, cfg: JudgeConfig, backoff: float = 1.0) -> None:
        """`backoff`: seconds before the first retry, doubling after each (`reward.backoff`).
        With `judge.path` the local judge starts here (the model loads), before any rollout."""
        self._local = None
        if cfg.path:
            from tidal.reward import local_judge

            self._local = local_judge.acquire(cfg)
            self.url = self._local.url
            key: str | None = self._local.api_key
        else:
            self.url = cfg.url.rstrip("/")
            key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        self.model = cfg.model
        self.template = cfg.prompt_template
        self.max_tokens = cfg.max_tokens
        self.timeout = cfg.timeout
        self.retries = cfg.retries
        self.backoff = backoff
        self.regex = cfg.score_regex
        self.concurrency = cfg.concurrency
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        # An httpx client and a semaphore belong to the event loop they were made on; tests and
        # evaluation may score on more than one loop, so each loop gets its own pair.
        self._per_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:  # never the headers: they hold the key
        return f"JudgeReward(url={self.url!r}, model={self.model!r})"

    def close(self) -> None:
        """Give back the local judge (`judge.path`; the last user stops its server and engine).
        Nothing to do for a remote judge; calling it twice is harmless."""
        local, self._local = self._local, None
        if local is not None:
            from tidal.reward import local_judge

            local_judge.release(local)

    def _state(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        state = self._per_loop.get(loop)
        if state is None:
            limits = httpx.Limits(max_connections=self.concurrency)
            client = httpx.AsyncClient(headers=self._headers, timeout=self.timeout, limits=limits)
            state = self._per_loop[loop] = (client, asyncio.Semaphore(self.concurrency))
        return state

    def request(self, sample: Sample) -> dict:
        """The chat-completions body asking the judge about `sample`."""
        content = self.template.format(prompt=sample.prompt, response=sample.response, label=sample.label)
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        }

    async def __call__(self, sample: Sample) -> float:
        answer = await self.ask(self.request(sample))
        score = read_score(answer, self.regex)
        if score is None:
            how = f"a match of {self.regex!r}" if self.regex else "a number"
            raise JudgeError(f"judge {self.url} answered without a score ({how}): {answer[-200:]!r}")
        return score

    async def ask(self, body: dict) -> str:
        """POST `body` to ``<url>/chat/completions`` with retries; the answer's text."""
        client, semaphore = self._state()
        tries = self.retries + 1
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            last = attempt == tries - 1
            try:
                async with semaphore:  # not held while backing off
                    response = await client.post(f"{self.url}/chat/completions", json=body)
            except httpx.TimeoutException as e:
                if last:
                    raise TimeoutError(
                        f"judge {self.url} did not answer within {self.timeout:g} s ({tries} tries)"
                    ) from e
                continue
            except httpx.TransportError as e:
                if last:
                    raise ConnectionError(f"judge {self.url} unreachable ({tries} tries): {e!r}") from e
                continue
            if response.status_code in _RETRY_STATUS and not last:
                continue
            if response.status_code != 200:
                tried = f" ({attempt + 1} tries)" if attempt else ""
                raise JudgeError(
                    f"judge {self.url} answered HTTP {response.status_code}{tried}: {response.text[:200]!r}"
                )
            try:
                return response.json()["choices"][0]["message"]["content"] or ""
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise JudgeError(
                    f"judge {self.url} answered with no choices[0].message.content: {response.text[:200]!r}"
                ) from e
        raise AssertionError("unreachable: the last try returns or raises")
