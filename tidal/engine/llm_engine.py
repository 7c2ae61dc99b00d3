"""tidal's embedded engine: continuous batching over a paged, prefix-shared KV cache.

    engine = LLMEngine("path/to/model", tokenizer)
    engine.add_request("r1", ids, params); engine.step()   # the step API (`tidal.contracts.EngineCore`)
    outs = engine.generate_batch(prompts, params)      # run a batch to completion (tests, benchmarks)

The rollout and the server reach it through `tidal.adapters.async_engine.AsyncEngine`, which drives
the step API on a thread of its own.

Each `step()` asks the scheduler which sequences run (decodes first, then admissions within the
token budget), runs one forward pass over all of them, samples one token per sequence, and
retires the finished ones at once. Memory is bounded by `kv_cache_tokens`; when it runs out,
requests wait or are preempted and recomputed, never dropped.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal import invariant, recurrent, vision
from tidal.contracts import EngineUnavailable, GenerationOutput, RequestOutput, SamplingParams, require_weights
from tidal.engine.block_manager import BlockManager
from tidal.engine.model_runner import ModelRunner
from tidal.engine.quant import PACKED, QUANTIZATIONS, Quantizer, packs
from tidal.engine.sampling import SamplingPlan, adjust_logits, sample_planned, scored_log_probs, top_logprobs
from tidal.engine.scheduler import Scheduler
from tidal.engine.sequence import SeqImages, SeqStatus, Sequence
from tidal.engine.state_slots import StateSlots
from tidal.engine.weights import (
    WeightStage,
    load_named_tensors,
    model_checksum,
    read_safetensors_dir,
)
from tidal.hardware import CPU, TORCH_DTYPES, host_values, is_cuda, keep_freed_memory, release_cached, weights_dtype

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    dtype: str = "auto"  # bfloat16 where the hardware computes it natively, else float32
    block_size: int = 16
    kv_cache_tokens: int = 32768  # the memory budget: token slots across all blocks
    max_num_seqs: int = 256  # sequences decoding at once
    max_num_batched_tokens: int = 2048  # tokens per forward pass (decode tokens + prefill tokens)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    device: str = CPU  # where the weights, the KV cache and the step's tensors live (resolved by the caller)
    quantization: str = "none"  # int8 (CPU) | fp8 (CUDA) linear layers: `tidal.engine.quant`
    # unquantized float32 on a CPU: linear layers from copies packed for oneDNN (`quant.PACKED`),
    # re-packed at every load; a second copy of the weights in memory
    pack_weights: bool = True
    # a CPU's decode attention read from the paged cache in place by a C kernel built on first use
    # (`tidal.engine.native`; float32 or bfloat16), else gathered and run by sdpa
    native_attention: bool = True
    # a GPU's pure decode steps replayed from CUDA graphs captured at start, one per batch-size
    # bucket up to max_num_seqs (`tidal.engine.cuda_graphs`); off: the same kernels launched one by one
    cuda_graphs: bool = True
    # such a decode step is launched before the last one's tokens are read back, so the host's
    # bookkeeping overlaps the GPU's work (`LLMEngine.step`)
    overlap_steps: bool = True
    # hybrid models: snapshots of the recurrent states kept for prefix-cache hits, taken every
    # `state_snapshot_tokens` tokens (a multiple of block_size) that a sequence computes
    # (`tidal.engine.state_slots`); 0: a prefix shared with an earlier request is computed again
    state_snapshots: int = 32
    state_snapshot_tokens: int = 64
    # steps under `tidal.invariant.numerics()`: a sequence's logits do not depend on the other
    # sequences of its step, and its log-probs are a trainer's under the same numerics
    # (`train.batch_invariant`), bit for bit on a CPU; without packed weights, fused or native
    # kernels, and on a GPU without CUDA graphs or the paged attention kernels
    batch_invariant: bool = False

    def validate(self) -> EngineConfig:
        if self.dtype not in ("auto", *TORCH_DTYPES):
            raise ValueError(f"engine dtype must be one of auto, {', '.join(TORCH_DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "kv_cache_tokens", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine {name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens ({self.kv_cache_tokens}) is smaller than one block")
        if self.state_snapshots < 0:
            raise ValueError(f"engine state_snapshots must be >= 0, got {self.state_snapshots}")
        if self.state_snapshot_tokens < 1 or self.state_snapshot_tokens % self.block_size:
            raise ValueError(
                f"engine state_snapshot_tokens must be a multiple of block_size ({self.block_size}), "
                f"got {self.state_snapshot_tokens}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"engine quantization: one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.batch_invariant and self.quantization != "none":
            raise ValueError(
                f"engine batch_invariant: the trainer computes full-precision layers, so quantization must be "
                f"none, got {self.quantization!r}"
            )
        return self


@dataclass
class _Launch:
    """A step whose tokens are sampled on the device and on their way to the host."""

    seqs: list[Sequence]
    fed: list[int]  # the position each sequence fed
    tokens: torch.Tensor  # [B] on the device: what the next step feeds when it overlaps
    host: torch.Tensor  # [2, B] float64 on the host (ids, log-probs), valid once `event` has passed
    tops: tuple[torch.Tensor, torch.Tensor] | None  # top log-probs [B, k] ids and values, on the host
    event: torch.cuda.Event | None  # recorded after the copies (None on a CPU: already done)
    sampling: SamplingPlan  # the rows' sampling parameters on the device
    draws: torch.Tensor  # [B] on the device: tokens each row had drawn before this step
    want_top: int  # the most top log-probs a row asks for
    # each sequence's output length at which it stops by length: min(max_new_tokens, the context
    # left after its prompt), so the per-sequence loops test one number
    limits: list[int]


class LLMEngine:
    """Meets `tidal.contracts.EngineCore`; see the module docstring."""

    partial_updates = True  # update_weights_from_tensors(partial=True): only the changed tensors
    takes_images = True  # add_request(..., images=...): a vision-language model's (`tidal.vision`)

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        tokenizer=None,
        config: EngineConfig | None = None,
        **overrides,
    ) -> None:
        cfg = config or EngineConfig()
        for k, v in overrides.items():
            if not hasattr(cfg, k):
                raise TypeError(f"unknown engine option {k!r}")
            setattr(cfg, k, v)
        self.cfg = cfg.validate()
        self.device = torch.device(cfg.device)
        dtype = weights_dtype(cfg.dtype, "engine dtype", self.device.type)
        if isinstance(model, torch.nn.Module):
            self.model = model.to(dtype)
        else:
            self.model = vision.load_pretrained(model, dtype)
        self.model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        # a vision-language model's family (`tidal.vision`); its language model's config
        self.vision = vision.family(self.model.config)
        text = vision.language_config(self.model.config)
        self.vocab_size = text.vocab_size
        self.max_model_len = cfg.max_model_len or getattr(text, "max_position_embeddings", 2048)
        why = invariant.unsupported(text.model_type, "engine batch_invariant") if cfg.batch_invariant else None
        if why:
            raise ValueError(why)
        if cfg.batch_invariant:  # the float64 attention's blocks, reused instead of faulted in each call
            keep_freed_memory(self.device)
        num_blocks = cfg.kv_cache_tokens // cfg.block_size
        # a hybrid model's running sequences each hold a slot of recurrent states, beside snapshots
        states = None
        if recurrent.mixers(self.model):
            states = StateSlots(cfg.max_num_seqs, cfg.state_snapshots, cfg.state_snapshot_tokens)
        self.blocks = BlockManager(num_blocks, cfg.block_size, states)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            cfg.block_size,
            self.device,
            cfg.native_attention,
            states.total if states else 0,
            cfg.batch_invariant,
        )
        kind = cfg.quantization
        if kind == "none":  # packed copies round as oneDNN's packed kernels do: not the trainer's
            packed = cfg.pack_weights and not cfg.batch_invariant and packs(self.device, dtype)
            kind = PACKED if packed else None
        self.quant = Quantizer(self.model, kind) if kind else None
        if self.quant is not None:
            self.runner.extra_bindings = self.quant.storage
        self.graphs_off: str | None = None  # why decode steps are not replayed from CUDA graphs
        if is_cuda(self.device):
            self.graphs_off = self.runner.use_static_decode(cfg.max_num_seqs, self.max_model_len, cfg.cuda_graphs)
            if not cfg.cuda_graphs:
                self.graphs_off = "engine cuda_graphs: false"
            elif self.graphs_off:
                log.warning("CUDA graphs off: %s", self.graphs_off)
        eos = getattr(self.model.config, "eos_token_id", None)
        eos = getattr(text, "eos_token_id", None) if eos is None else eos
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.weight_version = 0
        self._staged = WeightStage()
        self._checksum: str | None = None
        self.asleep = False
        self.seqs: dict[str, Sequence] = {}
        self._arrival = itertools.count()
        self._ids = itertools.count()
        self.counters = {
            "steps": 0,
            "prefill_tokens": 0,
            "prefill_tokens_copied": 0,  # twins' uncached tokens, copied from their twins (`Scheduler`)
            "decode_tokens": 0,
            "forward_s": 0.0,
            "quantize_s": 0.0,
            "overlapped_steps": 0,  # decode steps launched before the one before them was read
        }
        self._launched: _Launch | None = None  # a decode step in flight (`step`)
        # a vision-language model's image feature rows by image digest, for the current weights
        self._image_rows: OrderedDict[str, torch.Tensor] = OrderedDict()

    # ---------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        images: list[vision.Image] | None = None,
    ) -> str:
        """Queue a request; raises ValueError (naming the request) when it cannot be served.
        `images`: a vision-language model's images of the prompt, in order, each filling the next
        run of its placeholder tokens (`tidal.vision`)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        require_weights(f"request {rid}", self.asleep, self.weight_version)
        if rid in self.seqs:
            raise ValueError(f"request {rid}: id already in use")
        params.validate()
        if not prompt_ids:
            raise ValueError(f"request {rid}: the prompt is empty")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"request {rid}: prompt token ids must be ints in [0, {vocab})")
        outside = sorted(k for k in params.logit_bias if not 0 <= k < vocab)
        if outside:  # a bias on no token would silently do nothing
            raise ValueError(f"request {rid}: logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"request {rid}: the prompt has {len(prompt_ids)} tokens; the context holds {self.max_model_len}, "
                "so at most that minus one"
            )
        longest = min(len(prompt_ids) + params.max_new_tokens, self.max_model_len)
        slots = self.blocks.num_blocks * self.cfg.block_size
        if longest > slots:
            raise ValueError(
                f"request {rid}: prompt + max_new_tokens = {longest} tokens cannot fit in the KV cache "
                f"({slots} token slots); lower max_new_tokens or raise kv_cache_tokens"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {rid}: stop strings need an engine with a tokenizer")
        seq = Sequence(rid, list(prompt_ids), params, arrival=next(self._arrival))
        seq.images = self._images(rid, seq.prompt_ids, images or [])
        seq.stop_ids = frozenset((set() if params.ignore_eos else self.eos_ids) | set(params.stop_token_ids))
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def _images(self, rid: str, ids: list[int], images: list[vision.Image]) -> SeqImages | None:
        """The prompt's images as the engine runs them: each image's feature rows (the vision
        tower runs once per distinct image and weights), checked against the placeholders."""
        if self.vision is None:
            if images:
                raise ValueError(f"request {rid}: {self.model.config.model_type} takes no images")
            return None
        where = vision.placeholders(ids, vision.image_token(self.model.config))
        rows = [self._image_features(im) for im in images]
        vision.check_counts(where, [len(r) for r in rows], f"request {rid}")
        if not images:
            return None
        seq = SeqImages(images, where, torch.cat(rows), vision.token_keys(ids, where, [len(r) for r in rows], images))
        if self.vision.mrope:
            seq.rope, seq.delta = vision.rope_positions(self.model, ids, where, images)
        if self.vision.bidirectional:
            seq.blocks = vision.image_blocks(where)
        return seq

    @torch.inference_mode()
    def _image_features(self, image: vision.Image) -> torch.Tensor:
        rows = self._image_rows.get(image.digest)
        if rows is None:
            rows = self._image_rows[image.digest] = vision.features(self.model, self.vision, image)
            while len(self._image_rows) > 256:  # a bound on the memory they keep
                self._image_rows.popitem(last=False)
        self._image_rows.move_to_end(image.digest)
        return rows

    def has_unfinished(self) -> bool:
        return self._launched is not None or self.scheduler.has_unfinished()

    def progress(self, request_id: str) -> tuple[list[int], list[float], list] | None:
        """The tokens, log-probs and top alternatives a running request has so far (None once it
        has finished or is unknown)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        return seq.output_ids, seq.log_probs, seq.top_logprobs

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True) if self.tokenizer else ""
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=list(seq.output_ids),
            log_probs=list(seq.log_probs),
            finish_reason=seq.finish_reason or "abort",
            text=text,
            weight_version=self.weight_version,
            prompt_tokens=len(seq.prompt_ids),
            cached_tokens=seq.prefix_hits,
            top_logprobs=list(seq.top_logprobs) if seq.params.top_logprobs else None,
            routed_experts=self._routing(seq) if seq.params.return_routed_experts else None,
        )

    def _routing(self, seq: Sequence) -> torch.Tensor | None:
        """`ModelRunner.routing` while every position but the last is in the cache (None for a
        request aborted while preempted: its routing was never or is no longer computed)."""
        if self.asleep or not seq.block_table or seq.num_cached < seq.num_tokens - 1:
            return None
        return self.runner.routing(seq)

    def _finish(self, seq: Sequence, reason: str) -> RequestOutput:
        seq.finish_reason = reason
        out = self._output(seq)  # before its blocks are freed: the routing is read from them
        self.scheduler.finish(seq, reason)
        del self.seqs[seq.request_id]
        return out

    def _stop_reason(self, seq: Sequence) -> str | None:
        p = seq.params
        if seq.output_ids[-1] in seq.stop_ids:
            return "stop"
        if p.stop:
            # only the tail can hold a newly completed stop string (a token is >= 1 character)
            window = max(len(s) for s in p.stop) + 1
            tail = self.tokenizer.decode(seq.output_ids[-window:], skip_special_tokens=True)
            if any(s in tail for s in p.stop):
                return "stop"
        out = len(seq.output_ids)
        if out >= p.max_new_tokens or len(seq.prompt_ids) + out >= self.max_model_len:
            return "length"
        return None

    def step(self) -> list[RequestOutput]:
        """One forward pass over the scheduled sequences; returns the requests finished by it.

        Decode steps replayed from CUDA graphs overlap (`overlap_steps`): such a step is launched
        and left running; the next call launches the step after it, feeding the tokens it
        sampled on the device, before reading them back. So the host's bookkeeping of one step
        (appending tokens, stop checks) runs while the GPU computes the next, and the GPU does not
        wait for the host between steps. A sequence that finished in the step being read was fed
        to the next one too; that row is dropped. Admissions (anything waiting), preemption and
        logit penalties end the overlap: the step in flight is read first, then a plain step runs."""
        if self._launched is not None:
            prev = self._launched
            self._launched = self._chain(prev)
            return self._complete(prev, self._launched)
        seqs = self.scheduler.schedule()
        if not seqs:
            if self.scheduler.waiting and not self.scheduler.running:
                # nothing runs and the head cannot be admitted: it can never fit
                raise RuntimeError(f"request {self.scheduler.waiting[0].request_id} cannot fit in the KV cache")
            return []
        t0 = time.perf_counter()
        computed = [s for s in seqs if s.twin is None]
        twins = [s for s in seqs if s.twin is not None]  # their twin's K/V and logits row (`Scheduler`)
        new_tokens = sum(s.num_new for s in computed)
        # a decode feeds back the token sampled last step; anything else is (re)filling the cache
        decodes = sum(1 for s in computed if s.output_ids and s.num_new == 1 and s.num_cached)
        overlap = not twins and decodes == len(seqs) and self._can_overlap(seqs)
        done = False
        try:
            logits = self.runner.forward(computed)
            if twins:
                self.runner.copy_twins(twins)
                row = {id(s): i for i, s in enumerate(computed)}
                logits = logits[torch.tensor([row[id(s.twin or s)] for s in seqs], device=logits.device)]
                self.counters["prefill_tokens_copied"] += sum(s.num_new for s in twins)
            done = True
        finally:  # a twin is one step's: a failed step leaves none behind (nor state snapshots)
            for s in twins:
                s.twin = None
            self.blocks.end_step(computed, done)
        logits = adjust_logits(logits, [s.params for s in seqs], [s.output_ids for s in seqs])
        launch = self._sample(seqs, logits, pending=0, fed=[s.num_tokens - 1 for s in seqs])
        self.counters["forward_s"] += time.perf_counter() - t0
        self.counters["steps"] += 1
        self.counters["decode_tokens"] += decodes
        self.counters["prefill_tokens"] += new_tokens - decodes
        if overlap:
            self._launched = launch
            return []
        return self._complete(launch, None)

    def _can_overlap(self, seqs: list[Sequence], params_checked: bool = False) -> bool:
        """Whether this pure decode step runs from a CUDA graph (or, in tests, over its static
        buffers) and may be left in flight: no logit penalties (they read the tokens so far;
        `params_checked`: these sequences' parameters passed already, in the step before)."""
        graphs = self.runner.graphs
        return (
            self.cfg.overlap_steps
            and graphs is not None
            and self.runner.decode_path is not None
            and self.runner.decode_path_checked
            and graphs.size_for(len(seqs)) is not None
            and (params_checked or not any(s.params.adjusts_logits for s in seqs))
        )

    def _sample(
        self,
        seqs: list[Sequence],
        logits: torch.Tensor,
        pending: int,
        fed: list[int],
        same_as: _Launch | None = None,
        limits: list[int] | None = None,
    ) -> _Launch:
        """Sample each sequence's next token from `logits` and start copying the result to the
        host (`pending`: tokens each sequence has drawn that the host has not read yet; `fed`:
        the position each fed this step; `same_as`: the step before, over the same sequences in
        the same order, whose sampling parameters on the device this one reuses; `limits`:
        `_Launch.limits` of `seqs` where the caller has them)."""
        if limits is None:
            limits = same_as.limits if same_as is not None else self._length_limits(seqs)
        if same_as is not None:
            sampling, want_top = same_as.sampling, same_as.want_top
            draws = same_as.draws + 1  # each row drew one more token since, on the device
        else:
            # Python lists, not tensors: the plan reads what the draw must decide on from them,
            # not back from the device
            sampling = SamplingPlan.of(
                logits,
                [s.params.temperature for s in seqs],
                [s.params.top_p for s in seqs],
                [s.params.top_k for s in seqs],
                [s.params.seed for s in seqs],
                [s.params.min_p for s in seqs],
            )
            want_top = max(s.params.top_logprobs for s in seqs)
            draws = host_values([len(s.output_ids) + pending for s in seqs], torch.long, self.device)
        tok, lp = sample_planned(logits, sampling, draws)
        if self.cfg.batch_invariant:  # the log-softmax as the trainer's scoring computes it
            with invariant.numerics():
                lp = scored_log_probs(logits, tok, sampling.rows, lp)
        tops = None
        if want_top:
            ids, vals = top_logprobs(logits, sampling.rows.temp, want_top)
            tops = (ids.to(CPU, non_blocking=True), vals.to(CPU, non_blocking=True))
        # ids and log-probs in one float64 tensor (which holds both exactly): one copy to the host
        host = torch.stack([tok.double(), lp.double()]).to(CPU, non_blocking=True)
        event = None
        if is_cuda(self.device):
            event = torch.cuda.Event()
            event.record()
        return _Launch(seqs, fed, tok, host, tops, event, sampling, draws, want_top, limits)

    def _length_limits(self, seqs: list[Sequence]) -> list[int]:
        """`_Launch.limits`: the output length at which each sequence stops by length."""
        room = self.max_model_len
        return [min(s.params.max_new_tokens, room - len(s.prompt_ids)) for s in seqs]

    def _chain(self, prev: _Launch) -> _Launch | None:
        """Launch the decode step after `prev` (still in flight) for its sequences that are still
        running, feeding the tokens it sampled; None where the overlap ends (see `step`)."""
        if self.scheduler.waiting:
            return None
        # not those `prev` takes to their length limit: they finish when it is read, whatever it
        # sampled (per sequence only list arithmetic: this runs for every sequence every step)
        running = SeqStatus.RUNNING
        outs = [len(s.output_ids) for s in prev.seqs]
        going = [o + 1 < lim and s.status is running for s, o, lim in zip(prev.seqs, outs, prev.limits, strict=True)]
        every = all(going)
        keep = range(len(going)) if every else [i for i, g in enumerate(going) if g]
        seqs = prev.seqs if every else [prev.seqs[i] for i in keep]
        lens = [len(seqs[j].prompt_ids) + outs[i] for j, i in enumerate(keep)]
        if not seqs or not self._can_overlap(seqs, params_checked=True):
            return None
        bs = self.cfg.block_size
        # each feeds the token `prev` sampled, at position n (its known tokens): its block must exist
        short = [(s, n) for s, n in zip(seqs, lens, strict=True) if len(s.block_table) * bs <= n]
        if len(short) > self.blocks.num_free:
            return None  # a plain step preempts
        for s, n in short:
            self.blocks.grow(s, n + 1)
        t0 = time.perf_counter()
        ids = prev.tokens if every else prev.tokens[host_values(keep, torch.long, self.device)]
        logits = self.runner.graphs.run(seqs, ids, lens)
        if every:  # the same rows: `prev`'s sampling plan and limits
            launch = self._sample(seqs, logits, pending=1, fed=lens, same_as=prev)
        else:
            limits = [prev.limits[i] for i in keep]
            launch = self._sample(seqs, logits, pending=1, fed=lens, limits=limits)
        self.counters["forward_s"] += time.perf_counter() - t0
        self.counters["steps"] += 1
        self.counters["overlapped_steps"] += 1
        self.counters["decode_tokens"] += len(seqs)
        return launch

    def _complete(self, launch: _Launch, next_launch: _Launch | None) -> list[RequestOutput]:
        """Read a launched step's tokens and log-probs back and append them; returns the requests
        they finish. `next_launch` already fed these tokens: their blocks, once full, are
        registered for the prefix cache here (a plain step does it when it feeds them)."""
        if launch.event is not None:
            launch.event.synchronize()  # this step's copies only: the next one may still be computing
        ids, lps = launch.host[0].long().tolist(), launch.host[1].tolist()
        tops = None if launch.tops is None else (launch.tops[0].tolist(), launch.tops[1].tolist())
        fed_next: set[int] | None = None  # made once a token fills a block (1 in block_size steps)
        bs = self.cfg.block_size
        finished = []
        # per sequence only what every token needs: this runs for every sequence every step, and
        # at 512 sequences it is most of the host's part of a step
        running = SeqStatus.RUNNING
        for i, (seq, fed, limit) in enumerate(zip(launch.seqs, launch.fed, launch.limits, strict=True)):
            if seq.status is not running:
                continue  # finished while this step was in flight (aborted, or its extra row)
            seq.num_cached = fed + 1  # everything fed this step is now in the cache
            out = seq.output_ids
            tok = ids[i]
            out.append(tok)
            seq.log_probs.append(lps[i])
            if tops is not None and seq.params.top_logprobs:
                k = seq.params.top_logprobs
                seq.top_logprobs.append(list(zip(tops[0][i][:k], tops[1][i][:k], strict=True)))
            # `_stop_reason` where one of its tests can pass: a stop token, the length limit, stop strings
            reason = None
            if tok in seq.stop_ids or len(out) >= limit or seq.params.stop:
                reason = self._stop_reason(seq)
            if reason:
                finished.append(self._finish(seq, reason))
            elif (fed + 2) % bs == 0:  # the token fills its block
                if fed_next is None:
                    fed_next = set() if next_launch is None else {id(s) for s in next_launch.seqs}
                if id(seq) in fed_next:
                    self.blocks.register_full(seq)
        return finished

    def abort(self, request_id: str | None = None) -> list[RequestOutput]:
        """Stop one request (or all with None); they come back with their partial tokens."""
        ids = list(self.seqs) if request_id is None else [request_id]
        return [self._finish(self.seqs[r], "abort") for r in ids if r in self.seqs]

    # ---------------------------------------------------------------- weights
    def update_weights_from_tensors(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        share: bool = False,
        stage: bool = False,
        partial: bool = False,
    ) -> None:
        """Load weights by name, all or nothing (`share`: alias same-dtype tensors, see
        `load_named_tensors`). `stage`: check these tensors and keep them until a later call
        without `stage` loads everything at once, so an update sent in chunks is all or nothing
        too. `partial`: the update names only the tensors that changed (a LoRA sync, the `delta`
        transport); the others stay. On failure the engine keeps its weights and version, and the
        staged tensors are dropped."""
        self._check_loadable()
        named = dict(named)
        if stage:
            self._staged.add(self.model, named)
            return
        named = self._staged.take(self.model, named)
        load_named_tensors(self.model, named.items(), share, complete=not partial)
        if self.quant is not None:  # quantize or pack now, not in the first forward (the cost shows in stats)
            self.counters["quantize_s"] += self.quant.refresh()
        self.weight_version = self.weight_version + 1 if version is None else version
        self._checksum = None
        self.flush_cache()

    def update_weights_from_disk(self, path: str | Path, version: int | None = None) -> None:
        self._check_loadable()  # before the folder is read
        self.update_weights_from_tensors(read_safetensors_dir(path).items(), version)

    def drop_staged(self) -> None:
        """Forget the chunks staged for the next update (that update was refused)."""
        self._staged.clear()

    def _check_loadable(self) -> None:
        """`EngineUnavailable` while asleep: the parameters are empty then, so every tensor would
        be refused as the wrong shape (a misleading answer to a caller who only has to wake it)."""
        if self.asleep:
            raise EngineUnavailable("update_weights: the engine is asleep; wake() it first", "asleep")

    def weights_checksum(self) -> str:
        """`tidal.engine.weights.weights_checksum` of the loaded weights (computed once per load)."""
        if self._checksum is None:
            self._checksum = model_checksum(self.model)
        return self._checksum

    def sleep(self) -> None:
        """Free the KV cache and the weights (colocated with a trainer that needs the memory).
        Nothing may be running; `wake()` takes the memory back and the next weight update fills it."""
        if self.has_unfinished():
            raise RuntimeError("engine.sleep: requests are still running; abort or finish them first")
        self._shapes = {n: (p.shape, p.dtype) for n, p in self.model.named_parameters()}
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.runner.release()
        if self.quant is not None:
            self.quant.release()
        release_cached(self.device)
        self.flush_cache()
        self.asleep = True

    def wake(self) -> None:
        """Allocate the KV cache and weight storage again; generating needs a weight update first."""
        if not self.asleep:
            return
        params = dict(self.model.named_parameters())
        for n, (shape, dtype) in self._shapes.items():
            params[n].data = torch.empty(shape, dtype=dtype, device=self.device)
        self.runner.allocate()
        self.asleep = False
        self.weight_version = -1  # no weights until the next update
        self._checksum = None

    def flush_cache(self) -> bool:
        """Drop the prefix cache so no new request reuses K/V (or image features) computed with
        older weights."""
        self.blocks.reset_prefix_cache()
        self._image_rows.clear()
        return True

    def stats(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": self.blocks.num_used,
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_peak": self.blocks.peak_used,
            "kv_bytes_per_block": self.runner.kv_bytes() // self.blocks.num_blocks,
            "prefix_hit_blocks": self.blocks.hits,
            "prefix_hit_tokens": self.blocks.hits * self.cfg.block_size,  # prompt tokens not computed
            # a hybrid model's recurrent states: running sequences' and snapshots (`tidal.engine.states`)
            "state_bytes": self.runner.states.nbytes() if self.runner.states is not None else 0,
            "preemptions": self.scheduler.num_preemptions,
            **self.counters,
            **(self.runner.graphs.stats() if self.runner.graphs is not None else {}),
        }

    # ---------------------------------------------------------------- batch convenience
    def generate_batch(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        images: list[list[vision.Image]] | None = None,
    ) -> list[GenerationOutput]:
        """Run the given requests to completion, alone (nothing else may be queued): one output per
        prompt, `params[i]` (and `images[i]`, a vision-language model's) for `prompts[i]`. For
        tests and benchmarks; the rollout submits requests one by one through `AsyncEngine`."""
        if len(prompts) != len(params):
            raise ValueError(f"generate_batch: {len(prompts)} prompts but {len(params)} sampling params")
        images = images or [[] for _ in prompts]
        rids: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:
            for p, sp, im in zip(prompts, params, images, strict=True):  # all or nothing: a bad one aborts the rest
                rids.append(self.add_request(None, p, sp, images=im))
            while self.has_unfinished():
                for out in self.step():
                    done[out.request_id] = out
        except BaseException:
            self.abort()
            raise
        return [done[r].generation() for r in rids]
