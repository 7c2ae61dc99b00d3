"""Recurrent layers of hybrid models: what their transformers modules keep, and who feeds them.

Hybrid families (Qwen3-Next and Qwen3.5: Gated DeltaNet; Falcon-H1 and Granite 4 hybrids:
Mamba-2; LFM2: short convolutions) mix attention layers with token mixers that carry a state
from one token to the next instead of reading every earlier key:

    conv state  c_t: the last K inputs of a causal depthwise convolution (K = its kernel size),
    recurrent state S_t: GDN's S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T per head,
                         Mamba-2's h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t per head.

In transformers 5 every such mixer reads and writes its states only through five cache calls
(`get_conv_state`, `get_recurrent_state`, `update_conv_state`, `update_recurrent_state`,
`is_recording_past`), so its own PyTorch math runs unchanged when handed a `StateView`: the
states of the sequences in one call, taken out of whatever pool holds them and put back after.

`wrap(model)` replaces each mixer's forward with a dispatcher, one of three callers:
- the engine (`tidal_step` keyword): `tidal.engine.states.StatePool` runs the step's decode
  tokens as one batch with their states and each prefill from its own (or no) state;
- a packed training row (`tidal_layout` keyword, `tidal.train.attention.PackedLayout`): the row's
  samples run as a right-padded batch with no state, so no state flows from one sample into the
  next (a causal recurrence never reads the padding after a real token);
- anything else (padded batches, `generate`): transformers' forward as it is.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

# The token-mixer class of each hybrid family in transformers 5.24 (their forwards read states
# only through `StateView`'s calls), with what the engine needed for the family.
MIXERS: dict[str, str] = {
    "Qwen3NextGatedDeltaNet": "Gated DeltaNet (conv + delta-rule state), gated attention, MoE with a shared expert",
    "Qwen3_5GatedDeltaNet": "Gated DeltaNet (conv + delta-rule state), gated attention",
    "Qwen3_5MoeGatedDeltaNet": "Gated DeltaNet (conv + delta-rule state), gated attention, MoE",
    "Lfm2ShortConv": "gated short convolution (conv state only)",
    "Lfm2MoeShortConv": "gated short convolution (conv state only), MoE",
    "FalconH1Mixer": "Mamba-2 (conv + SSM state) beside attention in every layer, muP multipliers",
    "GraniteMoeHybridMambaLayer": "Mamba-2 (conv + SSM state) layers between attention layers, MoE",
}


# mixers whose fused training kernel (mamba_ssm's, on a GPU) reads these linear layers' weights
# directly, past any adapter (peft refuses LoRA on them for the model types it knows)
_FUSED_WEIGHTS: dict[str, tuple[str, ...]] = {
    "FalconH1Mixer": ("out_proj",),
    "GraniteMoeHybridMambaLayer": ("out_proj",),
}


def lora_excluded(model: nn.Module) -> set[str]:
    """Short names of linear layers that LoRA's all-linear leaves out in `model` (`_FUSED_WEIGHTS`)."""
    return {name for m in mixers(model) for name in _FUSED_WEIGHTS.get(type(m).__name__, ())}


def mixers(model: nn.Module) -> list[nn.Module]:
    """The model's recurrent token mixers in layer order; [] for a model without any."""
    return [m for m in model.modules() if type(m).__name__ in MIXERS]


class StateView:
    """The cache a mixer sees for one call over a batch of sequences: their conv and recurrent
    states ([B, ...] each), or none (`conv` None: the sequences start in this call).

    It keeps what transformers' `LinearAttentionLayer` keeps, the same way: the last K inputs of
    the convolution (left-padded with zeros when a first call is shorter), and the recurrent
    state as the mixer hands it over. Decode calls update both in place (transformers' single-
    token kernels do), prefill calls replace them; either way `conv`/`recurrent` hold the states
    after the call."""

    def __init__(self, conv: Tensor | None = None, recurrent: Tensor | None = None) -> None:
        self.conv = conv
        self.recurrent = recurrent
        self.previous = conv is not None or recurrent is not None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self.conv if self.previous else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self.recurrent if self.previous else None

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(
        self, inputs: Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs
    ) -> Tensor:
        """`inputs` [B, C, L] → the convolution's input with its left context [B, C, K + L]
        (or [B, C, max(L, K)] in a first call); keeps its last K columns."""
        if conv_kernel_size is None:
            raise ValueError("StateView.update_conv_state: the mixer gave no conv_kernel_size")
        if self.previous and self.conv is not None:
            full = torch.cat([self.conv.to(inputs.dtype), inputs], dim=-1)
        else:
            full = inputs
            if full.shape[-1] < conv_kernel_size:
                full = nn.functional.pad(full, (conv_kernel_size - full.shape[-1], 0))
        self.conv = full[..., -conv_kernel_size:].contiguous()
        return full

    def update_recurrent_state(self, state: Tensor, layer_idx: int | None = None, state_idx: int = 0, **kw) -> Tensor:
        self.recurrent = state
        return state


def wrap(model: nn.Module) -> int:
    """Route every recurrent mixer of `model` through `_dispatch` (idempotent); returns how many
    mixers the model has."""
    found = mixers(model)
    for m in found:
        if not getattr(m, "_tidal_wrapped", False):
            m.forward = functools.partial(_dispatch, m, m.forward)
            m._tidal_wrapped = True
    return len(found)


def _dispatch(
    mixer: nn.Module,
    forward,
    hidden_states: Tensor,
    cache=None,
    attention_mask: Tensor | None = None,
    tidal_step=None,
    tidal_layout=None,
    **kwargs,
) -> Tensor:
    if tidal_step is not None:  # (runner, plan) of an engine step (`tidal.engine.model_runner`)
        runner, plan = tidal_step
        return runner.states.run(mixer, forward, hidden_states, plan)
    if tidal_layout is not None and hidden_states.shape[0] == 1:
        return packed_forward(forward, hidden_states, tidal_layout)
    return forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)


def packed_forward(forward, hidden_states: Tensor, layout) -> Tensor:
    """A packed row [1, S, H] through the mixer as the right-padded batch [B, L, H] of its
    samples (`layout`, the row's `PackedLayout`), each from no state; back to [1, S, H]."""
    h = hidden_states.shape[-1]
    padded = hidden_states[0].index_select(0, layout.to_padded).view(layout.batch, layout.length, h)
    out = forward(padded, cache=None, attention_mask=None)
    return out.reshape(layout.batch * layout.length, -1).index_select(0, layout.to_packed)[None]
