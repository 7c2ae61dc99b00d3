"""Batch-invariant numerics: a row's values do not depend on what else shares its call.

An engine decodes a sequence a token at a time in batches of whatever sequences are running; a
trainer scores the whole sample in a packed row. Both compute the same model, but their kernels
see other shapes, and in bf16 one rounding apart in one layer grows to tenths of a nat in the
log-probs (SmolLM2, Zen 4: 4.1e-2 mean |Δ log p|, the same as transformers' own decoding against
its forward; an H100: 4.4e-2). Under `numerics()` the pieces whose bits depend on the call's
shape compute each row as it would alone. How depends on the device:

- **Matrix products** (`F.linear`) on a CPU: the rows are padded with zeros to a multiple of
  `ROWS`. On the CPUs measured (Zen 4; oneDNN, MKL and ATen limited to AVX2 too) torch's GEMM
  gives a row the same bits at every position of a call whose row count is a multiple of 4; the
  odd rows of other counts, and calls of one to three rows, go through other code with another
  summation order. The first product of each weight shape checks that on the machine it runs on
  and raises where it does not hold (`RowsVary`).
- **Matrix products on a GPU**, where cuBLAS picks its kernel (tiles, split-K) by the row count
  and padding cannot pin it: computed in float64 and rounded to the inputs' dtype. Products of
  bf16 or fp32 values are exact in float64, and their sums round ~2^-53 relative, so whatever
  order a kernel sums in, a row rounds to the same bf16 value unless the float64 sums straddle
  a bf16 rounding boundary (a chance of ~2^-45 per value). The backward computes in the inputs'
  dtype: the gradients need no particular bits, only the forward's values do. So do the GPU's
  row reductions of a layer and of the log-probs (`mean`, as RMSNorm takes it, `rms_norm`,
  `softmax`, `log_softmax`, `logsumexp`), whose kernels may split a row by the number of rows.
- **Attention** (`attend`), on both: scores, softmax and the value sum in float64, the same
  argument. Its backward is the float32 formula's (`tidal.attend`).

Everything else a Llama-shaped layer runs (rotary, activations, a CPU's norms and log-softmax)
computes a row by itself already. The engine (`engine.batch_invariant`) and the trainer
(`train.batch_invariant`) both run under `numerics()`, with the same attention and unfused ops, so
the trainer's log-probs are the engine's, bit for bit on a CPU (tests/test_invariant.py), at the
cost of speed: the float64 attention (and a GPU's float64 products: at full rate only on
datacenter GPUs, A100, H100, H200), padded products and the engine's fused kernels and CUDA
graphs off.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from tidal.attend import attend as attend32
from tidal.hardware import CPU, is_cuda

ROWS = 16  # products run on a multiple of this many rows

# the model types whose engine log-probs equal the trainer's under these numerics, bf16 and fp32
# (tests/test_invariant.py): dense decoders whose products are linear layers. An MoE model's
# experts and a hybrid's recurrent layers compute in kernels of their own (grouped products,
# chunked scans against step-by-step recurrences), which these numerics do not cover.
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "glm4", "olmo2"})

_state = threading.local()  # per thread: the engine's thread and the trainer's each set their own
_checked: set[tuple] = set()  # (device, dtype, in, out) shapes whose products were checked


class RowsVary(RuntimeError):
    """This machine's matrix products give a row other bits at another position of a call."""


def unsupported(model_type: str, option: str) -> str | None:
    """Why `option` cannot hold for a language model of `model_type` (None where it can)."""
    if model_type in FAMILIES:
        return None
    return (
        f"{option}: exact log-probs are built for the dense decoders {', '.join(sorted(FAMILIES))}; "
        f"{model_type}'s layers compute in kernels these numerics do not cover"
    )


def active() -> bool:
    """Whether this thread computes under `numerics()`."""
    return getattr(_state, "depth", 0) > 0


def wide(device: torch.device) -> bool:
    """Whether `device`'s products and row reductions compute in float64 under `numerics()` (a
    GPU) rather than on padded rows (a CPU); see the module docstring."""
    return is_cuda(device)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` whose rows' bits do not depend on the row count: on a CPU with
    x's rows padded with zeros to a multiple of `ROWS` (at least `ROWS`), so each row takes the
    same kernel path; on a GPU (`wide`) in float64, rounded to x's dtype."""
    if wide(x.device):
        return _Linear64.apply(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    rows = max(ROWS, -(-m // ROWS) * ROWS)
    if rows != m:
        flat = torch.cat([flat, flat.new_zeros(rows - m, flat.shape[1])])
    _check_rows(weight, bias)
    return F.linear(flat, weight, bias)[:m].reshape(*x.shape[:-1], weight.shape[0])


def _check_rows(weight: Tensor, bias: Tensor | None) -> None:
    """Once per weight shape: a row's product at another position of a call with another multiple
    of `ROWS` rows has the same bits."""
    key = (weight.device, weight.dtype, *weight.shape, bias is not None)
    if key in _checked:
        return
    gen = torch.Generator(device=CPU).manual_seed(0)
    with torch.no_grad():
        x = torch.randn(3 * ROWS, weight.shape[1], generator=gen, device=CPU).to(weight.device, weight.dtype)
        whole = F.linear(x, weight, bias)
        part = F.linear(x[ROWS - 5 : 2 * ROWS - 5], weight, bias)  # row ROWS - 5 + i at position i
        if not torch.equal(whole[ROWS - 5 : 2 * ROWS - 5], part):
            raise RowsVary(
                f"batch_invariant: this machine's {weight.dtype} matrix products of shape "
                f"[*, {weight.shape[1]}] x [{weight.shape[1]}, {weight.shape[0]}] give a row other bits at "
                f"another position of a {ROWS}-row multiple, so the engine's and the trainer's log-probs "
                "cannot be made equal here; turn engine.batch_invariant and train.batch_invariant off"
            )
    _checked.add(key)


class _Linear64(torch.autograd.Function):
    """y = x Wᵀ + b computed in float64 and rounded to x's dtype; the backward in x's dtype:
    dx = g W, dW = gᵀ x, db = Σ g over rows."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        b = bias.double() if bias is not None else None
        return F.linear(x.double(), weight.double(), b).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        g = grad.to(x.dtype)
        gx = g @ weight if ctx.needs_input_grad[0] else None
        flat_g, flat_x = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        gw = flat_g.T @ flat_x if ctx.needs_input_grad[1] else None
        gb = flat_g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


# a GPU's row reductions on a layer's or the log-probs' path (`wide`): float64, rounded back
_REDUCTIONS = frozenset(
    {
        torch.mean,
        Tensor.mean,
        F.rms_norm,
        torch.softmax,
        Tensor.softmax,
        F.softmax,
        torch.log_softmax,
        Tensor.log_softmax,
        F.log_softmax,
        torch.logsumexp,
        Tensor.logsumexp,
    }
)


def _reduce64(func, args: tuple, kwargs: dict) -> Tensor:
    """`func(*args, **kwargs)` with its floating input (and an `rms_norm`'s weight) in float64,
    the result rounded to the input's dtype. A call that names an output dtype keeps its own."""
    x = args[0]
    if kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args[1:]):
        return func(*args, **kwargs)
    wide_args = tuple(a.double() if isinstance(a, Tensor) and a.is_floating_point() else a for a in args)
    wide_kwargs = {k: v.double() if isinstance(v, Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
    return func(*wide_args, **wide_kwargs).to(x.dtype)


class _Products(TorchFunctionMode):
    """Routes `F.linear` (every nn.Linear, LoRA's included) to `linear`, and on a GPU the row
    reductions of `_REDUCTIONS` through float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, **kwargs)
        if func in _REDUCTIONS and _widens(args[0]):
            return _reduce64(func, args, kwargs)
        return func(*args, **kwargs)


def _widens(x) -> bool:
    """Whether a reduction over `x` goes through float64: a floating tensor narrower than it, on
    a `wide` device."""
    return isinstance(x, Tensor) and x.is_floating_point() and x.dtype != torch.float64 and wide(x.device)


def recompute_contexts(inner=None) -> tuple:
    """A `context_fn` for `torch.utils.checkpoint` (non-reentrant): `inner`'s contexts (none by
    default), with the recomputation under `numerics()` where the forward ran under it. The
    backward runs outside the forward's context, and must compute the tensors the forward
    saved: the same shapes (padded products) and, for a selective policy, the same ops."""
    forward, recompute = inner() if inner is not None else (contextlib.nullcontext(), contextlib.nullcontext())
    if not active():
        return forward, recompute
    return forward, _within(recompute, numerics())


@contextlib.contextmanager
def _within(outer, inner):
    with outer, inner:
        yield


@contextlib.contextmanager
def numerics():
    """Compute under batch-invariant numerics on this thread (see the module docstring); nested
    calls keep the outer one's."""
    if active():
        yield
        return
    _state.depth = 1
    try:
        with _Products():
            yield
    finally:
        _state.depth = 0


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float | None = None) -> Tensor:
    """`tidal.attend.attend`'s formula, softmax(cap(q·kᵀ · scale), masked) · v over grouped-query
    heads (q [B, H, L, D], k [B, Hkv, C, D], v [B, Hkv, C, Dv], `mask` broadcast to [B, H, L, C],
    True where a key is seen), computed in float64 and rounded to q's dtype: a query's output is
    the same whatever else is in the call and however many masked keys it has. Gradients are the
    float32 formula's at the same inputs."""
    return _Attend.apply(q, k, v, mask, scale, softcap)


def _attend64(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float | None) -> Tensor:
    g = q.shape[1] // k.shape[1]
    # contiguous copies: a batched product of strided views copies them again, per call
    k, v = (x.to(torch.float64, memory_format=torch.contiguous_format) for x in (k, v))
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = q.to(torch.float64, memory_format=torch.contiguous_format) @ k.transpose(-1, -2)
    scores = torch.tanh(scores * (scale / softcap)) * softcap if softcap is not None else scores * scale
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


class _Attend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float | None):
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale, ctx.softcap = scale, softcap
        return _attend64(q, k, v, mask, scale, softcap).to(q.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, mask = ctx.saved_tensors
        inputs = [
            x.detach().float().requires_grad_(need) for x, need in zip((q, k, v), ctx.needs_input_grad[:3], strict=True)
        ]
        with torch.enable_grad():
            out = attend32(*inputs, mask, ctx.scale, ctx.softcap)
        wanted = [x for x in inputs if x.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad.float()) if wanted else ())
        per_input = tuple(
            next(grads).to(o.dtype) if x.requires_grad else None for x, o in zip(inputs, (q, k, v), strict=True)
        )
        return (*per_input, None, None, None)
