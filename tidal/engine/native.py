"""The engine's CPU kernels in C: decode attention over the paged KV cache read in place
(`decode_attention.c`), sampling a token per row of logits without writing probabilities
(`sample.c`), and a decoder layer's RMSNorm, rotary embedding and SwiGLU activation as one pass
each (`pointwise.c`, used by `tidal.engine.fuse` and `tidal.engine.decode_path`).

PyTorch has no CPU kernel that attends over a paged cache: the torch path gathers each
sequence's keys and values into a dense [B, C, Hkv, D] buffer and calls sdpa, whose CPU kernel
costs ~10 µs per (sequence, head) at one query token. At SmolLM2's shape that is a quarter of a
decode step at batch 32 (docs/performance.md). The C kernel reads each cache row where it lies,
once for the query heads sharing it. Sampling through torch writes the logits in float32, then
their softmax ([B, V] each, ~25 MB at 128 x 49k, page-faulted in afresh every step); the C
sampler reads the logits once for their maximum and once for the chunk sums.

They are compiled on first use with the system's C compiler (`$CC`, else `cc`) for the CPU torch
runs its kernels for (`torch.backends.cpu.get_cpu_capability()`), with OpenMP where the compiler
has it (it then runs on torch's own OpenMP threads), in about a second, into
`$TIDAL_HOME/kernels` (else `~/.cache/tidal/kernels`), named by a hash of the source, the flags
and the compiler, and loaded through ctypes: no torch headers, no build step at install. Without
a compiler, or if the build fails, `load()` returns None (once, with a warning naming why) and
the engine keeps the torch paths. `TIDAL_NATIVE_KERNELS=0` turns them off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from tidal.hardware import CPU
from tidal.utils import tidal_home

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# one library; each includes native_vec.h
SOURCES = [HERE / "decode_attention.c", HERE / "sample.c", HERE / "pointwise.c"]
HEADERS = [HERE / "native_vec.h"]
# vector instructions for the CPU capability torch dispatches to; anything else builds portable code
ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
}
_I64, _F32, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
TORCH_PATHS = "decode attention, sampling, RMSNorm and SwiGLU run through torch"


def kernel_dir() -> Path:
    return tidal_home() / "kernels"


def _compile(compiler: str, flags: list[str], out: Path) -> None:
    """Build into a temporary file first and rename it: processes racing to build (test workers)
    each finish with a whole library, never a half-written one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, *map(str, SOURCES), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first use; None where it cannot be had."""
    if os.environ.get("TIDAL_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (%s) found: %s", os.environ.get("CC", "cc"), TORCH_PATHS)
        return None
    flags = ["-O3", "-shared", "-fPIC", *ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("the C compiler %s does not run (%s): %s", compiler, e, TORCH_PATHS)
        return None
    errors = []
    # with OpenMP (torch's thread pool) where the compiler has it, else on the calling thread
    for extra in (["-fopenmp"], []):
        text = [f.read_text() for f in SOURCES + HEADERS]
        key = hashlib.sha256("\0".join([*text, *flags, *extra, version]).encode()).hexdigest()[:16]
        path = kernel_dir() / f"tidal_native-{key}.so"
        try:
            if not path.exists():
                _compile(compiler, [*flags, *extra], path)
            lib = ctypes.CDLL(str(path))
            break
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            errors.append(str(e))
    else:
        log.warning(
            "the native kernels could not be built: %s\n%s",
            TORCH_PATHS,
            "\n".join(errors),
        )
        return None
    fn = lib.tidal_decode_attention
    fn.argtypes = [_P] * 6 + [_I64] * 13 + [_F32, _F32, _I64, _I64]
    fn.restype = ctypes.c_int
    fn = lib.tidal_sample
    fn.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64]
    fn.restype = ctypes.c_int
    lib.tidal_rms_norm.argtypes = [_P, _P, _P, _I64, _I64, _I64, _F32, _I64, _I64]
    lib.tidal_rms_norm.restype = None
    lib.tidal_silu_mul.argtypes = [_P, _P, _P, _I64, _I64, _I64, _I64, _I64]
    lib.tidal_silu_mul.restype = None
    lib.tidal_rotary.argtypes = [_P, _P, _P, _P] + [_I64] * 8
    lib.tidal_rotary.restype = None
    return lib


CACHE_DTYPES = (torch.float32, torch.bfloat16)


def supports(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether the kernel can serve this layer: on the CPU, query and caches all float32 or all
    bfloat16, rows of unit stride and a multiple of 8 wide (every family's head sizes are)."""
    return (
        k_cache.dtype in CACHE_DTYPES
        and q.dtype == v_cache.dtype == k_cache.dtype
        and all(
            t.device.type == CPU and t.dtype in CACHE_DTYPES and t.stride(-1) == 1 and t.shape[-1] % 8 == 0
            for t in (q, k_cache, v_cache)
        )
    )


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    lengths: Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention of one query token per sequence over its context in the paged cache, read in
    place: q [B, H, D], k_cache [N, Hkv, D], v_cache [N, Hkv, Dv], slots [B, C] int64 (the cache
    row of each context position; entries at or past `lengths[b]` are not read), lengths [B]
    int64 → [B, H, Dv] in q's dtype. Query head h reads KV head h // (H / Hkv); the formula is
    `tidal.attend.attend`'s: softmax(cap(q·kᵀ·scale))·v over positions j with len - j <= window.
    bfloat16 is read as is and summed in float32 (widened exactly), the output rounded once."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native decode attention is not available (see the warning logged when it was loaded)")
    b, h, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    if h % hkv or slots.shape[0] != b or lengths.shape != (b,) or k_cache.shape[2] != d:
        shapes = f"q {tuple(q.shape)}, k {tuple(k_cache.shape)}, slots {tuple(slots.shape)}"
        raise ValueError(f"decode_attention: {shapes}, lengths {tuple(lengths.shape)}: not one query per sequence")
    if k_cache.dtype not in CACHE_DTYPES or not q.dtype == v_cache.dtype == k_cache.dtype:
        types = f"{q.dtype}, {k_cache.dtype} and {v_cache.dtype}"
        raise ValueError(f"decode_attention: query and caches must all be float32 or all bfloat16, got {types}")
    if slots.dtype != torch.long or lengths.dtype != torch.long:
        raise ValueError(f"decode_attention: slots and lengths must be int64, got {slots.dtype} and {lengths.dtype}")
    slots = slots.contiguous()
    lengths = lengths.contiguous()
    out = q.new_empty(b, h, dv)
    failed = lib.tidal_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), lengths.data_ptr(), out.data_ptr(),
        b, h, hkv, d, dv, slots.shape[1], q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        window or 0, scale, softcap or 0.0, torch.get_num_threads(), k_cache.dtype == torch.bfloat16,
    )  # fmt: skip
    if failed:
        raise MemoryError("the native decode attention could not allocate its scratch memory")
    return out


def can_sample(logits: Tensor) -> bool:
    """Whether `sample` can read these logits [B, V]: float32 or bfloat16 on the CPU, unit stride
    in V, and the library built."""
    return (
        logits.dim() == 2
        and logits.device.type == CPU
        and logits.dtype in CACHE_DTYPES
        and logits.stride(-1) == 1
        and load() is not None
    )


def sample(logits: Tensor, temperature: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """One token per row of `logits` [B, V] (float32 or bfloat16) drawn with uniform `u[b]` from
    softmax(z / temperature[b]) (every temperature > 0), by the inverse CDF in token order as
    `tidal.engine.sampling.sample_tokens` draws it, and its log-prob (z_v - max z) / t - log S,
    S = sum_w exp((z_w - max z) / t): `(tokens [B] int64, log_probs [B] float32)`. A row whose
    logits hold NaN, or whose weights do not sum to a positive finite number, raises ValueError."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native kernels are not available (see the warning logged when they were loaded)")
    b, v = logits.shape
    temperature = temperature.to(torch.float32).contiguous()
    u = u.to(torch.float32).contiguous()
    if temperature.shape != (b,) or u.shape != (b,):
        raise ValueError(f"native.sample: logits {tuple(logits.shape)} need temperature and u of shape ({b},)")
    if not bool((temperature > 0).all()):
        raise ValueError("native.sample: every temperature must be > 0 (greedy rows are the caller's)")
    tokens = torch.empty(b, dtype=torch.long, device=logits.device)
    log_probs = torch.empty(b, dtype=torch.float32, device=logits.device)
    failed = lib.tidal_sample(
        logits.data_ptr(), b, v, logits.stride(0), logits.dtype == torch.bfloat16, temperature.data_ptr(),
        u.data_ptr(), tokens.data_ptr(), log_probs.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed < 0:
        raise MemoryError("the native sampler could not allocate its scratch memory")
    if failed:
        rows = (tokens < 0).nonzero()[:, 0].tolist()
        raise ValueError(f"sampling: logits rows {rows} hold NaN or infinite values (no distribution to draw from)")
    return tokens, log_probs


def _rows(x: Tensor, name: str) -> Tensor:
    """x as [rows, cols] with unit stride in cols (a view where it can be)."""
    if x.dtype not in CACHE_DTYPES or x.device.type != CPU or x.shape[-1] % 8:
        got = f"{x.dtype} {tuple(x.shape)} on {x.device}"
        raise ValueError(f"native.{name}: float32 or bfloat16 CPU rows a multiple of 8 wide, got {got}")
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm, `w · round(x / sqrt(mean(x²) + eps))` over the last dimension, in one
    pass per row: the normalised row is computed in float32 and rounded to x's dtype before the
    weight's product (rounded again), as the module's ops round it."""
    flat = _rows(x, "rms_norm")
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype or not weight.is_contiguous():
        got = f"weight {tuple(weight.shape)} {weight.dtype}, rows {tuple(x.shape)} {x.dtype}"
        raise ValueError(f"native.rms_norm: {got}: one weight per column, in the rows' dtype")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    load().tidal_rms_norm(
        flat.data_ptr(), weight.data_ptr(), out.data_ptr(), flat.shape[0], flat.shape[1], flat.stride(0), eps,
        torch.get_num_threads(), x.dtype == torch.bfloat16,
    )  # fmt: skip
    return out


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's `silu(gate) · up` in one pass, float32; silu(x) = x / (1 + e^-x)."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype != torch.float32:
        got = f"gate {tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}"
        raise ValueError(f"native.silu_mul: {got}: float32 of the same shape expected")
    g, u = _rows(gate, "silu_mul"), _rows(up, "silu_mul")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    load().tidal_silu_mul(
        g.data_ptr(), u.data_ptr(), out.data_ptr(), g.shape[0], g.shape[1], g.stride(0), u.stride(0),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotate-half rotary embedding of transformers' `apply_rotary_pos_emb` for one of q or
    k: x [T, H, D] (rows of unit stride, a token's heads contiguous, tokens at any stride: q, k
    may be column ranges of one joined product) → x · cos + rotate_half(x) · sin
    [T, H, D], cos and sin [T, D] broadcast over the heads, rotate_half(x) = (-x[D/2:], x[:D/2]);
    each product and the sum rounded to the dtype as its three ops round them (the same bits)."""
    t, h, d = x.shape
    ok = x.dtype in CACHE_DTYPES and x.device.type == CPU and d % 16 == 0 and x.stride(2) == 1 and x.stride(1) == d
    if not ok or cos.shape != (t, d) or sin.shape != (t, d) or not cos.dtype == sin.dtype == x.dtype:
        got = f"x {tuple(x.shape)} {x.dtype}, cos {tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)}"
        raise ValueError(f"native.rotary: {got}: x [T, H, D] (D a multiple of 16) and cos/sin [T, D] of its dtype")
    if cos.stride(1) != 1 or sin.stride(1) != 1 or cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    load().tidal_rotary(
        x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t * h, h, d, x.stride(1), x.stride(0),
        cos.stride(0), torch.get_num_threads(), x.dtype == torch.bfloat16,
    )  # fmt: skip
    return out
