"""The engine's model runs some of transformers' small ops as one fused op, where that computes
the same thing.

A decoder layer in transformers is ~60 small torch ops; on a CPU each costs a dispatch of a few
µs and, in bfloat16, a widening copy, which at a decode step's few rows costs more than the math.
Two pieces are replaced on the engine's model (never on a trainer's: the model is the engine's own):

- **RMSNorm** modules, `w · round(x / sqrt(mean(x²) + eps))` (the normalised row rounded to the
  input's dtype, then the weight's product): `native.rms_norm` in one pass per row on a CPU where
  the native kernels are built (float32 or bfloat16, rounding where the module rounds, so bf16
  outputs are the module's bits); else `F.rms_norm` (float32: it rounds once where the module
  rounds twice, so a bf16 norm keeps its own forward there); on a GPU `fused_kernels.rms_norm`,
  one Triton kernel that rounds where the module rounds.
- **SwiGLU MLPs**, `down(silu(gate(x)) · up(x))`, on a CPU: gate and up as one packed product
  where the engine joined them (`quant.project`; else the module's own projections, packed or
  quantized by the engine), then in float32 `native.silu_mul` for the activation and the
  product, in bfloat16 torch's two ops (as fast there: 0.988x the step at batch 32, 1.012x at
  128), the module's own.

Each module is checked on a sample input against its own forward before it is replaced (within
one rounding of its dtype), so a module of another formula — Gemma's `(1 + w)` norms, a GeLU or
fused gate/up MLP — keeps its forward. The fused forwards are for inference: with gradients
enabled they call the module's own (the C kernels have no backward).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tidal.engine import fused_kernels, native
from tidal.engine.quant import project
from tidal.hardware import CPU

# the largest difference a replacement may show on the sample: one rounding of the dtype
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def fuse(model: nn.Module) -> dict[str, int]:
    """Replace the forwards of the model's RMSNorms and SwiGLU MLPs that the fused ops compute
    alike; returns how many of each were replaced."""
    gen = torch.Generator(device=CPU).manual_seed(0)
    use_native = native.load() is not None
    done = {"rms_norm": 0, "mlp": 0}
    for mod in model.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm"):
            done["rms_norm"] += _fuse_norm(mod, gen, use_native)
        elif name.endswith("MLP"):
            done["mlp"] += _fuse_mlp(mod, gen, use_native)
    return done


def _inference_only(mod: nn.Module, fused: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    own = mod.forward

    def forward(x: Tensor) -> Tensor:
        return own(x) if torch.is_grad_enabled() else fused(x)

    return forward


def _same(mod: nn.Module, fused: Callable[[Tensor], Tensor], x: Tensor) -> bool:
    """Whether `fused` computes the module's output on `x`, within one rounding of its dtype."""
    try:
        with torch.no_grad():
            want, got = mod(x), fused(x)
    except Exception:  # a shape or dtype the fused op does not take, a kernel that does not compile here
        return False
    tol = TOLERANCE.get(want.dtype, 1e-5)
    return (
        got.shape == want.shape
        and got.dtype == want.dtype
        and not math.isnan(float(got.float().sum()))
        and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))
    )


def _fuse_norm(mod: nn.Module, gen: torch.Generator, use_native: bool) -> bool:
    w = getattr(mod, "weight", None)
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    if not isinstance(w, Tensor) or w.dim() != 1 or w.is_meta or not isinstance(eps, float):
        return False
    x = (torch.randn(3, w.shape[0], generator=gen, device=CPU) * 3).to(w.device, w.dtype)
    candidates = []
    if use_native and w.device.type == CPU and w.dtype in native.CACHE_DTYPES:
        candidates.append(lambda x: native.rms_norm(x, mod.weight, eps))
    if fused_kernels.available(w.device):  # a GPU: one Triton kernel that rounds where the module rounds
        candidates.append(lambda x: fused_kernels.rms_norm(x, mod.weight, eps))
    if w.dtype == torch.float32:
        candidates.append(lambda x: F.rms_norm(x, mod.weight.shape, mod.weight, eps))
    for fused in candidates:
        if _same(mod, fused, x):
            mod.forward = _inference_only(mod, fused)
            return True
    return False


def _fuse_mlp(mod: nn.Module, gen: torch.Generator, use_native: bool) -> bool:
    parts = [getattr(mod, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
    silu = type(getattr(mod, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")  # torch's, transformers'
    if not silu or not all(isinstance(p, nn.Module) for p in parts):
        return False
    w = getattr(parts[0], "weight", None)
    if not isinstance(w, Tensor) or w.device.type != CPU or w.is_meta:
        return False
    if use_native and w.dtype == torch.float32:
        act_mul = native.silu_mul
    else:

        def act_mul(gate: Tensor, up: Tensor) -> Tensor:
            return mod.act_fn(gate) * up

    def fused(x: Tensor) -> Tensor:
        # the projections looked up at each call: a trainer's LoRA layers may replace them later
        return mod.down_proj(act_mul(*project((mod.gate_proj, mod.up_proj), x)))

    x = torch.randn(3, w.shape[1], generator=gen, device=CPU).to(w.device, w.dtype)
    if not _same(mod, fused, x):
        return False
    mod.forward = _inference_only(mod, fused)
    return True
