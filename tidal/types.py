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


class RunStopped(RuntimeError):
    """The run stopped itself for the reason its message names (too many failed samples, too many
    bad optimizer steps in a row); `tidal train` prints it without a traceback and exits 1."""


class InputError(ValueError):
    """A file the run reads (a data file, a checkpoint) is not what it must be; the message names
    the file (and the line or row where there is one) and what was expected. `tidal train` and
    `tidal eval` print it without a traceback and exit 1."""


@dataclass
class Sample:
    """One prompt + one sampled response, token-exact.

    `tokens` holds prompt then response ids; the last `response_length` of them are the response.
    `loss_mask`, `rollout_log_probs` and `token_versions` have one entry per response token: the
    mask is 0 on tokens the policy did not sample (tool output, user turns), the log-probs come
    from the engine that sampled them, the version is the weights that sampled each token (-1 on
    tokens the policy did not sample). `weight_version` is the oldest version of any sampled token.

    A multi-turn sample grows with `append_policy` (sampled ids, as the engine returned them) and
    `append_env` (ids the environment adds), which keep all four aligned. Text is for humans and
    rewards: tokens are never re-encoded from it.
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
    token_versions: list[int] = field(default_factory=list)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length :]

    @property
    def policy_versions(self) -> list[int]:
        """The weight version of each sampled (loss-masked-in or not) policy token."""
        return [v for v in self.token_versions if v >= 0]

    def append_policy(self, token_ids: list[int], log_probs: list[float], version: int, text: str = "") -> None:
        """Append tokens the policy sampled, with the engine's log-prob of each and the weight
        version that sampled them; they are trained on (mask 1). Raises ValueError on misaligned
        input, leaving the sample unchanged."""
        self._check_aligned()
        if len(log_probs) != len(token_ids):
            raise ValueError(
                f"sample {self.index}: append_policy got {len(token_ids)} token ids but {len(log_probs)} log-probs"
            )
        if version < 0:
            raise ValueError(f"sample {self.index}: append_policy needs a weight version >= 0, got {version}")
        self.weight_version = version if not self.policy_versions else min(self.weight_version, version)
        self._extend(token_ids, [1] * len(token_ids), [float(x) for x in log_probs], [version] * len(token_ids), text)

    def append_env(self, token_ids: list[int], text: str = "") -> None:
        """Append tokens the policy did not sample (tool output, a user turn, template glue): they
        are context for later turns, never trained on (mask 0, log-prob 0, version -1)."""
        self._check_aligned()
        n = len(token_ids)
        self._extend(token_ids, [0] * n, [0.0] * n, [-1] * n, text)

    def _extend(self, ids: list[int], mask: list[int], logps: list[float], versions: list[int], text: str) -> None:
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise ValueError(f"sample {self.index}: token ids must be non-negative ints")
        self.tokens.extend(ids)
        self.response_length += len(ids)
        self.loss_mask.extend(mask)
        self.rollout_log_probs.extend(logps)
        self.token_versions.extend(versions)
        self.response += text

    def _check_aligned(self) -> None:
        self.validate()
        if len(self.token_versions) != self.response_length:
            raise ValueError(
                f"sample {self.index}: token_versions has {len(self.token_versions)} entries, "
                f"expected response_length={self.response_length}"
            )

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
        for name in ("loss_mask", "rollout_log_probs", "token_versions"):
            got = len(getattr(self, name))
            if name == "token_versions" and got == 0:  # optional: samples from before versions were kept
                continue
            if got != n:
                raise ValueError(f"sample {self.index}: {name} has {got} entries, expected response_length={n}")
