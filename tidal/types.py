"""Records that cross module seams. `Sample` is the one thing a rollout hands to training."""

from __future__ import annotations

import base64
import dataclasses
import enum
import math
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


NO_RECORD = -1  # a routed-experts entry at a token position the engine did not record
_NO_RECORD_BYTES = NO_RECORD.to_bytes(2, "little", signed=True)


@dataclass(frozen=True)
class RoutedExperts:
    """The experts each MoE layer chose at each token position, as the engine computed them
    (routing replay, `algo.routing_replay`).

    `shape` is (positions, moe_layers, top_k); `data` holds that many int16 values, C order,
    little-endian: entry [p, l, j] is the j-th expert MoE layer l chose for the hidden state at
    token position p, in the router's own order. A position with any entry `NO_RECORD` (-1) has
    no record: the trainer routes it itself. Bytes rather than a tensor keep this module free of
    torch, pickle compactly (Ray) and encode as base64 (`to_dict`): 4k positions × 48 layers ×
    top-8 is 3 MB, 4 MB as text. `tidal.moe.routing_record` / `routing_tensor` convert."""

    shape: tuple[int, int, int]
    data: bytes

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if len(shape) != 3 or any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in shape):
            raise ValueError(f"routed experts: shape must be 3 non-negative ints, got {self.shape!r}")
        if len(self.data) != 2 * math.prod(shape):
            raise ValueError(f"routed experts: shape {shape} needs {2 * math.prod(shape)} bytes, got {len(self.data)}")
        object.__setattr__(self, "shape", shape)

    @property
    def positions(self) -> int:
        return self.shape[0]

    def padded(self, positions: int) -> RoutedExperts:
        """The same record over `positions` >= self.positions, the new positions with no record."""
        extra = positions - self.shape[0]
        if extra < 0:
            raise ValueError(f"routed experts: cannot pad {self.shape[0]} positions down to {positions}")
        return RoutedExperts(
            (positions, *self.shape[1:]), self.data + _NO_RECORD_BYTES * (extra * self.shape[1] * self.shape[2])
        )

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "int16": base64.b64encode(self.data).decode("ascii")}

    @classmethod
    def from_dict(cls, d: dict) -> RoutedExperts:
        return cls(tuple(d["shape"]), base64.b64decode(d["int16"]))


@dataclass
class Sample:
    """One prompt + one sampled response, token-exact.

    What a reward reads (`tidal.RewardFn`; docs/your-task.md lists every field): `prompt` is the
    exact text the model saw (after the chat template), `response` the sampled text (special
    tokens removed), `label` the row's label as the data file has it, `metadata` the row's
    metadata dict plus `prompt_index` and what the generate function recorded, `status` how
    generation ended, `reward` what a generate function or agent already set (else None),
    `group_index` the prompt's group in the step and `index` the sample's position in it.

    `tokens` holds prompt then response ids; the last `response_length` of them are the response.
    `loss_mask`, `rollout_log_probs` and `token_versions` have one entry per response token: the
    mask is 0 on tokens the policy did not sample (tool output, user turns), the log-probs come
    from the engine that sampled them, the version is the weights that sampled each token (-1 on
    tokens the policy did not sample). `weight_version` is the oldest version of any sampled token.

    A multi-turn sample grows with `append_policy` (sampled ids, as the engine returned them) and
    `append_env` (ids the environment adds), which keep all four aligned. Text is for humans and
    rewards: tokens are never re-encoded from it.

    `routed_experts` (MoE models, None otherwise): the experts the engine's MoE layers chose at
    token positions 0 .. len(tokens) - 2, every position whose forward predicts a next token, so
    its shape is (len(tokens) - 1, moe_layers, top_k). Set it with `set_routed_experts` (the
    engine's record of the final request, which covers the whole sample up to its last sampled
    token); `append_policy` / `append_env` extend it with positions that have no record, so it
    always covers len(tokens) - 1 positions and the trainer routes the unrecorded ones itself.
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
    routed_experts: RoutedExperts | None = None
    # a vision-language prompt's images (`tidal.vision.Image`), in the order of their placeholder
    # tokens; one list object shared by a group's samples
    images: list = field(default_factory=list)

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
        if self.routed_experts is not None:  # the new positions were not computed by the recorded forward
            self.routed_experts = self.routed_experts.padded(len(self.tokens) + len(ids) - 1)
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

    def set_routed_experts(self, routing: RoutedExperts | None) -> None:
        """Set the engine's record of the experts chosen at positions 0 .. m - 1, where m is at
        most len(tokens) - 1 (no forward computes the last token); the positions after m get no
        record. None clears it. Raises ValueError, leaving the sample unchanged, when m is larger."""
        if routing is None:
            self.routed_experts = None
            return
        n = max(len(self.tokens) - 1, 0)
        if routing.positions > n:
            raise ValueError(
                f"sample {self.index}: routed experts cover {routing.positions} positions, "
                f"but a sample of {len(self.tokens)} tokens has {n} that predict a next token"
            )
        self.routed_experts = routing.padded(n)

    def to_dict(self) -> dict:
        """A JSON-ready dict (routed experts as shape + base64 int16, see `RoutedExperts`)."""
        d = asdict(dataclasses.replace(self, routed_experts=None, images=[]))  # asdict would keep raw bytes
        d["status"] = self.status.value
        d["routed_experts"] = None if self.routed_experts is None else self.routed_experts.to_dict()
        d["images"] = [image.to_dict() for image in self.images]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Sample:
        d = dict(d)
        d["status"] = Status(d.get("status", Status.COMPLETED))
        routing = d.get("routed_experts")
        if isinstance(routing, dict):
            d["routed_experts"] = RoutedExperts.from_dict(routing)
        if d.get("images"):
            from tidal.vision import Image

            d["images"] = [Image.from_dict(image) for image in d["images"]]
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
        if self.routed_experts is not None and self.routed_experts.positions != max(len(self.tokens) - 1, 0):
            raise ValueError(
                f"sample {self.index}: routed_experts covers {self.routed_experts.positions} positions, "
                f"expected len(tokens) - 1 = {len(self.tokens) - 1}"
            )
