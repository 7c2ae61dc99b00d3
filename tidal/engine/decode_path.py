"""A decode step of a Llama-shaped model without transformers' per-layer plumbing.

In a pure decode step (every sequence computes one token) of a small model on a CPU, what runs
around the matrix products costs as much as the attention: each layer's forward goes through
the decoder layer's and attention module's `__call__`, keyword plumbing and deprecation wrappers,
the attention-interface lookup, [1, T, ...] views and transposes. `DecodePath` runs the same
modules in the same order on the flat batch: the embedding, the model's rotary module (its
scaling), per layer the norm modules, the q/k/v/o projections (packed or quantized by the
engine, biases included; q, k and v as one product where the engine joined them: the same bits,
`quant.JoinedLinear`), the rotary embedding (`native.rotary` on a CPU, the same bits as the
family's own `apply_rotary_pos_emb`, which runs elsewhere), the engine's paged attention
with the layer's scale and sliding window, the residual adds, the MLP module; then the final
norm and the output head. The ops and their order are the transformers forward's, so the logits
are its bits: the engine checks that on its first decode step (both paths: the same bits on a CPU,
within rounding on a GPU, `agrees`) and keeps transformers' path for good if they differ.

Families: those whose decoder layer is Llama's (pre-norm attention and MLP with residuals): llama,
mistral (the config's sliding window on every layer), qwen2 (each layer's own window) and qwen3
(qwen2's, with a per-head RMSNorm of q and k before the rotary embedding), and the language
models of Qwen2-VL, Qwen2.5-VL (qwen2's) and Qwen3-VL (qwen3's), whose 3-D rotary positions are
one position in a decode step; their forwards were read for this, transformers 5.x. Steps with a
prefill, other families, and models with hooks (MoE routing capture) run transformers' forward.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

from tidal import vision
from tidal.engine import fused_kernels, native
from tidal.engine.quant import project
from tidal.hardware import CPU

# model_type -> the sliding window an attention module passes to the attention function
WINDOWS = {
    "llama": lambda attn: None,
    "mistral": lambda attn: getattr(attn.config, "sliding_window", None),
    "qwen2": lambda attn: attn.sliding_window,
    "qwen3": lambda attn: attn.sliding_window,
    # the language models of Qwen's vision-language families: after the prompt their three rotary
    # positions are equal (index + the sequence's offset, `BatchPlan.rope`), where M-RoPE's cos
    # and sin are 1-D RoPE's at that position
    "qwen2_vl_text": lambda attn: attn.sliding_window,
    "qwen2_5_vl_text": lambda attn: attn.sliding_window,
    "qwen3_vl_text": lambda attn: None,
}
QK_NORM = ("qwen3", "qwen3_vl_text")  # per-head RMSNorm of q and k after their projections, before the rotary


def rounding_tolerance(dtype: torch.dtype) -> float:
    """The largest relative error `agrees` lets pass in logits of `dtype`: 6·eps(dtype), at least
    1e-4 (bf16: 0.047; fp16: 0.0059; fp32: 1e-4)."""
    return max(6 * torch.finfo(dtype).eps, 1e-4)


def relative_error(fast: Tensor, ref: Tensor) -> float:
    """‖fast − ref‖ / ‖ref‖ over the whole batch of logits (Frobenius norms, in float32)."""
    ref32 = ref.float()
    return float((fast.float() - ref32).norm() / ref32.norm().clamp_min(torch.finfo(torch.float32).tiny))


def agrees(fast: Tensor, ref: Tensor, exact: bool) -> tuple[bool, str]:
    """Whether the decode path's logits `fast` [B, V] are transformers' `ref` for the same step, and
    how far apart they are (for the log).

    `exact` (a CPU, where both run the same kernels): the same bits. Otherwise (a GPU, where a
    library may pick another kernel for another call shape, or a fused op rounds once where the
    module's ops round twice) within rounding: relative_error(fast, ref) ≤ rounding_tolerance. A
    maximum over the batch cannot tell the two apart in 16-bit types: one rounding apart in the
    rotary embedding moves real SmolLM2's bf16 logits (8 to 64 rows) by 1.5-1.9% of the largest
    logit and by 0.005-0.019 in relative error, where a position off by one or a context one token
    short gives 0.10-0.21 (on a CPU, `python -m bench decode_check`; `tests/engine/test_decode_path.py`
    holds tiny models' cases)."""
    if torch.equal(fast, ref):
        return True, "the same bits"
    diff = float((fast.float() - ref.float()).abs().max())
    if exact:
        return False, f"max |difference| {diff:.3g}; on this device they must be equal"
    err, tol = relative_error(fast, ref), rounding_tolerance(ref.dtype)
    return err <= tol, f"max |difference| {diff:.3g}, relative error {err:.3g} (rounding allows {tol:.3g})"


def family(model: nn.Module) -> str:
    """The model type of `model`'s language model (a vision-language model's: its text config's)."""
    return vision.language_config(model.config).model_type


def supports(model: nn.Module) -> bool:
    """Whether `model` has the Llama-shaped structure this path runs (a vision-language model:
    its language model has; its images go in at prefill, which runs transformers' forward)."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else None
    needed = ("embed_tokens", "rotary_emb", "norm", "layers")
    if family(model) not in WINDOWS or inner is None or not all(hasattr(inner, n) for n in needed):
        return False
    parts = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    return all(
        all(hasattr(layer, p) for p in parts) and all(hasattr(layer.self_attn, p) for p in projections)
        for layer in inner.layers
    ) and hasattr(model, "lm_head")


class DecodePath:
    """Next-token logits [B, V] of a pure decode step, computed as transformers' forward computes
    them (see the module docstring); `runner` is the `ModelRunner` whose cache it reads and writes."""

    def __init__(self, model: nn.Module, runner) -> None:
        self.model, self.runner = model, runner
        inner = self.decoder = model.get_decoder()  # a vision-language model's language model
        self.rope = sys.modules[type(inner.layers[0].self_attn).__module__].apply_rotary_pos_emb
        # the rotary embedding in one C pass (the family's function's bits: rotate-half layout)
        w = inner.embed_tokens.weight
        head_dims = {layer.self_attn.head_dim for layer in inner.layers}
        # not under batch-invariant numerics, which the trainer's forward shares: the family's own
        self.native_rope = (
            not runner.batch_invariant
            and w.device.type == CPU
            and w.dtype in native.CACHE_DTYPES
            and all(d % 16 == 0 for d in head_dims)
            and native.load() is not None
        )
        # on a GPU: q's and k's rotary embedding in one Triton kernel, where it computes what the
        # family's function computes (checked here on a sample)
        self.fused_rope = (
            not self.native_rope
            and not runner.batch_invariant
            and fused_kernels.available(w.device)
            and self._rope_agrees(w)
        )
        window = WINDOWS[family(model)]
        self.windows = [window(layer.self_attn) for layer in inner.layers]
        self.qk_norm = family(model) in QK_NORM

    def _rope_agrees(self, w: Tensor) -> bool:
        """Whether `fused_kernels.rotary` gives the family's rotary embedding bit for bit on a
        sample. Nothing looser, though the first decode step's check (`agrees`) would let one
        rounding pass on a GPU: through a bf16 model one rounding apart in q and k grows to about
        1% of the logits, and the engine's decode steps then stray from transformers' own
        decoding, not only from a trainer's forward (a GPU may fuse a float32 product into the
        sum; Triton's interpreter narrows to bf16 by truncation)."""
        inner = self.decoder
        attn = inner.layers[0].self_attn
        heads, d = attn.config.num_attention_heads, attn.head_dim
        kv = attn.config.num_key_value_heads
        gen = torch.Generator(device=CPU).manual_seed(0)
        q = torch.randn(5, heads, d, generator=gen, device=CPU).to(w.device, w.dtype)
        k = torch.randn(5, kv, d, generator=gen, device=CPU).to(w.device, w.dtype)
        positions = torch.tensor([[0, 1, 7, 100, 3000]], device=w.device)
        try:
            with torch.no_grad():
                cos, sin = inner.rotary_emb(q.transpose(0, 1)[None], positions)
                got = fused_kernels.rotary(q, k, cos[0], sin[0])
                want = self.rope(q[None].transpose(1, 2), k[None].transpose(1, 2), cos, sin)
        except Exception:  # a kernel that does not compile here
            return False
        want = (want[0][0].transpose(0, 1), want[1][0].transpose(0, 1))
        return all(torch.equal(g, x) for g, x in zip(got, want, strict=True))

    @torch.no_grad()  # also where a CUDA graph captures it: the fused ops run only without grad
    def __call__(self, plan) -> Tensor:
        # Modules are looked up at each call, and so are their `forward`s: the engine replaces
        # some after start-up (packed or quantized projections, fused norms, a trainer's LoRA
        # layers given to the engine). They are called without `__call__`'s hook machinery.
        inner, b = self.decoder, plan.input_ids.shape[0]
        x = inner.embed_tokens.forward(plan.input_ids)  # [B, hidden]
        rotary = plan.positions if plan.rope is None else plan.rope[0]  # Qwen's: all three rows equal
        cos, sin = inner.rotary_emb.forward(x[None], rotary[None])  # [1, B, D]
        cos_b, sin_b = cos[0], sin[0]
        for layer, window in zip(inner.layers, self.windows, strict=True):
            attn, d = layer.self_attn, layer.self_attn.head_dim
            h = layer.input_layernorm.forward(x)
            q, k, v = (y.view(b, -1, d) for y in project((attn.q_proj, attn.k_proj, attn.v_proj), h))  # [B, heads, D]
            if self.qk_norm:
                q, k = attn.q_norm.forward(q), attn.k_norm.forward(k)
            if self.fused_rope:
                q, k = fused_kernels.rotary(q, k, cos_b, sin_b)
            elif self.native_rope:
                q, k = native.rotary(q, cos_b, sin_b), native.rotary(k, cos_b, sin_b)
            else:  # as the attention module calls it, on [1, heads, B, D] views
                q, k = self.rope(q[None].transpose(1, 2), k[None].transpose(1, 2), cos, sin)
                q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)
            o = self.runner.attention(attn.layer_idx, q, k, v, plan, attn.scaling, window, None)
            x = x + attn.o_proj.forward(o.reshape(b, -1))
            x = x + layer.mlp.forward(layer.post_attention_layernorm.forward(x))
        return self.model.lm_head.forward(inner.norm.forward(x))
