"""The reward-model reward (`reward.fn: rm`): a sequence-classification model with one label
(`transformers.AutoModelForSequenceClassification`, `num_labels=1`) scores each sample; the reward
is its logit at the last token,

    reward(sample) = head(h_T)    h_T: the model's last hidden state at the text's last non-pad token

What it reads (`text_of`): with `rm.chat_template` and a reward-model tokenizer that has a chat
template, the conversation (the prompt's messages, then the response as the assistant turn)
rendered with the reward model's own template, since a reward model is trained on its own format;
otherwise the prompt text as the policy saw it followed by the response. Texts longer than
`rm.max_length` tokens lose their start: the response and the last token, where the score is
read, are what the model judges.

Batching: the rollout awaits one reward call per sample, concurrently (`score_samples`).
`RewardModel.__call__` queues its sample and waits; one batcher task per event loop takes every
sample queued by then (all the calls started in the same event-loop tick, and those that arrived
during the previous forward), scores them in forwards of at most `rm.batch_size` in a thread
(`asyncio.to_thread`, so the loop keeps serving the engine) and resolves each call. A step's
samples thus go through in ceil(n / batch_size) forwards, not n.

The model loads once per process, on the first batch; every `RewardModel` of the same folder,
device and dtype (the rollout's, each evaluation set's) shares it. A forward cannot be interrupted, so the
reward bounds its own calls (``own_limits``): `reward.timeout` and `reward.retries` do not apply.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

import torch

from tidal.hardware import resolve_device, resolve_dtype
from tidal.reward.options import RewardModelConfig
from tidal.types import Sample

__all__ = ["MESSAGES_KEY", "RewardModel"]

# the sample metadata key the rollout stores the prompt's chat messages under when the reward asks
# for them (``wants_messages``): the reward model renders them with its own template
MESSAGES_KEY = "prompt_messages"

# (path, device, dtype) -> (model, tokenizer): one copy in memory whatever reads it
_LOADED: dict[tuple[str, str, str], tuple[Any, Any]] = {}
_LOAD_LOCK = threading.Lock()


class RewardModel:
    """``await rm(sample) -> float``, batched across concurrent calls (see the module docstring);
    `score(samples)` scores a list directly, in batches of `rm.batch_size`."""

    own_limits = True
    wants_messages = True
    __name__ = "rm"

    def __init__(self, cfg: RewardModelConfig) -> None:
        self.cfg = cfg
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: torch.device | None = None
        # queued (sample, future) pairs and the batcher task, per event loop: futures belong to
        # the loop they were made on, and evaluation may score on another loop than the rollout
        self._queues: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.forwards = 0  # forwards run so far (how well calls were batched)

    def __repr__(self) -> str:
        return f"RewardModel(path={self.cfg.path!r})"

    def load(self) -> None:
        """Load the model and tokenizer from `rm.path` onto `rm.device` (once per process)."""
        if self.model is not None:
            return
        device = torch.device(resolve_device(self.cfg.device, "rm.device").device)
        # auto: bf16 where the device computes it natively (as engine.dtype), else float32
        dtype = resolve_dtype(self.cfg.dtype, "rm.dtype", device.type).dtype
        key = (self.cfg.path, str(device), dtype)
        with _LOAD_LOCK:
            if key not in _LOADED:
                _LOADED[key] = _load(self.cfg.path, device, dtype)
            self.model, self.tokenizer = _LOADED[key]
        self.device = device

    def text_of(self, sample: Sample) -> tuple[str, bool]:
        """(the text the reward model scores for `sample`, whether it is a rendered chat template,
        which carries its own special tokens)."""
        messages = sample.metadata.get(MESSAGES_KEY)
        if self.cfg.chat_template and messages and getattr(self.tokenizer, "chat_template", None):
            chat = [*messages, {"role": "assistant", "content": sample.response}]
            return self.tokenizer.apply_chat_template(chat, tokenize=False), True
        return sample.prompt + sample.response, False

    def encode(self, sample: Sample) -> list[int]:
        """The token ids scored for `sample`: `text_of`, at most `rm.max_length`, cut from the left."""
        text, templated = self.text_of(sample)
        ids = self.tokenizer(text, add_special_tokens=not templated)["input_ids"]
        return ids[-self.cfg.max_length :]

    @torch.inference_mode()
    def forward(self, ids: list[list[int]]) -> list[float]:
        """One forward over token id lists of any lengths, padded on the right (the attention mask
        hides the padding, and the head reads each row's last non-pad token); the scalar logits."""
        width = max(len(x) for x in ids)
        pad = self.model.config.pad_token_id
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device))
        self.forwards += 1
        return out.logits[:, 0].float().cpu().tolist()

    def score(self, samples: list[Sample]) -> list[float]:
        """The reward of each sample, in forwards of at most `rm.batch_size` (loads the model first).

        The samples go into forwards by length, so each pads to a length close to its own (a long
        response padding short ones wastes the compute it saves); the scores come back in order."""
        self.load()
        ids = [self.encode(s) for s in samples]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        n = self.cfg.batch_size
        scores = [0.0] * len(ids)
        for start in range(0, len(order), n):
            chunk = order[start : start + n]
            for i, r in zip(chunk, self.forward([ids[i] for i in chunk]), strict=True):
                scores[i] = r
        return scores

    async def __call__(self, sample: Sample) -> float:
        loop = asyncio.get_running_loop()
        state = self._queues.get(loop)
        if state is None:
            state = self._queues[loop] = {"queue": [], "task": None}
        future = loop.create_future()
        state["queue"].append((sample, future))
        if state["task"] is None or state["task"].done():
            # created now, first run after the calls already scheduled in this tick have queued
            state["task"] = loop.create_task(self._batcher(state))
        return await future

    async def _batcher(self, state: dict) -> None:
        """Score what is queued, then what queued meanwhile, until the queue is empty."""
        while state["queue"]:
            # a call cancelled while waiting (its caller's deadline) needs no score
            batch = [(s, f) for s, f in state["queue"] if not f.done()]
            state["queue"] = []
            if not batch:
                continue
            try:
                scores = await asyncio.to_thread(self.score, [s for s, _ in batch])
            except Exception as e:  # every waiting sample fails with the cause, the batcher goes on
                for _, f in batch:
                    if not f.done():
                        f.set_exception(e)
                continue
            for (_, f), score in zip(batch, scores, strict=True):
                if not f.done():
                    f.set_result(score)


def _load(path: str, device: torch.device, dtype: str) -> tuple[Any, Any]:
    """The reward model in `path` on `device` in `dtype`, and its tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=getattr(torch, dtype), output_loading_info=True
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    # a folder without a trained head (a causal LM's) loads with a random one: scores would be noise
    if info["missing_keys"]:
        missing = ", ".join(sorted(info["missing_keys"])[:3])
        raise ValueError(f"rm.path: {path} is not a trained sequence-classification model (missing weights: {missing})")
    if model.config.num_labels != 1:
        raise ValueError(f"rm.path: {path} has {model.config.num_labels} labels; a reward model has 1")
    # the head reads the last token that is not `pad_token_id`; batches of more than one
    # need it, so a model saved without one gets its tokenizer's (or its end-of-text) token
    if model.config.pad_token_id is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError(f"rm.path: {path} has neither a pad nor an end-of-text token to pad with")
        model.config.pad_token_id = pad
    return model.to(device).eval(), tokenizer
