"""The `engine` option group: which rollout engine runs (`kind`, a record of `tidal.backends`), the
settings of tidal's own engine, and how to reach servers (URLs, router, SGLang launch, API key)."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.backends import ENGINES, QUANTIZATIONS
from tidal.options import Need, one_of, opt

MAX_AUTO_KV_TOKENS = 32768
BLOCK_SIZE = 16  # tokens of tidal's paged KV cache per block
API_KEY_ENV = "TIDAL_API_KEY"  # the servers' API key when engine.api_key(_file) gives none; `tidal serve`'s too
ENGINE_DTYPES = ("auto", "bfloat16", "float32")
WEB = ("http://", "https://")


@dataclass
class EngineConfig:
    kind: str = opt(
        "tidal", " | ".join(f"{k.name} ({k.summary})" for k in ENGINES.values()) + " (records in tidal.backends)"
    )
    dtype: str = opt(
        "auto",
        "engine weights: auto (bfloat16 where the hardware computes it natively, else float32) | bfloat16 | float32",
    )
    urls: list = opt(
        [],
        "servers: URLs of running servers (`tidal serve` or SGLang's launch_server), e.g. [http://127.0.0.1:30000]; "
        "sglang: empty = launch them",
    )
    router_url: str | None = opt(
        None,
        "sglang: a running sglang-router in front of engine.urls; generation goes through it, control and weight "
        "calls to each server",
    )
    launch_router: bool = opt(False, "sglang: start sglang-router in front of the servers tidal launches")
    sglang_python: str = opt(
        "", "sglang: the Python that runs sglang.launch_server and sglang_router (empty = this one)"
    )
    sglang_args: list = opt([], "sglang: extra launch_server flags, e.g. [--mem-fraction-static, '0.7']")
    quantization: str = opt(
        "none",
        "tidal engine: low-precision linear layers for rollout, the trainer stays in full precision (pair with "
        "algo.is_correction): " + " | ".join(f"{q.name} ({q.summary})" for q in QUANTIZATIONS.values()),
    )
    pack_weights: bool = opt(
        True,
        "tidal engine, float32 on a CPU: run decode's linear layers from copies packed for oneDNN (faster; "
        "re-packed at every weight load; a second copy of the linear weights in memory)",
    )
    cuda_graphs: bool = opt(
        True,
        "tidal engine on a GPU: replay pure decode steps from CUDA graphs captured at start, one per batch-size "
        "bucket up to max_num_seqs (off: the same kernels launched one by one)",
    )
    batch_invariant: bool = opt(
        False,
        "tidal engine: compute each sequence as it would be computed alone (tidal.invariant), so its tokens do "
        "not depend on the other requests of a step and its log-probs equal a trainer's with "
        "train.batch_invariant (bit for bit on a CPU); no packed weights, fused or native kernels, and on a GPU "
        "no CUDA graphs and float64 products (slower)",
    )
    state_snapshots: int = opt(
        32,
        "tidal engine, hybrid models (recurrent layers): snapshots of a sequence's recurrent states kept every 64 "
        "tokens it computes, so a later request sharing that prefix (an agent's next turn) starts from them instead "
        "of computing it again; 0 = always compute it again (each snapshot holds every recurrent layer's state)",
    )
    kv_cache_tokens: int = opt(
        0,
        "tidal engine: KV cache size in tokens, the memory budget (0 = what one rollout step needs: "
        "rollout_batch_size x (data.max_prompt_length + n_samples_per_prompt x max_new_tokens), at most 32768)",
    )
    max_num_seqs: int = opt(256, "tidal engine: sequences decoded at once")
    request_timeout: float = opt(300.0, "seconds one generate request to a server may take")
    api_key: str | None = opt(
        None,
        "servers: their API key (else the first line of engine.api_key_file, else $TIDAL_API_KEY). Never written: "
        "config.json, the report and wandb show <redacted>. Prefer the file or the variable: a command line is "
        "visible to other users of the machine (ps) and stays in shell history",
        secret=True,
    )
    api_key_file: str | None = opt(
        None, "servers: a file whose first line is their API key (the path is recorded, never the key)"
    )

    def cache_tokens(self, prompts: int, samples_per_prompt: int, response_tokens: int, max_prompt_length: int) -> int:
        """`kv_cache_tokens`, or when it is 0 the KV slots one rollout call needs: each of `prompts`
        prompts once (a group shares its prompt's blocks), plus `samples_per_prompt` responses of
        `response_tokens`, plus a block of rounding per sequence; at most 32768. A bigger call still
        runs: requests wait for blocks or are preempted, never dropped.

            prompts * (max_prompt_length + samples_per_prompt * response_tokens)
              + prompts * (samples_per_prompt + 1) * BLOCK_SIZE"""
        if self.kv_cache_tokens:
            return self.kv_cache_tokens
        n = samples_per_prompt
        need = prompts * (max_prompt_length + n * response_tokens) + prompts * (n + 1) * BLOCK_SIZE
        return min(need, MAX_AUTO_KV_TOKENS)

    def check(self, need: Need) -> None:
        """What this group can say alone; `tidal.config` checks the kind against the other groups."""
        one_of(need, "engine.kind", self.kind, ENGINES)
        one_of(need, "engine.dtype", self.dtype, ENGINE_DTYPES)
        one_of(need, "engine.quantization", self.quantization, QUANTIZATIONS)
        need(
            self.kv_cache_tokens == 0 or self.kv_cache_tokens >= 16,
            f"engine.kv_cache_tokens: 0 (sized from the workload) or >= 16, got {self.kv_cache_tokens}",
        )
        need(self.max_num_seqs >= 1, f"engine.max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        need(self.request_timeout > 0, "engine.request_timeout: must be > 0 seconds")
        need(
            all(isinstance(u, str) and u.startswith(WEB) for u in self.urls),
            f"engine.urls: http(s):// URLs of servers, got {self.urls!r}",
        )
        need(
            all(isinstance(a, str) for a in self.sglang_args),
            f"engine.sglang_args: a list of strings (flags and their values), got {self.sglang_args!r}",
        )
        kind = ENGINES.get(self.kind)
        if kind is None:
            return
        need(
            self.quantization in kind.quantizations,
            f"engine.quantization: engine.kind {self.kind} runs {', '.join(kind.quantizations)}; "
            f"got {self.quantization!r} (other engines quantize by their own options)",
        )
        need(
            not self.batch_invariant or "batch_invariant" in kind.core_options,
            f"engine.batch_invariant: tidal's engine computes under batch-invariant numerics; engine.kind "
            f"{self.kind} does not",
        )
        need(
            not self.batch_invariant or self.quantization == "none",
            f"engine.batch_invariant: the trainer computes full-precision layers, so engine.quantization must be "
            f"none, got {self.quantization!r}",
        )
        if kind.servers == "attach":
            need(bool(self.urls), f"engine.urls: engine.kind {self.kind} needs a list of server URLs")
        elif not kind.servers:
            need(not self.urls, f"engine.urls: engine.kind {self.kind} runs in this process; it takes no URLs")
        need(
            self.router_url is None or (kind.router and bool(self.urls)),
            "engine.router_url: a router in front of engine.urls, the servers behind it (weight and control calls go "
            "to each of them); engine.kind " + " or ".join(k.name for k in ENGINES.values() if k.router),
        )
        need(
            not self.launch_router or (kind.router and kind.servers == "launch" and not self.urls),
            "engine.launch_router: starts sglang-router in front of the servers tidal launches (no engine.urls); for "
            "servers you started, give your router's engine.router_url",
        )
