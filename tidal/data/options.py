"""The `data` option group: the prompt file or built-in env, its keys, the chat template, length
limits and the shuffle (`tidal.data.load`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tidal.options import Need, opt


@dataclass
class DataConfig:
    path: str = opt("env:arithmetic", "prompt file (.jsonl/.json/.parquet) or env:<name> for a built-in task")
    env_args: dict = opt({}, "keyword arguments of the env, e.g. {level: 1, n: 2000, seed: 0}")
    input_key: str = opt("prompt", "field holding the prompt (a string or a list of chat messages)")
    label_key: str = opt("label", "field holding the reference answer given to the reward")
    metadata_key: str = opt("metadata", "field holding a dict passed through to the sample")
    apply_chat_template: bool = opt(True, "wrap prompts with the tokenizer's chat template")
    system_prompt: str | None = opt(None, "system message prepended when the chat template is applied")
    max_prompt_length: int = opt(256, "prompts with more tokens are dropped (counted in the log)")
    max_image_pixels: int = opt(
        4096 * 4096, "a vision-language model's prompt images: one with more pixels stops the run, naming it"
    )
    response_key: str = opt("response", "sft: field holding the response when rows are prompt/response pairs")
    messages_key: str = opt("messages", "sft: field holding a chat (list of role/content messages)")
    max_length: int = opt(1024, "sft: samples with more tokens are dropped (counted in the log)")
    shuffle: bool = opt(True, "reshuffle the prompts every epoch")
    seed: int = opt(0, "seed of the per-epoch shuffle")
    streaming: bool = opt(
        False, "read a .jsonl/.parquet prompt file lazily (for files bigger than memory) instead of all at start"
    )
    shuffle_buffer: int = opt(
        10000, "streaming: rows held at once; each prompt is drawn at random from them (1 = file order)"
    )

    def check(self, need: Need) -> None:
        if not self.path.startswith("env:"):
            need(Path(self.path).exists(), f"data.path: file {self.path!r} does not exist (or use env:arithmetic)")
        need(self.max_prompt_length >= 1, "data.max_prompt_length: must be >= 1")
        need(self.max_image_pixels >= 1, "data.max_image_pixels: must be >= 1")
        need(self.shuffle_buffer >= 1, f"data.shuffle_buffer: must be >= 1, got {self.shuffle_buffer}")
        if self.streaming:
            need(
                Path(self.path).suffix.lower() in (".jsonl", ".parquet"),
                f"data.streaming: reads .jsonl or .parquet files, got data.path {self.path!r}",
            )
