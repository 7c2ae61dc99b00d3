"""The reward's option groups: `reward` (what scores a sample and the limits of each call), `judge`
(the LLM judge, `reward.fn: judge`), `rm` (a reward model, `reward.fn: rm`) and `sandbox` (where
model-written code runs)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from tidal.backends import DEVICES
from tidal.convert import BUNDLED_NAMES
from tidal.options import USER_CODE, Need, is_dotted, one_of, opt

SANDBOX_BACKENDS = ("auto", "bwrap", "rlimits")
SANDBOX_ENV = "TIDAL_SANDBOX_BACKEND"  # the process default backend; worker processes inherit it


@dataclass
class RewardConfig:
    fn: str = opt(
        "math",
        "math | exact_match | code_tests | judge (an LLM judge: the judge group) | rm (a reward model: the rm "
        "group) | your own `reward(sample)` "
        f"(sync or async) returning a float or a dict, given as {USER_CODE}",
    )
    group_fn: str = opt(
        "",
        "your own `group_reward(samples) -> list[float | dict]` (sync or async), called once per prompt's group "
        f"(pairwise or ranking judges) and scoring instead of reward.fn, given as {USER_CODE}",
    )
    key: str = opt("score", "key of the scalar to train on when the reward returns a dict")
    timeout: float = opt(60.0, "seconds one reward call may take before it is retried or the sample fails")
    workers: int = opt(
        8,
        "processes running a sync user reward (a call past reward.timeout has its process stopped); "
        "0 = threads, where a timed-out call keeps running in the background",
    )
    retries: int = opt(2, "tries again after a reward call times out or raises TimeoutError/ConnectionError")
    backoff: float = opt(1.0, "seconds before the first reward retry, doubling after each")

    def check(self, need: Need) -> None:
        if self.group_fn:
            need(is_dotted(self.group_fn), f"reward.group_fn: a dotted path or file.py:fn, got {self.group_fn!r}")
            # reward.fn always has a value (math by default), so "both set" means changed from it
            need(
                self.fn == "math",
                f"reward.group_fn: scores instead of reward.fn; set one of them, not both (reward.fn is {self.fn!r})",
            )
        need(self.timeout > 0, "reward.timeout: must be > 0 seconds")
        need(self.workers >= 0, f"reward.workers: must be >= 0 (0 = threads), got {self.workers}")
        need(self.retries >= 0, f"reward.retries: must be >= 0, got {self.retries}")
        need(self.backoff >= 0, f"reward.backoff: must be >= 0 seconds, got {self.backoff}")

    @property
    def judged(self) -> bool:
        """Whether the LLM judge scores (its group's options then apply)."""
        return self.fn == "judge" and not self.group_fn

    @property
    def uses_rm(self) -> bool:
        """Whether a reward model scores (the rm group's options then apply)."""
        return self.fn == "rm" and not self.group_fn


RM_DTYPES = ("auto", "float32", "bfloat16")  # the dtypes of models tidal loads to score (rm, a local judge)


@dataclass
class JudgeConfig:
    """An LLM judge (`reward.fn: judge`, `tidal.reward.judge`): behind an OpenAI-compatible server
    (`judge.url`), or a local model tidal serves itself (`judge.path`, `tidal.reward.local_judge`)."""

    url: str = opt("", "OpenAI-compatible base URL of the judge model, e.g. http://127.0.0.1:8000/v1 (or judge.path)")
    path: str = opt(
        "",
        "instead of judge.url: a local Hugging Face folder of an instruct model (or smollm2) that tidal serves "
        "itself for the run, on a loopback port, and asks as it asks a remote judge",
    )
    device: str = opt("auto", "auto | cpu | cuda: where a local judge (judge.path) computes")
    dtype: str = opt(
        "auto",
        "auto | float32 | bfloat16: a local judge's weights (auto: bfloat16 where the device computes it natively)",
    )
    max_model_len: int = opt(0, "a local judge's most tokens per request, prompt + answer (0: the model's own)")
    kv_cache_tokens: int = opt(16384, "a local judge's KV cache, in tokens across its requests in flight")
    model: str = opt("judge", "the `model` field of the judge's requests")
    prompt_template: str = opt(
        "Rate how well the response answers the question, from 0 (wrong) to 1 (fully correct).\n\n"
        "Question:\n{prompt}\n\nReference answer:\n{label}\n\nResponse:\n{response}\n\n"
        "End your reply with the score alone, a number from 0 to 1.",
        "the judge's user message, a format string with {prompt}, {response} and {label} (double other braces)",
    )
    max_tokens: int = opt(256, "most tokens of the judge's answer")
    timeout: float = opt(60.0, "seconds one judge request may take before it is retried")
    retries: int = opt(2, "tries again after a timeout, a lost connection, HTTP 429 or 5xx")
    concurrency: int = opt(16, "most judge requests in flight at once")
    score_regex: str = opt(
        "",
        "the score is the last match of this regex in the answer (its first group if it has one); "
        "empty: the last number. Clipped to [0, 1]",
    )
    api_key_env: str = opt("TIDAL_JUDGE_API_KEY", "environment variable holding the judge's API key (sent when set)")

    def check(self, need: Need) -> None:
        """Checked when the judge scores (`RewardConfig.judged`)."""
        if self.path:
            need(
                not self.url,
                f"judge.url: set judge.url (a judge server) or judge.path (a model tidal serves), not both; "
                f"got url {self.url!r} and path {self.path!r}",
            )
            need(
                self.path.lower() in BUNDLED_NAMES or os.path.isfile(os.path.join(self.path, "config.json")),
                f"judge.path: {self.path!r} is not a model folder (a Hugging Face folder with config.json) or smollm2",
            )
            one_of(need, "judge.device", self.device, DEVICES)
            one_of(need, "judge.dtype", self.dtype, RM_DTYPES)
            need(
                self.max_model_len >= 0,
                f"judge.max_model_len: must be >= 0 (0 = the model's), got {self.max_model_len}",
            )
            need(self.kv_cache_tokens >= 1, f"judge.kv_cache_tokens: must be >= 1, got {self.kv_cache_tokens}")
        else:
            need(
                self.url.startswith(("http://", "https://")),
                "judge.url: reward.fn judge needs the judge's http(s):// base URL (or judge.path, a local model "
                f"tidal serves), got {self.url!r}",
            )
        try:
            self.prompt_template.format(prompt="", response="", label="")
        except (KeyError, IndexError, ValueError) as e:
            need(
                False,
                f"judge.prompt_template: a format string with only {{prompt}}, {{response}} and {{label}} "
                f"(write other braces twice), failed with {type(e).__name__}: {e}",
            )
        if self.score_regex:
            try:
                re.compile(self.score_regex)
            except re.error as e:
                need(False, f"judge.score_regex: not a regular expression ({e})")
        need(self.max_tokens >= 1, f"judge.max_tokens: must be >= 1, got {self.max_tokens}")
        need(self.timeout > 0, f"judge.timeout: must be > 0 seconds, got {self.timeout}")
        need(self.retries >= 0, f"judge.retries: must be >= 0, got {self.retries}")
        need(self.concurrency >= 1, f"judge.concurrency: must be >= 1, got {self.concurrency}")


@dataclass
class RewardModelConfig:
    """A sequence-classification reward model (`reward.fn: rm`, `tidal.reward.reward_model`)."""

    path: str = opt(
        "",
        "local Hugging Face folder of the reward model: an AutoModelForSequenceClassification with num_labels 1 "
        "(its logit is the reward) and its tokenizer",
    )
    device: str = opt("auto", "auto | cpu | cuda: where the reward model computes (auto: cuda where torch sees a GPU)")
    dtype: str = opt(
        "auto", "auto | float32 | bfloat16 (auto: bfloat16 where the device computes it natively, else float32)"
    )
    batch_size: int = opt(16, "most samples in one forward of the reward model")
    max_length: int = opt(
        4096,
        "most tokens scored per sample; longer texts lose their start (truncated from the left), so the "
        "response and the last token the score is read at are kept",
    )
    chat_template: bool = opt(
        True,
        "score the conversation (prompt messages + the response as the assistant turn) rendered with the reward "
        "model's own chat template when its tokenizer has one; false, or no template: the prompt text + response",
    )

    def check(self, need: Need) -> None:
        """Checked when the reward model scores (`RewardConfig.uses_rm`)."""
        need(bool(self.path), "rm.path: reward.fn rm needs the reward model's folder")
        need(
            not self.path or os.path.isdir(self.path),
            f"rm.path: {self.path!r} is not a folder (a Hugging Face model saved with save_pretrained)",
        )
        one_of(need, "rm.device", self.device, DEVICES)
        one_of(need, "rm.dtype", self.dtype, RM_DTYPES)
        need(self.batch_size >= 1, f"rm.batch_size: must be >= 1, got {self.batch_size}")
        need(self.max_length >= 1, f"rm.max_length: must be >= 1, got {self.max_length}")


@dataclass
class CodeSandboxConfig:
    backend: str | None = opt(
        None,
        "where model-written code runs (the code_tests reward, the python tool): auto = bubblewrap, and the run "
        "refuses to start where it is not usable | bwrap | rlimits = resource limits only, NO isolation from the "
        "host's files, network and processes (an explicit opt-in; docs/faults.md, 'The code sandbox'); "
        "null = $TIDAL_SANDBOX_BACKEND, else auto",
    )

    def check(self, need: Need) -> None:
        # whether bubblewrap works here is the sandbox's to say: `tidal.reward.sandbox.check_run`,
        # called when a run or an evaluation starts, before anything is written
        if self.backend is None:
            env = os.environ.get(SANDBOX_ENV, "") or "auto"
            need(
                env in SANDBOX_BACKENDS,
                f"sandbox.backend: null, and ${SANDBOX_ENV} must be one of {', '.join(SANDBOX_BACKENDS)}, got {env!r}",
            )
        else:
            need(
                self.backend in SANDBOX_BACKENDS,
                f"sandbox.backend: one of {', '.join(SANDBOX_BACKENDS)} (or null), got {self.backend!r}",
            )
