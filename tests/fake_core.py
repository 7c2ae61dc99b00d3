"""A scripted fake core engine, step-based like `LLMEngine`: each step() appends one token to every
request. Token k of a request is `expected_tokens(prompt, n)[k]`, its log-prob `-(k + 1) / 10`.
Shared by the server tests (tests/server) and the HTTP client's (tests/adapters)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.contracts import SamplingParams


@dataclass
class RequestOutput:
    """Stand-in for `tidal.engine.llm_engine.RequestOutput`."""

    top_logprobs = None

    request_id: str
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    text: str
    weight_version: int
    prompt_tokens: int
    cached_tokens: int


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    return [3 + (sum(prompt) + k) % 250 for k in range(n)]


def expected_logprobs(n: int) -> list[float]:
    return [-(k + 1) / 10 for k in range(n)]


class FakeCore:
    """A scripted, step-based core engine that records every call made to it."""

    partial_updates = False
    takes_images = False

    def __init__(self, tokenizer, max_model_len: int = 64, step_delay: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.weight_version = 0
        self.reqs: dict[str, dict] = {}
        self.params: dict[str, SamplingParams] = {}  # every request ever added
        self.prompts: dict[str, list[int]] = {}
        self.seen_prompts: set[tuple[int, ...]] = set()
        self.step_calls = 0
        self.threads: set[int] = set()
        self.received: list[tuple[dict[str, torch.Tensor], int | None]] = []
        self.disk_loads: list[tuple[str, int | None]] = []
        self.flushes = 0
        self.fail_next_step = False

    def _call(self) -> None:
        self.threads.add(threading.get_ident())

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self._call()
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}")
        if request_id in self.reqs:
            raise ValueError(f"duplicate request id {request_id}")
        cached = len(prompt_ids) - 1 if tuple(prompt_ids) in self.seen_prompts else 0
        self.seen_prompts.add(tuple(prompt_ids))
        self.reqs[request_id] = {"prompt": list(prompt_ids), "params": params, "tokens": [], "cached": cached}
        self.params[request_id] = params
        self.prompts[request_id] = list(prompt_ids)

    def _output(self, rid: str, reason: str) -> RequestOutput:
        r = self.reqs.pop(rid)
        toks = r["tokens"]
        return RequestOutput(
            rid,
            list(toks),
            expected_logprobs(len(toks)),
            reason,
            self.tokenizer.decode(toks),
            self.weight_version,
            len(r["prompt"]),
            r["cached"],
        )

    def step(self) -> list[RequestOutput]:
        self._call()
        self.step_calls += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        done = []
        for rid, r in list(self.reqs.items()):
            k = len(r["tokens"])
            tok = expected_tokens(r["prompt"], k + 1)[k]
            r["tokens"].append(tok)
            sp = r["params"]
            if tok in sp.stop_token_ids:
                done.append(self._output(rid, "stop"))
            elif len(r["tokens"]) >= sp.max_new_tokens or len(r["prompt"]) + len(r["tokens"]) >= self.max_model_len:
                done.append(self._output(rid, "length"))
        return done

    def has_unfinished(self) -> bool:
        self._call()
        return bool(self.reqs)

    def abort(self, request_id: str | None = None) -> list[RequestOutput]:
        self._call()
        rids = list(self.reqs) if request_id is None else [r for r in [request_id] if r in self.reqs]
        return [self._output(r, "abort") for r in rids]

    def update_weights_from_tensors(self, named, version: int | None = None, stage: bool = False) -> None:
        self._call()
        self.received.append((dict(named), version))
        if version is not None and not stage:
            self.weight_version = version

    def weights_checksum(self) -> str:
        return f"crc-of-{len(self.received)}-updates"

    def update_weights_from_disk(self, path: str, version: int | None = None) -> None:
        self._call()
        if not Path(path).exists():
            raise FileNotFoundError(f"no such directory: {path}")
        self.disk_loads.append((path, version))
        if version is not None:
            self.weight_version = version

    def flush_cache(self) -> bool:
        self._call()
        self.flushes += 1
        if self.reqs:
            return False
        self.seen_prompts.clear()
        return True

    def stats(self) -> dict:
        self._call()
        return {"running": len(self.reqs), "waiting": 0, "step_calls": self.step_calls}
