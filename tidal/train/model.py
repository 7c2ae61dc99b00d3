"""A model as a trainer runs it: the weights the optimizer updates, the module forward and backward
run on, and the forward to the hidden states that predict response tokens.

Precision (`train.dtype`, resolved from the hardware when `auto`): the weights the optimizer
updates, saves and syncs are always fp32. `bfloat16` computes forward and backward on a bf16 copy
of them (`tidal.train.precision`); `autocast` computes under bf16 autocast over the fp32 weights;
`float32` computes in fp32. On trainer ranks with FSDP2 (`shard`), the sharded module is both:
its mixed-precision policy casts the fp32 shards to bf16 for compute and reduces in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from tidal import invariant, recurrent, vision
from tidal.hardware import CPU, autocast_type, keep_freed_memory, resolve_dtype
from tidal.options import ConfigError
from tidal.train import context, lora, parallel, recompute
from tidal.train.attention import NAME as PACKED_ATTENTION
from tidal.train.attention import implementation as attn_implementation
from tidal.train.attention import packed_layout, use_packed_attention
from tidal.train.batching import root_inputs
from tidal.train.forward import Forward
from tidal.train.options import TrainConfig
from tidal.train.precision import Bf16Compute, to_bf16_params


def load_causal_lm(path: str | Path) -> torch.nn.Module:
    """A Hugging Face causal LM in fp32 (the master weights): a vision-language model whole."""
    return vision.load_pretrained(path, torch.float32)


def load_frozen(path: str | Path) -> torch.nn.Module:
    return load_causal_lm(path).eval().requires_grad_(False)


def own_trainable_memory(model: torch.nn.Module) -> int:
    """Copy each trainable host parameter whose memory torch did not allocate into memory of its
    own; returns the bytes copied.

    transformers hands over a safetensors checkpoint's tensors as views of the file, mapped
    copy-on-write. The first optimizer step would then copy every page it writes, one 4 KiB
    fault at a time: for SmolLM2 in fp32 that made the first AdamW step 1.3-1.5 s against 0.06 s
    for the next ones, where this copy takes 0.55 s (2-core Zen 4). And until a page is written,
    a change to the file on disk shows in the weights. Frozen weights (a LoRA's base, a
    reference model) stay mapped: nothing writes them, and the page cache can take them back."""
    copied = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.device.type == CPU and not p.untyped_storage().resizable():
                p.data = p.data.clone()
                copied += p.nbytes
    return copied


class TrainedModel:
    """`master` (fp32, what the optimizer updates) and `compute` (what forward/backward run on),
    with the `Forward` that plans micro-batches and runs `compute` to response hidden states.

    `shard(mesh)` makes this a trainer rank's FSDP2 shard of the model (see `tidal.cluster`)."""

    def __init__(
        self,
        module: torch.nn.Module,
        cfg: TrainConfig,
        pad_id: int = 0,
        dtype: str | None = None,
        device: str | torch.device = CPU,
        adapter: str | Path | None = None,
        trainable: tuple[str, ...] = (),
        routing: bool = False,
    ) -> None:
        """With `cfg.lora_rank` > 0 the model gets LoRA adapters (`tidal.train.lora`), started from
        the `adapter` folder when given, and only they (and the `trainable` modules, whole) train.
        `routing`: micro-batches carry the samples' recorded experts (`algo.routing_replay`)."""
        self.cfg = cfg
        self.device = torch.device(device)
        keep_freed_memory(self.device)  # each micro-batch reuses the last one's large blocks
        self.dtype = dtype or resolve_dtype(cfg.dtype, "train.dtype", self.device.type).dtype
        self.master = module.float().to(self.device).train()
        if vision.runs(self.master.config) is not None and not cfg.train_vision:
            vision.freeze_tower(self.master)
        self.lora = lora.enabled(cfg)
        if self.lora:
            lora.apply_lora(self.master, cfg, adapter, trainable)
        own_trainable_memory(self.master)  # what the optimizer writes: not a mapped file
        if cfg.gradient_checkpointing:
            recompute.enable(self.master, cfg.gradient_checkpointing)
            if self.lora and hasattr(self.master, "enable_input_require_grads"):
                # frozen embeddings: recomputed blocks must still see an input that needs a gradient
                self.master.enable_input_require_grads()
        else:
            recompute.inputs_only(self.master)  # before the bf16 copy, which copies the forwards
        self.mixed = Bf16Compute(self.master) if self.dtype == "bfloat16" else None
        self.compute = self.mixed.model if self.mixed is not None else self.master
        self.fwd = Forward(cfg, self.compute, pad_id, self.device, routing)
        if cfg.batch_invariant:
            self._check_batch_invariant()
        self.sharded = False
        self.mesh = self.tp_mesh = None
        self.vocab: parallel.VocabSplit | None = None  # tensor parallel: the logits are this slice
        self.cp_group = None  # context parallel: the ranks that split each micro-batch's row
        self.frozen_models: list[torch.nn.Module] = []  # a reference and teacher sharded like it
        self.loss_scale = 1.0

    def _check_batch_invariant(self) -> None:
        """`train.batch_invariant` scores a family these numerics cover, with tidal's attention
        function (which attends by `tidal.invariant.attend` under them)."""
        why = invariant.unsupported(vision.language_config(self.compute.config).model_type, "train.batch_invariant")
        if why:
            raise ConfigError(why)
        if not use_packed_attention(self.compute):
            raise ConfigError(
                f"train.batch_invariant: {self.compute.config.model_type} attends with "
                f"{attn_implementation(self.compute)!r}, not sdpa or eager, which tidal's attention function replaces"
            )

    def numerics(self):
        """The context scoring runs in: `tidal.invariant.numerics()` under `train.batch_invariant`."""
        return invariant.numerics() if self.cfg.batch_invariant else contextlib.nullcontext()

    def shard(self, mesh=None, tp_mesh=None, cp_group=None) -> None:
        """FSDP2 over the default process group (or `mesh`): each decoder layer and the root are
        `fully_shard`ed; bf16 compute comes from the mixed-precision policy, gradients are reduced
        in fp32 and summed over ranks (each rank's loss is already divided by the global counts).
        `tp_mesh`: first split each layer's attention and MLP over it (`tidal.train.parallel`);
        `mesh` is then the data-parallel dimension. `cp_group`: the ranks that split each packed
        row's tokens between them (`tidal.train.context`); `mesh` then spans them too."""
        import torch.distributed  # noqa: F401  (the process group is the caller's)

        if vision.runs(self.master.config) is not None and (cp_group is not None or tp_mesh is not None):
            what = "cluster.cp_size" if cp_group is not None else "cluster.tp_size"
            raise ConfigError(
                f"{what}: {self.master.config.model_type} (a vision-language model) trains on FSDP2 ranks "
                "that each hold whole rows; splitting its rows or layers is not done yet (set it to 1)"
            )
        if cp_group is not None:
            self._check_context_parallel()
            self.cp_group = self.fwd.cp_group = cp_group

        if self.mixed is not None:  # FSDP's policy replaces the single-process bf16 copy
            self.mixed = None
            self.compute = self.master
            self.fwd = Forward(self.cfg, self.compute, self.fwd.pad_id, self.device, self.fwd.routing)
        self.mesh, self.tp_mesh = mesh, tp_mesh
        if tp_mesh is not None:  # this rank's slice of the vocabulary, where the output is split
            self.vocab = parallel.apply_tp(self.master, tp_mesh)
        _fully_shard(self.master, mesh, self.dtype == "bfloat16")
        # FSDP2 averages gradients over its ranks (gloo has no pre-scaled sum); each rank's loss is
        # already divided by the global counts, so it is scaled by their count to make a sum
        self.loss_scale = float(mesh.size() if mesh is not None else torch.distributed.get_world_size())
        self.sharded = True

    def _check_context_parallel(self) -> None:
        kind = self.master.config.model_type
        if not self.fwd.packing or attn_implementation(self.master) != PACKED_ATTENTION:
            raise ConfigError(
                f"cluster.cp_size: splits packed rows; {kind} does not train packed here (train.packing, and an "
                "sdpa or eager attention that tidal's packed attention replaces)"
            )
        if recurrent.mixers(self.master):
            raise ConfigError(f"cluster.cp_size: {kind}'s recurrent layers carry state along the row; not split yet")

    def reshard(self) -> None:
        """Back to sharded parameters after a forward without backward (FSDP2 keeps the root's
        gathered until its backward): the optimizer and state dicts know the shards, and a
        sharded reference or teacher holds only its shard between calls."""
        if not self.sharded:
            return
        from torch.distributed.fsdp import FSDPModule

        for model in (self.master, *self.frozen_models):
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.master.parameters() if p.requires_grad]

    def frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen model computed like this one (precision, attention), so that a reference or
        teacher equal to the policy gives exactly the policy's log-probs (KL exactly 0)."""
        model = model.to(self.device).eval().requires_grad_(False)
        if self.fwd.packing or self.cfg.batch_invariant:
            use_packed_attention(model)
        if self.sharded:  # FSDP2 like the policy: each rank keeps 1/N of it (bf16 by the same policy)
            if self.tp_mesh is not None:
                parallel.apply_tp(model, self.tp_mesh)
            _fully_shard(model, self.mesh, self.dtype == "bfloat16")
            self.frozen_models.append(model)
            return model
        return to_bf16_params(model) if self.dtype == "bfloat16" else model

    def autocast(self):
        if self.dtype != "autocast":
            return contextlib.nullcontext()
        return torch.autocast(device_type=autocast_type(self.device), dtype=torch.bfloat16)

    @contextlib.contextmanager
    def one_cast_per_update(self):
        """Run an optimizer step's micro-batches inside one outer autocast region, itself switched
        off so only the scoring computes in bf16. Autocast keeps its bf16 copy of each fp32 weight
        until the outermost region exits, so each weight (the 28M-parameter embedding included)
        is cast once per optimizer step instead of once per micro-batch; the weights only change at
        `optimizer.step()`, after the region has closed."""
        if self.dtype != "autocast":
            yield
            return
        kind = autocast_type(self.device)
        with torch.autocast(kind, dtype=torch.bfloat16), torch.autocast(kind, enabled=False):
            yield

    def after_step(self) -> None:
        """Refresh the compute copy from the master weights the optimizer just updated."""
        if self.mixed is not None:
            self.mixed.sync()

    def response_hidden(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Hidden states [T, H] at the T real response positions of `batch` (row-major over
        [B, R]) and that [B, R] position mask; `model` is a causal LM computed like `compute`.

        Only real response positions go on to the output projection and the vocabulary-wide
        log-softmax: prompt positions are never scored, and the padding of the [B, R] grid is
        often 30-40% of it."""
        valid = batch["response_valid"]
        return self.fwd.hidden(model.base_model, batch)[valid], valid

    def root_logits(self, batch: dict[str, Tensor], model: torch.nn.Module | None = None) -> tuple[Tensor, Tensor]:
        """Logits [T, V] at the T real response positions and the [B, R] mask, from the causal LM's
        own forward (`logits_to_keep` picks the positions), as FSDP2 needs: its root module gathers
        the embedding and output projection only when its forward runs. `model`: the trained one
        (default), or a reference or teacher sharded like it."""
        model = self.master if model is None else model
        valid = batch["response_valid"]
        if self.cp_group is not None:
            return self._context_logits(batch, model)
        inputs, merging = root_inputs(model, batch)  # a vision-language model's images merge inside
        if "position_ids" in batch:  # packed row
            kwargs = {}
            if self.fwd.packing and attn_implementation(model) == PACKED_ATTENTION:
                kwargs["tidal_layout"] = batch.get("layout") or packed_layout(batch["position_ids"])
            with merging:
                out = model(**inputs, use_cache=False, logits_to_keep=batch["response_index"][valid], **kwargs)
            return out.logits[0], valid
        r = batch["response_ids"].shape[1]
        pos = batch["prompt_lengths"][:, None] - 1 + torch.arange(r, device=self.device)[None, :]
        pos = pos.clamp(max=batch["input_ids"].shape[1] - 1)
        with merging:
            out = model(**inputs, attention_mask=batch["attention_mask"], use_cache=False, logits_to_keep=pos)
        return out.logits[valid], valid

    def _context_logits(self, batch: dict[str, Tensor], model: torch.nn.Module) -> tuple[Tensor, Tensor]:
        """`root_logits` on a context-parallel rank: logits [T_l, V] at the response positions
        predicted by this rank's part of the row, and the [B, R] mask of those positions (the
        other cp ranks hold the rest)."""
        valid = batch["response_valid"]
        split = batch["cp_split"]  # made by `Forward.collate`
        ids, pos = context.local_inputs(batch, split, self.fwd.pad_id)
        at = split.local_of[batch["response_index"][valid]]
        mine = valid.clone()
        mine[valid] = at >= 0
        out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=at[at >= 0], tidal_layout=split)
        return out.logits[0], mine

    def context_hidden(self, base_model: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """On a context-parallel rank: hidden states [B, R, H] at the response positions this
        rank's part of the row predicts (elsewhere the state of its first token: mask it), and the
        [B, R] mask of those positions."""
        split = batch["cp_split"]  # made by `Forward.collate`
        ids, pos = context.local_inputs(batch, split, self.fwd.pad_id)
        hidden = base_model(input_ids=ids, position_ids=pos, use_cache=False, tidal_layout=split).last_hidden_state
        at = split.local_of[batch["response_index"]]
        picked = hidden[0].index_select(0, at.clamp(min=0).reshape(-1)).view(*at.shape, hidden.shape[-1])
        return picked, at >= 0

    def adapters_off(self):
        """A context in which the compute model is the base model (LoRA adapters off); a no-op
        context without LoRA."""
        return lora.adapters_off(self.compute) if self.lora else contextlib.nullcontext()

    def weight_shapes(self, changed_only: bool = False) -> list[tuple[str, tuple[int, ...]]]:
        """(name, full shape) of each tensor `named_weights(changed_only=...)` yields, in its order."""
        meta = ((n, torch.empty(p.shape, device="meta")) for n, p in self.master.named_parameters())
        if self.lora:
            merged = lora.merge_named(meta, lora.scalings(self.master), changed_only)
            return [(n, tuple(t.shape)) for n, t in merged]
        return [(n, tuple(t.shape)) for n, t in meta]

    def named_weights(
        self, dtype: torch.dtype | None = None, changed_only: bool = False, merged: bool = True
    ) -> Iterator[tuple[str, Tensor]]:
        """Parameters by name, for weight sync to the engines: the fp32 master weights, or with
        `dtype` bf16 and a bf16 compute copy, that copy's tensors (kept equal to the master's after
        every optimizer step), so an engine in the same process can share them. On an FSDP2 rank
        every rank must call this (each full tensor is gathered from the shards).

        With LoRA: the base model's names, each targeted matrix merged (`W + s · B A`, fp32);
        `changed_only` gives those alone (the rest never changes); `merged` False gives the LoRA
        model's own tensors instead (peft's names; `changed_only`: the adapters), for an engine
        that runs the same LoRA layers. Without LoRA `changed_only` changes nothing: every
        parameter is trained."""
        self.reshard()
        if self.lora and not merged and not self.sharded:
            for name, p in self.master.named_parameters():
                if p.requires_grad or not changed_only:
                    yield name, p.detach()
            return
        if self.lora:
            full = (
                (n, p.detach().full_tensor() if self.sharded else p.detach()) for n, p in self.master.named_parameters()
            )
            yield from lora.merge_named(full, lora.scalings(self.master), changed_only)
            return
        compute = None
        if dtype == torch.bfloat16 and self.mixed is not None:
            compute = dict(self.mixed.model.named_parameters(remove_duplicate=False))
        for name, p in self.master.named_parameters():
            if self.sharded:  # every rank gathers each full tensor from the shards
                yield name, p.detach().full_tensor()
            else:
                yield name, (compute[name] if compute is not None else p).detach()


def _fully_shard(model: torch.nn.Module, mesh, bf16: bool) -> None:
    """FSDP2 over each decoder layer and the root: fp32 shards, bf16 compute when `bf16`, gradients
    reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    # a vision-language model's vision tower and projector stay in the root's unit: a rank runs
    # the tower once per distinct image of its micro-batch (`vision.merged_in_forward`), a number
    # the other ranks do not share, so the tower cannot gather its own shards per call
    decoder = model.get_decoder() if vision.runs(model.config) is not None else getattr(model, "base_model", model)
    for layer in getattr(decoder, "layers", []):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
