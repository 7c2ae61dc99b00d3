"""Low-precision rollout weights (`engine.quantization`): the engine's linear layers read fewer
weight bytes per token, the trainer stays in full precision.

- `fp16` (CPU): weight-only; each weight is stored in float16 (2x fewer bytes than fp32) and
  widened to fp32 inside fbgemm's kernel (`quantized::linear_dynamic_fp16`), activations and
  accumulation stay fp32. Vectorised with AVX2's F16C, so it pays on every x86 CPU.
- `int8` (CPU): weight-only; each weight row w_n is stored as int8 with its own scale
  s_n = max|w_n| / 127 (q = round(w / s), symmetric, per output channel; 4x fewer bytes than
  fp32), y = (x · q_n) s_n + b in the activations' dtype (`aten::_weight_int8pack_mm`). That
  kernel is vectorised for AVX-512; on an AVX2-only CPU it is slower than fp32 (measured), and
  the engine says so.
- `fp8` (CUDA, compute capability >= 8.9): weights as float8_e4m3fn with a scale per output
  channel, activations quantized per token, `torch._scaled_mm` with row-wise scales.

Full precision on a CPU (`PACKED`, the engine's default there for float32 weights, and for
bfloat16 where the CPU computes it natively; `pack_weights`):
each weight is copied once per load into oneDNN's blocked layout for its GEMM
(`mkldnn._reorder_linear_weight`, what vLLM's CPU backend does), and a forward of up to
`PACKED_MAX_ROWS` (256) rows runs oneDNN's kernel on it: the same fp32 products, summed in
another order. Streamed through SmolLM2's 210 layers on a 2-core AVX2 CPU this takes 0.5-0.8x
MKL's time at 2-32 rows and 0.95x at 64. From 128 rows the small layers are as fast either way,
but the 113 MB output projection (read from memory at every step) runs 1.6-1.9x faster packed
up to 256 rows: decode steps of 128-256 sequences took 0.84-0.95x the time with every layer
packed up to 256 rows than with MKL above 64 (side by side, alternating steps). Bigger calls (a
prefill chunk) keep MKL on the parameters themselves. In bf16 on a 2-core Zen 4 (AVX512-BF16) the
streamed layers take 0.59-0.91x MKL's time at 1-256 rows and the decode step 0.88x at batch 32
and 128; where bf16 is emulated it is not packed.

Not offered: fbgemm's dynamic int8 (int8 weights and int8 activations quantized per call with
one scale per tensor). It is fast on AVX2 (2-4x fp32) but SmolLM2's activation outliers make its
policy another model (KL 1.8 nats per token from the fp32 policy, against 0.0066 for weight-only
int8 and < 1e-5 for fp16 weights), more than an importance correction can repair.

Every `nn.Linear` of the model is quantized except MoE routers (the engine's routing must be the
model's own choice, and a router is tiny) and layers whose shapes a kernel cannot take; the
embedding, norms and attention stay in the engine's dtype. The quantized copy sits beside the
full-precision weights, which stay the parameters weight syncs load into. Every load re-quantizes
all layers (`Quantizer.refresh`, timed in the engine's `quantize_s`), and a layer whose parameter
was changed in place or given new storage since re-quantizes itself at its next call. (A trainer's
in-place step on a tensor the engine shares reaches the engine through the sync's load, as the
synchronous loop does every step.)

Memory: a packed model holds one packed copy of its linear weights (SmolLM2 in fp32: 513 MB
beside its 540 MB of parameters, which an in-process engine shares with its trainer). Layers
joined into one product keep no copy of their own (a part called alone takes its columns of the
product, `JoinedLinear.part`); a refresh drops each layer's old copy before packing its new one;
and the synchronous loop has the engine drop its copies while the trainer trains
(`InProcessSync.before_train`): the push after the step packs the new weights anyway; with one
malloc arena for the process (`import tidal` sets it) the new copies fill blocks the step freed.
Measured with `python -m bench memory` (docs/performance.md).

The sampled tokens come from the quantized policy, whose log-probs the engine returns: the
trainer scores them in full precision, and `algo.is_correction` re-weights the gap.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor, nn

from tidal import moe
from tidal.backends import QUANTIZATIONS as QUANTIZATION_RECORDS
from tidal.hardware import CPU, bf16_native, is_cuda

QUANTIZATIONS = tuple(QUANTIZATION_RECORDS)  # the names, in `tidal.backends` order
CPU_KINDS = ("fp16", "int8")
PACKED = "packed"  # full precision in oneDNN's layout (not a rounding: no `engine.quantization` value)
PACKED_MAX_ROWS = 256  # bigger calls (prefill chunks) run MKL on the parameters
PACKED_ROWS_HINT = 64  # the batch size oneDNN lays the packed weights out for
FP8 = torch.float8_e4m3fn
# sibling layers that read one input, joined into one packed product (`JoinedLinear`)
JOINED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def check_quantization(kind: str, device: torch.device) -> None:
    """Raise ValueError (naming `engine.quantization`) unless `kind` runs on `device`."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"engine.quantization: one of {', '.join(QUANTIZATIONS)}, got {kind!r}")
    if kind in CPU_KINDS and device.type != CPU:
        raise ValueError(f"engine.quantization: {kind} runs on the CPU, the engine is on {device}; use fp8")
    if kind == "fp16" and "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("engine.quantization: fp16 needs PyTorch's fbgemm kernels (x86), which this build lacks")
    if kind == "fp8":
        if not is_cuda(device):
            raise ValueError(f"engine.quantization: fp8 runs on CUDA GPUs, the engine is on {device}; use int8")
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(f"engine.quantization: fp8 needs compute capability >= 8.9, this GPU has {cap}")


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the engine packs its full-precision weights for oneDNN: on a CPU whose torch has
    oneDNN, float32, and bfloat16 where the CPU computes it natively (emulated bf16 is slow
    either way, and not the engine's choice there)."""
    if device.type != CPU or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_native(CPU)[0])


def pack(w: Tensor) -> Tensor:
    """`w` [N, K] copied into oneDNN's blocked layout for its GEMM at `PACKED_ROWS_HINT` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(w, PACKED_ROWS_HINT)


def _version(w: Tensor) -> tuple[int, int]:
    try:
        return w.data_ptr(), w._version
    except RuntimeError:  # an inference tensor keeps no version: its storage is all we can see
        return w.data_ptr(), -1


class QuantizedLinear:
    """One `nn.Linear`'s forward in low precision; re-quantizes when the weight changed."""

    def __init__(self, mod: nn.Linear, kind: str) -> None:
        self.mod, self.kind = mod, kind
        self.key: tuple[int, int] | None = None
        self.packed = None
        self.joined: JoinedLinear | None = None  # the packed product it shares with its siblings

    def refresh(self) -> None:
        self.packed = None  # the old copy goes before the new one is made: never two at once
        w, b = self.mod.weight.detach(), self.mod.bias
        b = None if b is None else b.detach()
        if self.kind == PACKED:
            self.packed = (pack(w), b)
        elif self.kind == "fp16":
            self.packed = torch.ops.quantized.linear_prepack_fp16(w.float(), None if b is None else b.float())
        elif self.kind == "int8":
            self.packed = quantize_int8(w) + (b,)
        else:
            self.packed = quantize_fp8(w) + (b,)
        self.key = _version(self.mod.weight)

    def __call__(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.kind == PACKED:
            if flat.shape[0] > PACKED_MAX_ROWS:
                return nn.functional.linear(x, self.mod.weight, self.mod.bias)
            if self.joined is not None:  # its columns of its siblings' product: no packed copy of its own
                return self.joined.part(self, x)
        if self.key != _version(self.mod.weight):
            self.refresh()
        if self.kind == PACKED:
            y = torch.ops.mkldnn._linear_pointwise(flat, self.packed[0], self.packed[1], "none", [], "")
        elif self.kind == "fp16":
            y = torch.ops.quantized.linear_dynamic_fp16(flat.float(), self.packed)
        elif self.kind == "int8":
            y = int8_linear(flat, *self.packed)
        else:
            y = fp8_linear(flat, *self.packed)
        return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])


class JoinedLinear:
    """Packed layers that read one input (a layer's q/k/v projections, an MLP's gate and up) as
    one product: x · [W_1; ...; W_n]ᵀ + [b_1; ...; b_n], split by columns into each layer's
    output. oneDNN sums each output over K alone, so every column is the bits of its own layer's
    packed product; one call instead of n saves the per-call cost and runs larger blocks (the 30
    layers' products of SmolLM2 streamed at batch 32: 0.90x the time in bf16 on AVX512-BF16, 0.91x
    fp32; `docs/performance.md`). Re-packs when a part's weight or bias changed."""

    def __init__(self, parts: list[QuantizedLinear]) -> None:
        self.parts = tuple(parts)
        self.widths = [p.mod.out_features for p in parts]
        self.key: tuple | None = None
        self.packed: tuple[Tensor, Tensor | None] | None = None
        # (input, its version, {part index: output}): the outputs of the last product that a part
        # called alone asked for, kept for its siblings called next on the same input
        self.stash: tuple[Tensor, tuple[int, int], dict[int, Tensor]] | None = None
        for p in parts:
            p.joined = self

    @staticmethod
    def joins(mods: list[nn.Module], layers: dict[int, QuantizedLinear]) -> bool:
        """Whether packed layers `mods` (by id in `layers`) can be one product: one input width,
        one dtype, a bias on each or on none."""
        parts = [layers.get(id(m)) for m in mods]
        if any(p is None or p.kind != PACKED for p in parts):
            return False
        w = [m.weight for m in mods]
        return (
            len({x.shape[1] for x in w}) == 1
            and len({x.dtype for x in w}) == 1
            and len({m.bias is None for m in mods}) == 1
        )

    def _current(self) -> tuple:
        return tuple(_version(t) for p in self.parts for t in (p.mod.weight, p.mod.bias) if t is not None)

    def refresh(self) -> None:
        self.packed, self.stash = None, None  # the old copy goes first (see `QuantizedLinear.refresh`)
        mods = [p.mod for p in self.parts]
        w = torch.cat([m.weight.detach() for m in mods])
        b = None if mods[0].bias is None else torch.cat([m.bias.detach() for m in mods])
        self.packed = (pack(w), b)
        self.key = self._current()

    def __call__(self, x: Tensor) -> list[Tensor]:
        if self.key != self._current():
            self.refresh()
        flat = x.reshape(-1, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed[0], self.packed[1], "none", [], "")
        return [part.view(*x.shape[:-1], part.shape[-1]) for part in y.split(self.widths, dim=-1)]

    def part(self, layer: QuantizedLinear, x: Tensor) -> Tensor:
        """`layer`'s output on `x` (at most `PACKED_MAX_ROWS` rows) from the joined product, so no
        part keeps a packed copy of its own: transformers' attention calls q, k and v one by one
        on one input (a prefill, the decode path's first-step check), and the first call's product
        holds the next ones' outputs, the same bits as each layer's own packed product. Another
        input (or the same one changed in place) computes the product again."""
        i = self.parts.index(layer)
        held = self.stash
        if held is not None and held[0] is x and held[1] == _version(x) and i in held[2]:
            y = held[2].pop(i)
            if not held[2]:
                self.stash = None
            return y
        outs = self(x)
        rest = {j: y for j, y in enumerate(outs) if j != i}
        self.stash = (x, _version(x), rest) if rest else None
        return outs[i]


def project(mods: tuple[nn.Module, ...], x: Tensor) -> list[Tensor]:
    """Each of `mods`' forward on `x`: as one `JoinedLinear` product where the engine joined their
    current forwards (a trainer's LoRA layer given to the engine later replaces a module, and
    then each runs its own) and `x` has at most `PACKED_MAX_ROWS` rows; else one call each."""
    forwards = tuple(m.forward for m in mods)
    joined = getattr(forwards[0], "joined", None)
    if joined is not None and joined.parts == forwards and x.numel() <= PACKED_MAX_ROWS * x.shape[-1]:
        return joined(x)
    return [f(x) for f in forwards]


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """`w` [N, K] as int8 per output channel and its scales [N]: q = round(w / s),
    s_n = max_k |w_nk| / 127."""
    scale = (w.float().abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.to(w.dtype)


def int8_linear(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """x [M, K] · (q s)^T + b, the int8 weights widened inside the kernel."""
    y = torch.ops.aten._weight_int8pack_mm(x.to(scale.dtype), q, scale)
    return y if bias is None else y + bias.to(y.dtype)


def quantize_fp8(w: Tensor) -> tuple[Tensor, Tensor]:
    """`w` [N, K] as float8_e4m3fn, transposed for `_scaled_mm` ([K, N] column-major), and its
    per-channel scale [1, N]: q = w / s, s_n = max_k |w_nk| / 448."""
    scale = (w.float().abs().amax(dim=1) / torch.finfo(FP8).max).clamp_min(1e-12)
    q = (w.float() / scale[:, None]).to(FP8)
    return q.t(), scale[None, :]


def fp8_linear(x: Tensor, wq: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """x [M, K] · w^T with x quantized per row to float8_e4m3fn: y = (s_x s_w) (q_x · q_w) + b."""
    xs = (x.float().abs().amax(dim=1, keepdim=True) / torch.finfo(FP8).max).clamp_min(1e-12)
    xq = (x.float() / xs).to(FP8)
    out = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    y = torch._scaled_mm(xq, wq, scale_a=xs, scale_b=w_scale, out_dtype=out)
    return y if bias is None else y + bias.to(y.dtype)


def _fits(mod: nn.Linear, kind: str) -> bool:
    n, k = mod.weight.shape
    return kind != "fp8" or (n % 16 == 0 and k % 16 == 0)  # _scaled_mm's alignment


class Quantizer:
    """The model's linear layers, each run by a `QuantizedLinear` of `kind`."""

    def __init__(self, model: nn.Module, kind: str) -> None:
        if kind != PACKED:
            check_quantization(kind, next(model.parameters()).device)
        routers = {id(r) for r in moe.routers(model)}
        self.layers: dict[str, QuantizedLinear] = {}
        for name, mod in model.named_modules():
            if type(mod) is nn.Linear and id(mod) not in routers and _fits(mod, kind):
                layer = QuantizedLinear(mod, kind)
                mod.forward = layer
                self.layers[name] = layer
        by_module = {id(layer.mod): layer for layer in self.layers.values()}
        self.joined: list[JoinedLinear] = []
        for mod in model.modules():
            for names in JOINED:
                parts = [getattr(mod, n, None) for n in names]
                if all(isinstance(p, nn.Linear) for p in parts) and JoinedLinear.joins(parts, by_module):
                    self.joined.append(JoinedLinear([by_module[id(p)] for p in parts]))
        self.refresh_s = 0.0
        self.refresh()

    def refresh(self) -> float:
        """Quantize every layer from its current weights; returns (and keeps) the seconds it took."""
        t0 = time.perf_counter()
        # a joined layer has no copy of its own (`JoinedLinear.part`): its product is the copy
        todo = [*self.joined, *(lay for lay in self.layers.values() if lay.joined is None)]
        # fbgemm packs a matrix on one thread: pack torch's thread count of them at once
        with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
            list(pool.map(lambda layer: layer.refresh(), todo))
        self.refresh_s = time.perf_counter() - t0
        return self.refresh_s

    def storage(self) -> tuple[int, ...]:
        """Addresses of the quantized copies (a captured CUDA graph reads them: re-quantizing
        makes new ones)."""
        packed = [lay.packed for lay in (*self.layers.values(), *self.joined) if lay.packed is not None]
        tensors = [t for p in packed if isinstance(p, tuple) for t in p if isinstance(t, Tensor)]
        return tuple(id(t) if t.is_mkldnn else t.data_ptr() for t in tensors)  # oneDNN's have no data pointer

    def release(self) -> None:
        """Drop the quantized copies (the engine sleeps); the next forward or refresh rebuilds them."""
        for layer in (*self.layers.values(), *self.joined):
            layer.packed, layer.key = None, None
        for joined in self.joined:
            joined.stash = None

    def packed_bytes(self) -> int:
        """Bytes of the packed (oneDNN) copies the layers hold now: after a refresh of a packed
        model, one copy of every packed weight, each joined group's once."""
        held = [lay.packed for lay in (*self.layers.values(), *self.joined) if isinstance(lay.packed, tuple)]
        return sum(p[0].numel() * p[0].element_size() for p in held if p[0].is_mkldnn)

    def weight_bytes(self) -> tuple[int, int]:
        """(bytes of the quantized weights, bytes of their full-precision originals)."""
        full = quant = 0
        for layer in self.layers.values():
            w = layer.mod.weight
            full += w.numel() * w.element_size()
            if layer.kind != PACKED:
                quant += w.numel() * 2 if layer.kind == "fp16" else w.numel() + 4 * w.shape[0]  # + a scale per row
            elif layer.joined is None or layer.packed is not None:  # a copy of its own
                quant += w.numel() * w.element_size()
        for joined in self.joined:  # a copy of its parts
            quant += sum(p.mod.weight.numel() * p.mod.weight.element_size() for p in joined.parts)
        return quant, full


def dequantized(layer: QuantizedLinear) -> Tensor:
    """The weight [N, K] the layer computes with, in fp32 (for tests: the rounding alone)."""
    if layer.kind == PACKED:
        return layer.mod.weight.detach().float()
    if layer.kind == "fp16":
        return layer.mod.weight.detach().to(torch.float16).float()
    q, scale = layer.packed[:2]
    if layer.kind == "int8":
        return q.float() * scale.float()[:, None]
    return (q.float() * scale).t()
