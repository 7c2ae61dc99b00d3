"""Records that cross module seams. `Sample` is the one thing a rollout hands to training."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class Status(enum.StrEnum):
    COMPLETED = "completed"  # the engine stopped on an eos / stop token or stop string
    TRUNCATED = "truncated"  # hit max_new_tokens or the context limit
    ABORTED = "aborted"  # cut off by an abort; tokens so far are kept
    FAILED = "failed"  # generation or reward raised; see metadata["error"]


@dataclass
class Sample:
    """One prompt + one sampled response, token-exact.

    `tokens` holds prompt then response ids; the last `response_length` of them are the response.
    `loss_mask` and `rollout_log_probs` have one entry per response token: the mask is 0 on tokens
    the policy did not sample (tool output), the log-probs come from the engine that sampled them.
    """

    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    prompt: str = ""
    response: str = ""
    label: Any = None
    reward: float | dict | None = None
    status: Status = Status.COMPLETED
    group_index: int = 0
    index: int = 0
    weight_version: int = 0
    metadata: dict = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length :]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Sample:
        d = dict(d)
        d["status"] = Status(d.get("status", Status.COMPLETED))
        return cls(**d)

    def validate(self) -> None:
        """Raise ValueError when the per-response-token fields disagree in length."""
        n = self.response_length
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"sample {self.index}: response_length {n} outside 0..{len(self.tokens)}")
        for name in ("loss_mask", "rollout_log_probs"):
            got = len(getattr(self, name))
            if got != n:
                raise ValueError(f"sample {self.index}: {name} has {got} entries, expected response_length={n}")
