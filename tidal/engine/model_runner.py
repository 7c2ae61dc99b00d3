"""One forward pass over a mixed batch of prefill and decode tokens, with a paged KV cache.

The transformers model runs its own forward: embeddings and their scale, norms (Gemma's 1 + w,
OLMo-2's post-norms, q/k norms), fused or biased projections, each family's rotary layout
(partial, interleaved, local and global bases), MLPs and MoE blocks, final logit soft-capping.
So the numbers are the transformers model's, for every family it implements, and nothing here is
a copy of a model. (Its RMSNorms and SwiGLU activations run as one fused op each where that
computes the same, checked module by module at start: `tidal.engine.fuse`; and pure decode steps
of Llama-shaped families call the same modules without transformers' per-layer plumbing, checked
bit for bit against its forward at the first: `tidal.engine.decode_path`.) Only attention is
ours: the model is switched to the `tidal_paged` attention function, which writes the new
keys/values into cache blocks and attends over each sequence's cached context, with the pieces
the families differ in passed to it by their attention modules: the scale, a per-layer sliding
window and attention logit soft-capping. The key and value widths of each layer are probed from
one forward at start, so layers that differ get caches of their own shape.

Multi-head latent attention (DeepSeek-V3) caches its latents, not keys and values: the attention
module hands the step's compressed KV and rotated shared key to its cache's `update`, and expands
what that returns into per-head keys and values. `LatentCache` is that cache: it writes the
step's latents to their slots and returns the latents of every slot the step's sequences read
(their union), so the cache holds kv_lora_rank + rope dims per token (576 for DeepSeek-V3)
instead of 128 heads x (192 + 128); attention then reads each sequence's context out of the
expanded union.

The batch is flat: every scheduled sequence contributes its uncached tokens. Per layer, the new
keys/values of *all* sequences are written to their slots first and only then does any sequence
attend, so a sequence admitted in the same step can read prompt blocks that another one is
computing (prefix sharing within a GRPO group).

MoE models: the experts each router chose for every computed token are kept per cache slot
(`routes`), like the keys and values, so a sequence's routing can be read back over its whole
context, prefix-shared or recomputed after a preemption.

Hybrid models (Qwen3-Next, Qwen3.5, LFM2, Falcon-H1, Granite 4): their recurrent token mixers
keep per-sequence states instead of K/V. Each mixer's forward is routed (`tidal.recurrent.wrap`)
to `tidal.engine.states.StatePool`, which runs the step's decode tokens as one batch with their
states and each prefill from its own, with transformers' own mixer math.
"""

from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tidal import invariant, moe, recurrent, vision
from tidal.attend import attend, causal_mask
from tidal.engine import decode_path, fuse, native, paged_kernel
from tidal.engine.cuda_graphs import DecodeGraphs
from tidal.engine.sequence import Sequence
from tidal.engine.states import StatePlan, StatePool
from tidal.hardware import CPU, is_cuda, on_host, to_device
from tidal.utils import cache_argument

log = logging.getLogger(__name__)
NAME = "tidal_paged"

# model_type -> what the family needed beyond Llama's pieces (docs/engine.md lists the same)
FAMILIES = {
    "llama": "",
    "mistral": "sliding window",
    "qwen2": "qkv bias, sliding window (use_sliding_window)",
    "qwen3": "per-head q/k norm",
    "gemma2": "(1 + w) norms, embedding scale, sliding/global layers, attention and final logit soft-capping",
    "gemma3_text": "(1 + w) norms, q/k norm, embedding scale, sliding/global layers with their own rotary base",
    "phi3": "fused qkv and gate/up projections, partial rotary",
    "glm4": "fused gate/up, interleaved partial rotary, post-norms",
    "olmo2": "post-norms, q/k norm over all heads",
    "qwen3_moe": "MoE: softmax top-k, optional renormalisation",
    "mixtral": "MoE: softmax top-k, renormalised",
    "glm4_moe": "MoE: sigmoid group-limited top-k, shared experts, dense-first layers, scaled",
    "deepseek_v3": "MLA (low-rank q and kv, wider keys than values), MoE as glm4_moe",
    # hybrid: recurrent layers beside attention, their states in `tidal.engine.states`
    "qwen3_next": "Gated DeltaNet layers, gated attention with partial rotary, MoE with a gated shared expert",
    "qwen3_5_text": "Gated DeltaNet layers, gated attention with partial rotary",
    "qwen3_5_moe_text": "as qwen3_5_text, MoE with a gated shared expert",
    "lfm2": "gated short-convolution layers",
    "lfm2_moe": "as lfm2, MoE (sigmoid top-k with an expert bias, scaled)",
    "falcon_h1": "Mamba-2 beside attention in every layer, muP multipliers",
    "granitemoehybrid": "Mamba-2 layers between attention layers, MoE (softmax over the top-k logits)",
    # the language models of vision-language families (`tidal.vision`; llava, Idefics3 and SmolVLM
    # wrap one of the families above)
    "qwen2_vl_text": "3-D rotary positions of image tokens (M-RoPE)",
    "qwen2_5_vl_text": "3-D rotary positions of image tokens (M-RoPE)",
    "qwen3_vl_text": "interleaved M-RoPE, q/k norm, vision features added after the first layers (deepstack)",
    "qwen3_vl_moe_text": "as qwen3_vl_text, MoE: softmax top-k, renormalised",
}


class UnsupportedModelError(ValueError):
    """The engine cannot run this model; the message names the config key or model type."""


# how many parameters and submodules any module of this process has registered (global hooks):
# `ModelRunner.bindings` walks its model's tree again only when this moved
_REGISTRATIONS = [0]


def _registered(*_) -> None:
    _REGISTRATIONS[0] += 1


nn.modules.module.register_module_parameter_registration_hook(_registered)
nn.modules.module.register_module_module_registration_hook(_registered)


def check_supported(config) -> None:
    """Raise `UnsupportedModelError` naming what the engine does not run (for a vision-language
    model: its language model, and its family in `tidal.vision`)."""
    try:
        config = vision.language_config(config)
    except vision.UnsupportedVisionModel as e:
        raise UnsupportedModelError(str(e)) from None
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        raise UnsupportedModelError(
            f"the tidal engine runs {', '.join(FAMILIES)} models; config model_type is {kind!r} "
            "(engine.kind: hf runs any transformers model, slower)"
        )
    for key in ("is_encoder_decoder", "use_bidirectional_attention"):
        if getattr(config, key, False):
            raise UnsupportedModelError(f"config {key}: true ({kind}); the engine runs causal decoder-only models")


@dataclass
class BatchPlan:
    """Index tensors for one step, built once and used by every layer."""

    input_ids: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T] cache slot of each new token
    last: Tensor  # [S] flat index of each sequence's last token (its next-token logits)
    single_tok: Tensor  # [Bd] flat index of the token of each single-token sequence
    single_slots: Tensor  # [Bd, C] cache slots of their contexts (padded with 0)
    single_mask: Tensor  # [Bd, 1, 1, C] True where the slot is part of the context
    single_pos: Tensor  # [Bd, C] position of each context slot (0 .. C-1)
    single_qpos: Tensor  # [Bd] position of each single token
    single_len: Tensor  # [Bd] context length of each single token (its position + 1)
    multi: list[tuple[int, int, Tensor, int]]  # (flat start, end, context slots, cached) per prefill
    # latent layers (MLA): the slots every sequence reads, and the contexts as rows of that union
    union: Tensor | None = None  # [U]
    single_union: Tensor | None = None  # [Bd, C] like single_slots
    multi_union: list[Tensor] = field(default_factory=list)  # like multi's context slots
    windowed: dict[int, Tensor] = field(default_factory=dict)  # single_mask within a sliding window
    only_single: bool = False  # every sequence computes one token (a pure decode step)
    # on a GPU: the single tokens' block tables [Bd, W] int32 (read on the device by
    # `paged_kernel`; single_len their context lengths) instead of their slot lists
    tables: Tensor | None = None
    # on a GPU, the prefilled sequences for `paged_kernel.prefill_attention`
    prefill: paged_kernel.PrefillBatch | None = None
    # a hybrid model's recurrent layers: which tokens continue which state (`tidal.engine.states`)
    states: StatePlan | None = None
    # a vision-language model: the flat tokens that are image placeholders [K] and their feature
    # rows [K, hidden]; Qwen's 3-D positions of every token [3, T] (`tidal.vision`)
    image_at: Tensor | None = None
    image_rows: Tensor | None = None
    rope: Tensor | None = None
    # Gemma 3: per entry of `multi`, the runs [a, b) of positions of its images, whose tokens
    # attend both ways (`vision.within_images`); None when no prefill has one
    blocks: list[list[tuple[int, int]]] | None = None

    @staticmethod
    def decode(
        input_ids: Tensor, positions: Tensor, slots: Tensor, lens: Tensor, tables: Tensor, rotary: Tensor | None = None
    ) -> BatchPlan:
        """A pure decode step's plan from device tensors (`DecodeGraphs`' static buffers);
        `rotary`: Qwen's rotary positions (each token's three are equal), where they differ."""
        empty = torch.zeros(0, 1, dtype=torch.long, device=input_ids.device)
        return BatchPlan(
            input_ids=input_ids,
            positions=positions,
            slots=slots,
            last=torch.arange(input_ids.shape[0], device=input_ids.device),
            single_tok=torch.arange(input_ids.shape[0], device=input_ids.device),
            single_slots=empty,
            single_mask=empty.bool()[:, :, None, None],
            single_pos=empty,
            single_qpos=positions,
            single_len=lens,
            multi=[],
            only_single=True,
            tables=tables,
            rope=rotary.expand(3, -1) if rotary is not None else None,
        )

    def to(self, device: torch.device) -> BatchPlan:
        skip = ("multi", "multi_union", "windowed", "only_single", "blocks")
        moved = {f.name: to_device(getattr(self, f.name), device) for f in fields(self) if f.name not in skip}
        multi = [(start, end, ctx.to(device, non_blocking=True), cached) for start, end, ctx, cached in self.multi]
        multi_union = [ctx.to(device, non_blocking=True) for ctx in self.multi_union]
        return BatchPlan(
            **moved, multi=multi, multi_union=multi_union, only_single=self.only_single, blocks=self.blocks
        )

    def decode_mask(self, window: int | None) -> Tensor:
        """The single tokens' context mask, less the keys a sliding window of `window` hides (a
        query at position i sees keys j with i - j < window, as transformers masks it)."""
        if not window:
            return self.single_mask
        if window not in self.windowed:
            near = self.single_pos > (self.single_qpos[:, None] - window)
            self.windowed[window] = self.single_mask & near[:, None, None, :]
        return self.windowed[window]


def paged_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    tidal_step: tuple[ModelRunner, BatchPlan | None] | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """A transformers attention function (query [1, H, T, D], key/value [1, Hkv, T, D]; returns
    [1, T, H, Dv]). In an engine step (`tidal_step`) it reads and writes the paged cache; called
    without one (the same model run by transformers itself) it attends over the given keys with
    the boolean mask transformers built."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if tidal_step is None:
        if attention_mask is None:  # transformers left it to is_causal
            attention_mask = causal_mask(query.shape[2], key.shape[2], device=query.device)
        return attend(query, key, value, attention_mask.bool(), scale, softcap).transpose(1, 2), None
    runner, plan = tidal_step
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    return runner.attention(module.layer_idx, q, k, v, plan, scale, sliding_window, softcap)[None], None


class LatentCache:
    """The cache an MLA attention module (DeepSeek-V3) calls with its latents, [1, 1, T, rank]
    compressed KV and [1, 1, T, rope] rotated key: `update` stores the step's at their slots and
    returns those of `plan.union`, which the module expands into keys and values. In the start-up
    probe (no plan) it records the latent widths and hands the latents back."""

    def __init__(self, runner: ModelRunner, plan: BatchPlan | None) -> None:
        self.runner, self.plan = runner, plan

    def update(self, kv: Tensor, k_rot: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        r, plan = self.runner, self.plan
        if plan is None:
            r.latent[layer_idx] = (1, kv.shape[-1], k_rot.shape[-1])
            return kv, k_rot
        kc, vc = r.k_cache[r.kv_index[layer_idx]], r.v_cache[r.kv_index[layer_idx]]
        kc.index_copy_(0, plan.slots, kv[0, 0, :, None].to(kc.dtype))
        vc.index_copy_(0, plan.slots, k_rot[0, 0, :, None].to(vc.dtype))
        return (
            kc.index_select(0, plan.union)[None].transpose(1, 2).to(kv.dtype),
            vc.index_select(0, plan.union)[None].transpose(1, 2).to(k_rot.dtype),
        )


AttentionInterface.register(NAME, paged_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # transformers' own calls get boolean masks
NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # a 4D mask is used as given: skips building one
LATENT_FAMILIES = ("deepseek_v3",)  # attention modules that cache latents through `Cache.update`


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        native_attention: bool = True,
        state_slots: int = 0,
        batch_invariant: bool = False,
    ) -> None:
        """`state_slots`: for a hybrid model, the slots of recurrent states to allocate (one per
        sequence that may run, plus the snapshots: `tidal.engine.state_slots`). `batch_invariant`:
        every step under `tidal.invariant.numerics()`, attention by `invariant.attend`, and none
        of the fused kernels, the paged attention kernels or CUDA graphs (they round in their own
        order), so a sequence's logits do not depend on what else the step computes and equal a
        trainer's under the same numerics."""
        self.batch_invariant = batch_invariant
        check_supported(model.config)
        self.model = model
        self.states: StatePool | None = None
        if recurrent.wrap(model):
            if state_slots < 1:
                raise ValueError(f"{model.config.model_type} has recurrent layers: the runner needs state_slots >= 1")
            self.states = StatePool(state_slots, device)
        self.cache_kw = cache_argument(model)  # the forward's name for the KV cache in this transformers
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.cache_dtype = next(model.parameters()).dtype
        self.vision = vision.family(model.config)
        # a vision-language model's vision tower keeps its own attention
        model.set_attn_implementation({"text_config": NAME} if self.vision else NAME)
        if not batch_invariant:  # RMSNorms and SwiGLU activations as one op each where they compute alike
            fuse.fuse(model)
        self.routers = moe.routers(model)
        # pure decode steps of a Llama-shaped model without transformers' plumbing (same bits,
        # checked on the first such step)
        self.decode_path = (
            decode_path.DecodePath(model, self) if not self.routers and decode_path.supports(model) else None
        )
        self.decode_path_checked = False
        # its first step must give transformers' bits on a CPU (the same kernels run both); on a
        # GPU, where a library may pick another kernel for another call shape, agree within rounding
        self.exact_decode_check = not is_cuda(device)
        self._offsets = torch.arange(block_size, device=CPU)
        # per layer: (kv heads, key width, value width), probed from one token
        self.kv_shapes: dict[int, tuple[int, int, int]] = {}
        self.latent: dict[int, tuple[int, int, int]] = {}  # MLA layers: (1, latent rank, rope dims)
        self.k_cache: list[Tensor] = []
        self.v_cache: list[Tensor] = []
        self._buffers: list[Tensor | None] = [None, None]  # decode's gathered keys and values
        # decode attention read from the paged cache in place (`tidal.engine.native`): built on
        # first use, CPU float32 or bfloat16 caches; else (or per layer where it cannot serve) gather + sdpa
        self.native = native_attention and not batch_invariant and device.type == CPU and native.load() is not None
        self.attend = invariant.attend if batch_invariant else attend
        self._probe()
        # on a GPU, decode attention reads block tables on the device (`paged_kernel`, one
        # Triton kernel per layer; its PyTorch reference where Triton is missing), and a cache
        # block past the last is the padding rows' (`DecodeGraphs`)
        # (not under batch-invariant numerics: the kernels sum a query's keys in an order of their own)
        self.device_tables = is_cuda(device) and not self.latent and not batch_invariant
        self.kernel = self.device_tables and self._kernels_work()  # else their PyTorch references
        self.pad_block = num_blocks
        self.graphs: DecodeGraphs | None = None
        self.extra_bindings = tuple  # what else a captured graph reads (the engine's quantized copies)
        self._params: tuple[int, tuple[Tensor, ...]] | None = None  # (`_REGISTRATIONS` then, the parameters)
        self.allocate()

    @torch.inference_mode()
    def _probe(self) -> None:
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        kw = {"position_ids": ids, "attention_mask": NO_MASK, "tidal_step": (self, None), **self._cache(None)}
        self.model(input_ids=ids, **kw)
        self.kv_shapes.update(self.latent)  # an MLA layer caches its latents
        if not self.kv_shapes:
            kind = self.model.config.model_type
            raise UnsupportedModelError(f"{kind}: no attention layer called the engine's attention function")

    def _cache(self, plan: BatchPlan | None) -> dict:
        """The forward's cache arguments: a `LatentCache` for a model with MLA layers (each
        attention module hands its cache what it wants kept), none otherwise."""
        if self.model.config.model_type in LATENT_FAMILIES:
            return {self.cache_kw: LatentCache(self, plan), "use_cache": True}
        return {"use_cache": False}

    def allocate(self) -> None:
        """The KV cache (pages are only resident once a block is written) and, for an MoE model,
        the experts chosen at each slot."""
        slots = (self.num_blocks + 1) * self.block_size  # + the padding block
        layers = sorted(self.kv_shapes)
        # list position of each attention layer's cache (a hybrid model's other layers have none)
        self.kv_index = {layer: n for n, layer in enumerate(layers)}
        opts = {"dtype": self.cache_dtype, "device": self.device}
        self.k_cache = [torch.zeros(slots, self.kv_shapes[i][0], self.kv_shapes[i][1], **opts) for i in layers]
        self.v_cache = [torch.zeros(slots, self.kv_shapes[i][0], self.kv_shapes[i][2], **opts) for i in layers]
        self.routes = None
        if self.routers:
            shape = moe.routing_shape(self.model)
            self.routes = torch.zeros(slots, *shape, dtype=torch.int16, device=self.device)
        if self.states is not None:
            self.states.allocate()

    def release(self) -> None:
        self.k_cache, self.v_cache, self.routes = [], [], None
        if self.states is not None:
            self.states.release()
        self._buffers = [None, None]
        if self.graphs is not None:
            self.graphs.reset()

    def use_static_decode(self, max_seqs: int, max_len: int, capture: bool) -> str | None:
        """Run pure decode steps of up to `max_seqs` sequences through `DecodeGraphs`: from CUDA
        graphs captured now (`capture`, on a GPU) or eagerly over the same static buffers (a CPU
        in tests). Returns why not, where the model cannot (None when it does)."""
        if self.batch_invariant:
            return "engine batch_invariant: decode steps attend by tidal.invariant.attend, not the graphs' paged kernel"
        if self.decode_path is None:
            kind = self.model.config.model_type
            families = ", ".join(decode_path.WINDOWS)
            return f"{kind} steps run transformers' forward (the decode path covers {families}, without MoE)"
        if self.latent:
            return "latent attention (MLA) reads its cache through transformers' forward"
        if not self.device_tables:  # a CPU in tests (a GPU has them from the start)
            self.device_tables = True
            self.kernel = self._kernels_work()  # with Triton's interpreter
        width = min(-(-max_len // self.block_size), self.num_blocks)
        self.graphs = DecodeGraphs(
            self.decode_path,
            BatchPlan.decode,
            self.bindings,
            self.device,
            max_seqs,
            width,
            self.block_size,
            self.pad_block,
            capture,
            self._rope_offsets if self.vision is not None and self.vision.mrope else None,
        )
        if capture:
            self.graphs.capture_all()
        return None

    def _kernels_work(self) -> bool:
        """Whether the paged attention kernels run here and agree with their references on a
        sample (checked once; the reason is logged where they do not)."""
        if not paged_kernel.runs_on(self.device):
            return False
        why = paged_kernel.self_check(self.device, self.cache_dtype)
        if why:
            log.warning("paged attention kernels off (their PyTorch references run): %s", why)
        return why is None

    def bindings(self) -> tuple[int, ...]:
        """The storage a captured graph reads: parameters, caches and the engine's extras. Read
        before every replay, so the walk over the module tree (~2 ms a step on an H100's host) is
        done again only after some module registered a parameter or submodule (`_REGISTRATIONS`:
        a parameter replaced, a trainer's LoRA layers adopted); a parameter whose `.data` moved is
        the same object, and its new address is read here every time."""
        if self._params is None or self._params[0] != _REGISTRATIONS[0]:
            self._params = (_REGISTRATIONS[0], tuple(self.model.parameters()))
        tensors = (*self._params[1], *self.k_cache, *self.v_cache)
        return tuple(t.data_ptr() for t in tensors) + tuple(self.extra_bindings())

    def kv_bytes(self) -> int:
        slots = self.num_blocks * self.block_size
        per_slot = sum(h * (dk + dv) for h, dk, dv in self.kv_shapes.values())
        return slots * per_slot * self.cache_dtype.itemsize

    @on_host
    def _context_slots(self, seq: Sequence, end: int) -> Tensor:
        """Cache slots of positions 0..end-1 of `seq` (block b holds slots b*bs .. b*bs+bs-1)."""
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return (table[:, None] * self.block_size + self._offsets).view(-1)[:end]

    def plan(self, seqs: list[Sequence]) -> BatchPlan:
        """The step's index tensors, built on the host and copied to the device at once."""
        return self._host_plan(seqs).to(self.device)

    @on_host
    def _host_plan(self, seqs: list[Sequence]) -> BatchPlan:
        # Built from Python lists with a few tensor calls: a decode step's plan is rebuilt every
        # step, and per-sequence tensor ops cost more than the whole plan's arithmetic.
        bs = self.block_size
        ids, pos, slots, last = [], [], [], []
        single_tok, single_len, single_tables, multi, multi_tables = [], [], [], [], []
        image_at, image_rows = [], []
        blocks: list[list[tuple[int, int]]] = []
        flat = 0
        for seq in seqs:
            start, end = seq.num_cached, seq.num_tokens
            table = seq.block_table
            if seq.images is not None and start < seq.images.where[-1] + 1:
                where = seq.images.where
                first = bisect.bisect_left(where, start)
                stop = bisect.bisect_left(where, end)
                image_at.extend(flat + w - start for w in where[first:stop])
                image_rows.append(seq.images.rows[first:stop])
            if end - start == 1:
                ids.append(seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1])
                pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                single_tok.append(flat)
                single_len.append(end)
                single_tables.append(table)
            else:
                ctx = self._context_slots(seq, end)
                ids.extend(seq.tokens[start:end])
                pos.extend(range(start, end))
                slots.extend(ctx[start:].tolist())
                multi.append((flat, flat + end - start, ctx, start))
                multi_tables.append(table)
                blocks.append([(a, b) for a, b in seq.images.blocks if b > start] if seq.images is not None else [])
            flat += end - start
            last.append(flat - 1)
        tables = None
        if single_tables and self.device_tables:
            lengths = torch.tensor(single_len)
            width = max(len(t) for t in single_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in single_tables], dtype=torch.int32)
            single_slots = single_pos = torch.zeros(0, 1, dtype=torch.long)
            single_mask = torch.zeros(0, 1, 1, 1, dtype=torch.bool)
            single_qpos = lengths - 1
        elif single_tables:
            lengths = torch.tensor(single_len)
            width = max(len(t) for t in single_tables)
            table = torch.tensor([t + [0] * (width - len(t)) for t in single_tables])
            single_slots = (table[:, :, None] * bs + self._offsets).view(len(single_tables), -1)
            single_slots = single_slots[:, : int(lengths.max())]
            single_pos = torch.arange(single_slots.shape[1])[None, :].expand(len(single_tables), -1)
            single_mask = (single_pos < lengths[:, None])[:, None, None, :]
            # past a sequence's length: slot 0, masked out, and a row of the latent union too
            single_slots = single_slots.masked_fill(~single_mask[:, 0, 0], 0)
            single_qpos = lengths - 1
        else:
            lengths = torch.zeros(0, dtype=torch.long)
            single_slots = single_pos = torch.zeros(0, 1, dtype=torch.long)
            single_mask = torch.zeros(0, 1, 1, 1, dtype=torch.bool)
            single_qpos = torch.zeros(0, dtype=torch.long)
        prefill = None
        blocks = blocks if any(blocks) else None
        if multi and self.device_tables and blocks is None:  # the kernel's masks are causal
            width = max(len(t) for t in multi_tables)
            news = [end - start for start, end, _, _ in multi]
            prefill = paged_kernel.PrefillBatch(
                torch.tensor([t + [0] * (width - len(t)) for t in multi_tables], dtype=torch.int32),
                torch.tensor([start for start, _, _, _ in multi]),
                torch.tensor(news),
                torch.tensor([cached for _, _, _, cached in multi]),
                max(news),
            )
        latent = {}
        if self.latent:  # every slot read this step, once; contexts as rows of it
            union = torch.unique(torch.cat([self._context_slots(s, s.num_tokens) for s in seqs]))
            latent = {
                "union": union,
                "single_union": torch.searchsorted(union, single_slots),
                "multi_union": [torch.searchsorted(union, ctx) for _, _, ctx, _ in multi],
            }
        states = self._state_plan(seqs) if self.states is not None else None
        rope = self._rope(seqs, torch.tensor(pos)) if self.vision is not None and self.vision.mrope else None
        return BatchPlan(
            states=states,
            image_at=torch.tensor(image_at, dtype=torch.long) if image_at else None,
            image_rows=torch.cat(image_rows) if image_at else None,
            rope=rope,
            blocks=blocks,
            input_ids=torch.tensor(ids),
            positions=torch.tensor(pos),
            slots=torch.tensor(slots),
            last=torch.tensor(last),
            single_tok=torch.tensor(single_tok, dtype=torch.long),
            single_slots=single_slots,
            single_mask=single_mask,
            single_pos=single_pos,
            single_qpos=single_qpos,
            single_len=lengths,
            multi=multi,
            only_single=not multi,
            tables=tables,
            prefill=prefill,
            **latent,
        )

    @staticmethod
    def _rope_offsets(seqs: list[Sequence]) -> list[int]:
        """Each sequence's offset of its rotary positions past its prompt (Qwen's images)."""
        return [s.images.delta if s.images is not None else 0 for s in seqs]

    @staticmethod
    def _rope(seqs: list[Sequence], positions: Tensor) -> Tensor:
        """Qwen's 3-D positions of the step's tokens [3, T]: a prompt's from `SeqImages.rope`,
        every later token's (and a text-only prompt's) its position + the sequence's delta."""
        rope = positions.expand(3, -1).clone()
        flat = 0
        for seq in seqs:
            start, end = seq.num_cached, seq.num_tokens
            im = seq.images
            if im is not None:
                rope[:, flat : flat + end - start] += im.delta
                known = min(end, im.rope.shape[1])
                if start < known:
                    rope[:, flat : flat + known - start] = im.rope[:, start:known]
            flat += end - start
        return rope

    @staticmethod
    def _state_plan(seqs: list[Sequence]) -> StatePlan:
        """Which flat tokens continue which sequence's states: single tokens after a first one
        decode together; the rest (several tokens, or a sequence's first) go one by one. And where
        a sequence's states are to be kept as snapshots (`seq.snapshots_due`)."""
        decode_tok, decode_slots, snap_rows, snap_slots, prefill = [], [], [], [], []
        flat = 0
        for seq in seqs:
            start, end = seq.num_cached, seq.num_tokens
            if seq.state_slot < 0:
                raise RuntimeError(f"request {seq.request_id}: no state slot (hybrid model)")
            if end - start == 1 and start > 0:
                for _, slot, _ in seq.snapshots_due:  # after this token: its block's end
                    snap_rows.append(len(decode_tok))
                    snap_slots.append(slot)
                decode_tok.append(flat)
                decode_slots.append(seq.state_slot)
            else:
                cuts = tuple((b - start, slot) for b, slot, _ in seq.snapshots_due)
                prefill.append((flat, flat + end - start, seq.state_slot, start > 0, cuts))
            flat += end - start
        return StatePlan(
            *(torch.tensor(x, dtype=torch.long) for x in (decode_tok, decode_slots, snap_rows, snap_slots)), prefill
        )

    def attention(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        plan: BatchPlan | None,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> Tensor:
        """Write the step's new keys/values [T, Hkv, D] of `layer` to their slots, then attend:
        q [T, H, D] → [T, H, Dv]. Without a plan (the start-up probe) only record the shapes."""
        if plan is None:
            self.kv_shapes[layer] = (k.shape[1], k.shape[2], v.shape[2])
            return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        if layer in self.latent:  # k, v: the expanded union of the step's contexts (`LatentCache`)
            kc, vc = k, v
            single_src, multi_src = plan.single_union, plan.multi_union
        else:
            kc, vc = self.k_cache[self.kv_index[layer]], self.v_cache[self.kv_index[layer]]
            kc.index_copy_(0, plan.slots, k.to(kc.dtype))
            vc.index_copy_(0, plan.slots, v.to(vc.dtype))
            single_src, multi_src = plan.single_slots, [ctx for _, _, ctx, _ in plan.multi]
        hkv = kc.shape[1]
        if plan.single_tok.numel():
            b = plan.single_tok.numel()
            # grouped-query attention with one query token: the G query heads sharing a KV head
            # become G query rows of that head (query head h uses KV head h // G), which is about
            # twice as fast on CPU as sdpa's enable_gqa
            qs = q if plan.only_single else q[plan.single_tok]
            if plan.tables is not None:
                attend_paged = paged_kernel.decode_attention if self.kernel else paged_kernel.reference_decode_attention
                o = attend_paged(qs, kc, vc, plan.tables, plan.single_len, self.block_size, scale, window, softcap)
            elif self.native and native.supports(qs, kc, vc):
                o = native.decode_attention(qs, kc, vc, single_src, plan.single_len, scale, window, softcap)
            else:
                qd = qs.reshape(b, hkv, -1, q.shape[2])  # [B, Hkv, G, D]
                kd = self._gather(kc, single_src, 0).transpose(1, 2)
                vd = self._gather(vc, single_src, 1).transpose(1, 2)
                o = self.attend(qd, kd, vd, plan.decode_mask(window), scale, softcap).reshape(b, -1, vc.shape[2])
            if plan.only_single:
                return o
        out = q.new_empty(q.shape[0], q.shape[1], vc.shape[2])
        if plan.single_tok.numel():
            out[plan.single_tok] = o
        if plan.prefill is not None and self.kernel:  # every prefilled sequence in one kernel
            paged_kernel.prefill_attention(q, out, kc, vc, plan.prefill, self.block_size, scale, window, softcap)
            return out
        for i, ((start, end, _, cached), ctx) in enumerate(zip(plan.multi, multi_src, strict=True)):
            qs = q[start:end].transpose(0, 1)[None]  # [1, H, L, D]
            ks = kc.index_select(0, ctx).transpose(0, 1)[None]  # [1, Hkv, C, D]
            vs = vc.index_select(0, ctx).transpose(0, 1)[None]
            mask = causal_mask(end - start, len(ctx), cached, window, q.device)  # query i at cached + i
            if plan.blocks is not None and plan.blocks[i]:
                mask = vision.within_images(mask, cached, plan.blocks[i], window)
            out[start:end] = self.attend(qs, ks, vs, mask, scale, softcap)[0].transpose(0, 1)
        return out

    def _gather(self, cache: Tensor, src: Tensor, which: int) -> Tensor:
        """cache[src] ([*src.shape, *cache.shape[1:]]) by index_select (much faster than advanced
        indexing on a CPU) into a buffer kept between layers and steps (`which`: 0 keys, 1 values):
        a fresh tensor of that size per layer costs page faults, ~40% on top of the copy."""
        shape = (*src.shape, *cache.shape[1:])
        n = math.prod(shape)
        buf = self._buffers[which]
        if buf is None or buf.numel() < n or buf.dtype != cache.dtype or buf.device != cache.device:
            buf = self._buffers[which] = cache.new_empty(n)
        out = buf[:n].view(-1, *cache.shape[1:])
        torch.index_select(cache, 0, src.reshape(-1), out=out)
        return out.view(shape)

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence]) -> Tensor:
        """Compute the uncached tokens of `seqs`, write their K/V (and an MoE model's routing),
        and return the next-token logits of each sequence [S, V] in the model's dtype."""
        if not self.batch_invariant:
            return self._step(seqs)
        with invariant.numerics():
            return self._step(seqs)

    def _step(self, seqs: list[Sequence]) -> Tensor:
        if self.states is not None:  # sequences starting from a snapshot (a prefix-cache hit)
            starting = [s for s in seqs if s.state_from >= 0]
            if starting:
                self.states.copy([s.state_from for s in starting], [s.state_slot for s in starting])
                for s in starting:
                    s.state_from = -1
        graphs = self.graphs if self.decode_path is not None and self.decode_path_checked else None
        if graphs is not None and graphs.size_for(len(seqs)) and all(s.num_tokens - s.num_cached == 1 for s in seqs):
            return graphs.run(seqs)
        plan = self.plan(seqs)
        if self.decode_path is not None and plan.only_single:
            if self.decode_path_checked:
                return self.decode_path(plan)
            # the first decode step runs both (transformers' last: its K/V stay) and compares
            fast, logits = self.decode_path(plan), self._model_forward(plan)
            self.decode_path_checked = self._agree(fast, logits)
            if not self.decode_path_checked:
                self.decode_path = None
            return logits
        return self._model_forward(plan)

    def _agree(self, fast: Tensor, logits: Tensor) -> bool:
        """Whether the decode path computed transformers' logits (`decode_path.agrees`: the same
        bits where `exact_decode_check`, else within rounding)."""
        ok, how = decode_path.agrees(fast, logits, self.exact_decode_check)
        if ok:  # said where they are not the same bits (a GPU's rounding); else only on request
            level = logging.DEBUG if torch.equal(fast, logits) else logging.INFO
            log.log(level, "the decode path agrees with transformers' forward: %s", how)
        else:
            log.warning("the decode path's logits differ from transformers' (%s): kept off", how)
        return ok

    def _model_forward(self, plan: BatchPlan) -> Tensor:
        """The step as transformers' forward of the model."""
        kw = {
            "position_ids": plan.rope[:, None] if plan.rope is not None else plan.positions[None],
            "logits_to_keep": plan.last,
            "attention_mask": NO_MASK,
            "tidal_step": (self, plan),
            **self._cache(plan),
        }
        if is_cuda(self.device):  # not cuDNN's attention: it is re-planned for every new set of lengths
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                return self._call_model(plan, kw)
        return self._call_model(plan, kw)

    def _call_model(self, plan: BatchPlan, kw: dict) -> Tensor:
        """The step's logits [rows kept, vocab]; an MoE model's routing written to `routes`."""
        if self.routes is None:
            return self._forward(plan, kw)
        with moe.capture(self.model) as routing:
            logits = self._forward(plan, kw)
        self.routes.index_copy_(0, plan.slots, routing.take().to(self.routes.dtype))
        return logits

    def _forward(self, plan: BatchPlan, kw: dict) -> Tensor:
        if plan.image_at is None:
            return self.model(input_ids=plan.input_ids[None], **kw).logits[0]
        # image placeholders: their embeddings are the image's features
        embeds = vision.merge(self.model, plan.input_ids, plan.image_at, plan.image_rows)[None]
        if not self.vision.deepstack:
            return self.model(inputs_embeds=embeds, **kw).logits[0]
        # more of them join the first layers' hidden states, which the language model takes
        kw.update(vision.deepstack_inputs(plan.image_at, plan.image_rows, (1, plan.input_ids.shape[0])))
        last = kw.pop("logits_to_keep")
        kw.pop(self.cache_kw, None)
        hidden = self.model.model.language_model(inputs_embeds=embeds, **kw).last_hidden_state
        return self.model.lm_head(hidden[0, last])

    @torch.inference_mode()
    def copy_twins(self, twins: list[Sequence]) -> None:
        """Write each twin's uncached positions from its `twin` (same tokens, computed this step):
        the keys and values of every layer, and an MoE model's routing, slot for slot."""
        src, dst = [], []
        for seq in twins:
            lead = seq.twin
            if lead is None or lead.keys != seq.keys or lead.num_cached > seq.num_cached:
                raise RuntimeError(f"request {seq.request_id}: its twin does not compute its uncached tokens")
            start, end = seq.num_cached, seq.num_tokens
            src.append(self._context_slots(lead, end)[start:])
            dst.append(self._context_slots(seq, end)[start:])
        src, dst = torch.cat(src).to(self.device), torch.cat(dst).to(self.device)
        for cache in (*self.k_cache, *self.v_cache, *([self.routes] if self.routes is not None else [])):
            cache.index_copy_(0, dst, cache.index_select(0, src))
        if self.states is not None:  # the lead's states after the prompt (the twin's tokens)
            self.states.copy([s.twin.state_slot for s in twins], [s.state_slot for s in twins])

    def routing(self, seq: Sequence) -> Tensor | None:
        """The experts chosen at positions 0 .. n - 2 of `seq` (every position whose forward
        predicts a token), [n - 1, moe layers, top-k]; None for a dense model."""
        if self.routes is None:
            return None
        ctx = self._context_slots(seq, seq.num_tokens - 1).to(self.device)
        return self.routes.index_select(0, ctx).cpu()
