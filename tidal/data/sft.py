"""Supervised fine-tuning data: read rows and turn them into token-exact `Sample`s.

A row is either a chat (`messages`: a list of `{"role", "content"}` dicts) or a prompt/response
pair. The trainer minimises the negative log-likelihood of the response tokens whose loss mask is 1,
so what matters here is exactly which tokens get a 1:

* chat: the tokens of every assistant turn, i.e. its content and the template's end-of-turn token
  (`<|im_end|>` for ChatML) so the model learns to stop. The assistant header
  (`<|im_start|>assistant\\n`), other turns and any whitespace the template puts after the
  end-of-turn token stay at 0. The turns are located by rendering growing prefixes of the chat,
  which only works for prefix-stable templates; others are rejected with a clear error.
* pair: the response text followed by the tokenizer's eos token, all trained.

The sample's prompt is everything before the first trainable token; the response runs from there
to the last trainable token (anything after it would never contribute to the loss).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tidal.data.dataset import DataError, _json_type_name, read_rows
from tidal.types import Sample, Status

ROLES = ("system", "user", "assistant", "tool")


def _encode(tokenizer: Any, text: str) -> list[int]:
    # Rendered templates already carry the special tokens the model expects (as in dataset.py).
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer: Any, messages: list[dict], where: str, add_generation_prompt: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as err:
        raise DataError(f"{where}: the chat template failed on the first {len(messages)} messages: {err}") from err
    if not isinstance(text, str):
        raise DataError(f"{where}: the chat template returned {_json_type_name(text)}, expected a string")
    return text


def _special_ids(tokenizer: Any) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    # Chat markers such as <|im_start|> / <|im_end|> are often added tokens rather than named specials.
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        raise DataError("the tokenizer has no eos token, which SFT pairs need to end the response")
    return int(eos)


def _check_messages(messages: Any, key: str, where: str) -> list[dict]:
    if not isinstance(messages, list):
        raise DataError(f"{where}: {key!r} must be a list of messages, got {_json_type_name(messages)}")
    if not messages:
        raise DataError(f"{where}: {key!r} is an empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {key!r} message {i} must be an object, got {_json_type_name(m)}")
        for field in ("role", "content"):
            if field not in m:
                raise DataError(f"{where}: {key!r} message {i} is missing key {field!r}")
        role = m["role"]
        if not isinstance(role, str) or role not in ROLES:
            raise DataError(f"{where}: {key!r} message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise DataError(
                f"{where}: {key!r} message {i} 'content' must be a string, got {_json_type_name(m['content'])}"
            )
    return messages


def _with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    if system_prompt is None or any(m["role"] == "system" for m in messages):
        return list(messages)
    return [{"role": "system", "content": system_prompt}, *messages]


def _prefix_ids(
    tokenizer: Any, full_text: str, full_ids: list[int], messages: list[dict], where: str, generation: bool
) -> int:
    """Render `messages`, check it is a prefix of the whole chat (text and tokens); return its token count."""
    text = _render(tokenizer, messages, where, add_generation_prompt=generation)
    what = f"the first {len(messages)} messages" + (" with the generation prompt" if generation else "")
    if not full_text.startswith(text):
        raise DataError(
            f"{where}: the chat template is not prefix-stable: rendering {what} is not a prefix of rendering "
            "the whole chat, so assistant turns cannot be located (use a template that renders earlier turns "
            "the same whatever follows them)"
        )
    ids = _encode(tokenizer, text)
    if full_ids[: len(ids)] != ids:
        raise DataError(
            f"{where}: the chat template is not prefix-stable token-wise: the tokens of {what} are not a prefix "
            "of the tokens of the whole chat (the tokenizer merges text across the turn boundary)"
        )
    return len(ids)


def _chat_tokens(
    tokenizer: Any, messages: list[dict], key: str, where: str, special_ids: frozenset[int]
) -> tuple[list[int], list[int]]:
    """Tokenize a chat; return its token ids and a 0/1 mask over them marking assistant turns."""
    assistant_turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_turns:
        raise DataError(f"{where}: {key!r} has no assistant message, so there is nothing to train on")
    if assistant_turns[0] == 0:
        raise DataError(f"{where}: {key!r} starts with an assistant message; put a user message before it")

    full_text = _render(tokenizer, messages, where, add_generation_prompt=False)
    ids = _encode(tokenizer, full_text)
    mask = [0] * len(ids)
    previous_end = 0
    for k in assistant_turns:
        start = _prefix_ids(tokenizer, full_text, ids, messages[:k], where, generation=True)
        end = _prefix_ids(tokenizer, full_text, ids, messages[: k + 1], where, generation=False)
        if start < previous_end or end < start:
            raise DataError(
                f"{where}: the chat template is not prefix-stable: assistant message {k} does not render after "
                "the turns before it"
            )
        # Train up to and including the last special token of the turn (the end-of-turn marker); what
        # the template puts after it (ChatML's "\n") is never generated, so it is not trained.
        last_special = max((i for i in range(start, end) if ids[i] in special_ids), default=end - 1)
        for i in range(start, last_special + 1):
            mask[i] = 1
        previous_end = end
    if 1 not in mask:
        raise DataError(
            f"{where}: the assistant messages in {key!r} render to no tokens, so there is nothing to train on"
        )
    return ids, mask


def build_sft_samples(
    rows: Iterable[tuple[int, dict]],
    tokenizer: Any,
    *,
    source: str,
    messages_key: str = "messages",
    prompt_key: str = "prompt",
    response_key: str = "response",
    max_length: int = 1024,
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
) -> tuple[list[Sample], int]:
    """Turn `(number, row)` pairs into SFT `Sample`s.

    Returns the samples and how many rows were dropped for having more than `max_length` tokens.
    `source` names `source:number` in error messages and in each sample's `metadata["source"]`.
    """
    if system_prompt is not None and not apply_chat_template:
        raise DataError("system_prompt needs apply_chat_template=True")
    if max_length < 1:
        raise DataError(f"max_length must be >= 1, got {max_length}")
    special_ids = _special_ids(tokenizer)

    samples: list[Sample] = []
    dropped = 0
    for index, (number, row) in enumerate(rows):
        where = f"{source}:{number}"
        # Parquet fills a column a row lacks with None, so None means "absent" for every key.
        if row.get(messages_key) is not None:
            if not apply_chat_template:
                raise DataError(f"{where}: {messages_key!r} is a chat, which needs apply_chat_template=True")
            messages = _with_system(_check_messages(row[messages_key], messages_key, where), system_prompt)
            tokens, mask = _chat_tokens(tokenizer, messages, messages_key, where, special_ids)
            first, last = mask.index(1), len(mask) - mask[::-1].index(1)
            tokens, loss_mask = tokens[:last], mask[first:last]
        elif row.get(prompt_key) is not None or row.get(response_key) is not None:
            prompt, response = row.get(prompt_key), row.get(response_key)
            for key, value in ((prompt_key, prompt), (response_key, response)):
                if value is None:
                    raise DataError(
                        f"{where}: missing key {key!r} (a pair row needs {prompt_key!r} and {response_key!r})"
                    )
            if not isinstance(response, str):
                raise DataError(f"{where}: {response_key!r} must be a string, got {_json_type_name(response)}")
            if isinstance(prompt, str):
                if apply_chat_template:
                    messages = _with_system([{"role": "user", "content": prompt}], system_prompt)
                    prompt_text = _render(tokenizer, messages, where, add_generation_prompt=True)
                else:
                    prompt_text = prompt
            elif isinstance(prompt, list):
                if not apply_chat_template:
                    raise DataError(
                        f"{where}: {prompt_key!r} is a list of messages, which needs apply_chat_template=True"
                    )
                messages = _with_system(_check_messages(prompt, prompt_key, where), system_prompt)
                prompt_text = _render(tokenizer, messages, where, add_generation_prompt=True)
            else:
                raise DataError(
                    f"{where}: {prompt_key!r} must be a string or a list of messages, got {_json_type_name(prompt)}"
                )
            # The response is appended as tokens, not re-templated: this is what generation produces.
            response_ids = _encode(tokenizer, response) + [_eos_id(tokenizer)]
            tokens = _encode(tokenizer, prompt_text) + response_ids
            loss_mask = [1] * len(response_ids)
        else:
            raise DataError(
                f"{where}: missing key {messages_key!r} (a chat) or {prompt_key!r} and {response_key!r} (a pair)"
            )

        if len(tokens) > max_length:
            dropped += 1
            continue
        n = len(loss_mask)
        sample = Sample(
            tokens=tokens,
            response_length=n,
            loss_mask=loss_mask,
            rollout_log_probs=[0.0] * n,
            prompt=tokenizer.decode(tokens[: len(tokens) - n]),
            response=tokenizer.decode(tokens[len(tokens) - n :]),
            label=None,
            reward=None,
            status=Status.COMPLETED,
            index=index,
            metadata={"source": where},
        )
        sample.validate()
        samples.append(sample)
    return samples, dropped


def load_sft_samples(path: str | Path, tokenizer: Any, **options: Any) -> tuple[list[Sample], int]:
    """Read a `.jsonl` / `.json` / `.parquet` file into SFT samples; returns (samples, rows dropped
    for having more than `max_length` tokens). `options` are those of `build_sft_samples`."""
    return build_sft_samples(read_rows(path), tokenizer, source=str(path), **options)
