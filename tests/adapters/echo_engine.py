"""A made-up engine kind's adapter, for tests/test_backends.py: a step-based core (the
`tidal.contracts.EngineCore` contract) that answers every request with its prompt's last token,
repeated `max_new_tokens` times, each with log-prob 0. It takes the trainer's weights by name and
fingerprints what it holds, so the in-process weight sync checks it as it checks tidal's engine."""

from __future__ import annotations

from pathlib import Path

import torch

from tidal.contracts import RequestOutput, SamplingParams
from tidal.engine.weights import read_safetensors_dir, weights_checksum


class EchoCore:
    partial_updates = False
    takes_images = False

    def __init__(self, model_dir: str | Path, tokenizer, dtype: str = "auto") -> None:
        self.model_dir, self.tokenizer = str(model_dir), tokenizer
        self.dtype = torch.float32
        self.max_model_len = 1024
        self.weight_version = 0
        self.weights: dict[str, torch.Tensor] = {}
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already running")
        self.requests[request_id] = (list(prompt_ids), params, [])

    def _output(self, rid: str, finish: str) -> RequestOutput:
        prompt, _, tokens = self.requests.pop(rid)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
        return RequestOutput(
            request_id=rid,
            token_ids=tokens,
            log_probs=[0.0] * len(tokens),
            finish_reason=finish,
            text=text,
            weight_version=self.weight_version,
            prompt_tokens=len(prompt),
        )

    def step(self) -> list[RequestOutput]:
        done = []
        for rid, (prompt, params, tokens) in list(self.requests.items()):
            tokens.append(prompt[-1])
            if len(tokens) >= params.max_new_tokens:
                done.append(self._output(rid, "length"))
        return done

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str | None = None) -> list[RequestOutput]:
        rids = list(self.requests) if request_id is None else [r for r in [request_id] if r in self.requests]
        return [self._output(rid, "abort") for rid in rids]

    def update_weights_from_tensors(self, named, version: int | None = None, **kw) -> None:
        self.weights = {n: t.detach().to(self.dtype, copy=True) for n, t in named}
        self.weight_version = self.weight_version + 1 if version is None else version

    def update_weights_from_disk(self, path: str | Path, version: int | None = None) -> None:
        self.update_weights_from_tensors(read_safetensors_dir(path).items(), version)

    def weights_checksum(self) -> str:
        return weights_checksum(self.weights.items(), self.dtype)

    def flush_cache(self) -> bool:
        return True

    def stats(self) -> dict:
        return {"running": len(self.requests)}

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass
