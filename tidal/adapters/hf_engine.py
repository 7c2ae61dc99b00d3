"""The fallback engine (`engine.kind: hf`): a Hugging Face causal LM decoding a whole batch with
a KV cache, for architectures tidal's own engine does not run.

It samples every row with that row's own parameters and seed, returns the log-prob of each sampled
token, drops finished rows from the cache as it goes, and prefills each distinct prompt once (the
n samples of a GRPO group share the prompt's cache rows). As a core (`tidal.contracts.EngineCore`)
behind `AsyncEngine`, one `step()` runs every queued request to completion as one batch: requests
that arrive meanwhile wait for the next batch (no continuous batching; tidal's engine has it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from tidal.contracts import GenerationOutput, RequestOutput, SamplingParams
from tidal.engine.sampling import sample_tokens
from tidal.engine.weights import WeightStage, load_named_tensors, model_checksum, read_safetensors_dir
from tidal.hardware import CPU, weights_dtype
from tidal.utils import cache_argument


class HFEngine:
    """In-process engine over a transformers model (CPU or one GPU); meets `tidal.contracts.EngineCore`."""

    partial_updates = True  # update_weights_from_tensors(partial=True): only the changed tensors
    takes_images = False  # prompts with images run in the tidal engine only

    def __init__(
        self,
        model: str | Path | torch.nn.Module,
        tokenizer=None,
        dtype: str = "auto",
        device: str = CPU,
        max_context: int | None = None,
    ) -> None:
        if isinstance(model, torch.nn.Module):
            self.model = model
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                str(model), dtype=weights_dtype(dtype, "engine dtype", device)
            )
        self.model.to(device).eval().requires_grad_(False)
        self.cache_kw = cache_argument(self.model)
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.max_context = max_context or getattr(self.model.config, "max_position_embeddings", None)
        self.pad_id = 0
        eos = getattr(self.model.config, "eos_token_id", None)
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.weight_version = 0
        self.max_model_len = self.max_context or 2048
        self.counters = {"prefill_tokens": 0, "decode_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0}
        self.queue: dict[str, tuple[list[int], SamplingParams]] = {}  # requests for the next batch
        self._staged = WeightStage()

    # ---------------------------------------------------------------- the core's step API
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> str:
        if request_id in self.queue:
            raise ValueError(f"request {request_id}: id already in use")
        self._check(request_id, list(prompt_ids), params)
        self.queue[request_id] = (list(prompt_ids), params)
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self) -> list[RequestOutput]:
        """Every queued request, run to completion as one batch."""
        batch, self.queue = self.queue, {}
        outs = self.generate_batch([p for p, _ in batch.values()], [sp for _, sp in batch.values()])
        return [self._request_output(rid, p, o) for (rid, (p, _)), o in zip(batch.items(), outs, strict=True)]

    def abort(self, request_id: str | None = None) -> list[RequestOutput]:
        """Queued requests only: a batch in progress runs to its end (it holds the engine thread)."""
        ids = list(self.queue) if request_id is None else [request_id]
        gone = [(rid, self.queue.pop(rid)[0]) for rid in ids if rid in self.queue]
        empty = GenerationOutput(finish_reason="abort", weight_version=self.weight_version)
        return [self._request_output(rid, p, empty) for rid, p in gone]

    def _request_output(self, rid: str, prompt: list[int], o: GenerationOutput) -> RequestOutput:
        return RequestOutput(
            request_id=rid,
            token_ids=list(o.token_ids),
            log_probs=list(o.log_probs),
            finish_reason=o.finish_reason,
            text=o.text,
            weight_version=o.weight_version,
            prompt_tokens=len(prompt),
        )

    def flush_cache(self) -> bool:
        return True  # nothing outlives a batch

    def stats(self) -> dict:
        return {"waiting": len(self.queue), **self.counters}

    def weights_checksum(self) -> str:
        return model_checksum(self.model)

    def sleep(self) -> None:
        raise RuntimeError("engine.kind hf cannot sleep: use the tidal engine to colocate")

    def wake(self) -> None:
        pass

    # ---------------------------------------------------------------- weights
    def update_weights_from_tensors(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        share: bool = False,
        stage: bool = False,
        partial: bool = False,
    ) -> None:
        """Copy tensors into the engine's parameters by name, all or nothing (cast to the engine
        dtype; `share`: alias same-dtype tensors, see `load_named_tensors`; `stage`: keep them for
        the next call without `stage`; `partial`: only the tensors that changed are named)."""
        named = dict(named)
        if stage:
            self._staged.add(self.model, named)
            return
        named = self._staged.take(self.model, named)
        load_named_tensors(self.model, named.items(), share, complete=not partial)
        self.weight_version = self.weight_version + 1 if version is None else version

    def update_weights_from_disk(self, path: str | Path, version: int | None = None) -> None:
        """Load safetensors weights saved by `save_pretrained` from `path`."""
        self.update_weights_from_tensors(read_safetensors_dir(path).items(), version)

    def drop_staged(self) -> None:
        """Forget the chunks staged for the next update (that update was refused)."""
        self._staged.clear()

    # ---------------------------------------------------------------- generation
    def _check(self, name: str, p: list[int], sp: SamplingParams) -> None:
        sp.validate()
        if not p:
            raise ValueError(f"request {name}: the prompt is empty")
        if sp.stop and self.tokenizer is None:
            raise ValueError(f"request {name}: stop strings need an engine with a tokenizer")
        if self.max_context and len(p) + sp.max_new_tokens > self.max_context:
            raise ValueError(
                f"request {name}: the prompt has {len(p)} tokens + max_new_tokens {sp.max_new_tokens} > "
                f"context length {self.max_context}"
            )

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationOutput]:
        """Sample one response per prompt. `params[i]` applies to `prompts[i]`."""
        if len(prompts) != len(params):
            raise ValueError(f"generate_batch: {len(prompts)} prompts but {len(params)} sampling params")
        if not prompts:
            return []
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            self._check(str(i), p, sp)
        outs = [GenerationOutput(weight_version=self.weight_version) for _ in prompts]
        dev = self.device

        # Prefill each distinct prompt once; group members then share its cache rows.
        uniq: dict[tuple[int, ...], int] = {}
        row_of = [uniq.setdefault(tuple(p), len(uniq)) for p in prompts]
        uniq_prompts = list(uniq)
        width = max(len(p) for p in uniq_prompts)
        ids = torch.full((len(uniq_prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(uniq_prompts), width), dtype=torch.long)
        for i, p in enumerate(uniq_prompts):  # left padding keeps every row's last token aligned
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        t0 = time.perf_counter()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            **{self.cache_kw: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        self.counters["prefill_tokens"] += int(mask.sum())
        self.counters["prefill_s"] += time.perf_counter() - t0
        select = torch.tensor(row_of, device=dev)
        cache.batch_select_indices(select)
        logits = out.logits[:, -1][select]
        mask = mask[select]
        next_pos = pos[select, -1] + 1

        active = list(range(len(prompts)))  # request index of each live cache row
        temp = torch.tensor([sp.temperature for sp in params], device=dev)
        top_p = torch.tensor([sp.top_p for sp in params], device=dev)
        top_k = torch.tensor([sp.top_k for sp in params], device=dev)
        seeds = [sp.seed for sp in params]
        stop_ids = [self.eos_ids | set(sp.stop_token_ids) for sp in params]

        t0 = time.perf_counter()
        while True:
            idx = torch.tensor(active, device=dev)
            draws = [len(outs[i].token_ids) for i in active]
            tok, lp = sample_tokens(
                logits.float(), temp[idx], top_p[idx], top_k[idx], [seeds[i] for i in active], draws=draws
            )
            tok_l, lp_l = tok.tolist(), lp.tolist()
            keep = []
            for row, req in enumerate(active):
                o, sp = outs[req], params[req]
                o.token_ids.append(tok_l[row])
                o.log_probs.append(lp_l[row])
                if tok_l[row] in stop_ids[req] or (sp.stop and self._hit_stop_string(o, sp.stop)):
                    o.finish_reason = "stop"
                elif len(o.token_ids) >= sp.max_new_tokens:
                    o.finish_reason = "length"
                else:
                    keep.append(row)
            self.counters["decode_tokens"] += len(active)
            if not keep:
                break
            if len(keep) < len(active):  # drop finished rows so the tail costs only what is live
                k = torch.tensor(keep, device=dev)
                cache.batch_select_indices(k)
                mask, next_pos, tok = mask[k], next_pos[k], tok[k]
                active = [active[r] for r in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                **{self.cache_kw: cache},
                use_cache=True,
            )
            logits = out.logits[:, -1]
            next_pos = next_pos + 1
        self.counters["decode_s"] += time.perf_counter() - t0
        if self.tokenizer is not None:
            for o in outs:
                o.text = self.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        return outs

    def _hit_stop_string(self, o: GenerationOutput, stops: list[str]) -> bool:
        # Only the tail can contain a newly completed stop string; decode a window long enough
        # for the longest one (a token is at least one character).
        window = max(len(s) for s in stops) + 1
        tail = self.tokenizer.decode(o.token_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in stops)
