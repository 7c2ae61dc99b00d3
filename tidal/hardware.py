"""What the machine computes fast, and the precision tidal picks from it.

bf16 pays only where the hardware computes it natively: a CUDA GPU with bf16, or a CPU with
AVX512-BF16 or AMX (as oneDNN reports it). A CPU with AVX2 only emulates bf16 matmuls, about 60×
slower than fp32 (measured: 0.9 against 53 GFLOP/s on one core), so `auto` there means fp32.

    choice = resolve_dtype("auto", "rollout.dtype")   # DtypeChoice("float32", "...AVX2...")
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass

import torch

log = logging.getLogger("tidal")

BF16_DTYPES = ("bfloat16", "autocast")  # train.dtype values that compute in bf16
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _mkldnn_bf16() -> bool:
    """oneDNN's own check: AVX512-BF16, AMX or AVX2-VNNI-2 on x86, the bf16 extension on Arm."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_info() -> dict:
    """What every benchmark and run records about the CPU it ran on."""
    return {
        "cpu_model": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_native": _mkldnn_bf16(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a `auto` (or explicit) setting resolved to, and why."""

    dtype: str
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def bf16_native(device: str = "cpu") -> tuple[bool, str]:
    """(native, why): whether `device` computes bf16 matmuls in hardware."""
    if device.startswith("cuda"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return True, f"CUDA device {torch.cuda.get_device_name()} computes bf16"
        return False, "the CUDA device does not support bf16"
    cap = torch.backends.cpu.get_cpu_capability()
    if _mkldnn_bf16():
        return True, f"the CPU ({cap}) computes bf16 natively (AVX512-BF16/AMX, as oneDNN reports)"
    return False, f"the CPU reports {cap} without native bf16 (no AVX512-BF16/AMX): bf16 matmuls are emulated"


@functools.cache
def measured_bf16_slowdown(n: int = 256, reps: int = 3) -> float:
    """Time of an n×n bf16 matmul over the fp32 one on this CPU (best of `reps`)."""

    def best(dtype: torch.dtype) -> float:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        return min(times)

    return best(torch.bfloat16) / max(best(torch.float32), 1e-9)


_warned: set[str] = set()


def resolve_dtype(requested: str, field: str, device: str = "cpu") -> DtypeChoice:
    """The dtype `field` (`rollout.dtype`, `train.dtype`, `serve --dtype`) runs in.

    `auto`: bf16 where the device computes it natively (for `train.dtype`, the bf16 compute copy
    of fp32 master weights), else float32. An explicit bf16 choice on a device without native bf16
    is kept, with one warning giving the measured slowdown."""
    native, why = bf16_native(device)
    if requested == "auto":
        if native:
            return DtypeChoice("bfloat16", f"auto: {why}")
        return DtypeChoice("float32", f"auto: {why}, so float32")
    if requested in BF16_DTYPES and not native:
        reason = f"set explicitly; {why}"
        if field not in _warned:
            _warned.add(field)
            slow = measured_bf16_slowdown() if device == "cpu" else float("nan")
            log.warning(
                "%s: %s is slow here: %s (a 256x256 bf16 matmul measured %.0fx slower than fp32). "
                "Use %s auto or float32.",
                field,
                requested,
                why,
                slow,
                field,
            )
        return DtypeChoice(requested, reason)
    return DtypeChoice(requested, "set explicitly")


def weights_dtype(requested: str, field: str, device: str = "cpu") -> torch.dtype:
    """The torch dtype an engine holds its weights in (`auto`, `bfloat16` or `float32`)."""
    if requested not in ("auto", *TORCH_DTYPES):
        raise ValueError(f"{field}: one of auto, {', '.join(TORCH_DTYPES)}, got {requested!r}")
    choice = resolve_dtype(requested, field, device)
    if requested == "auto":
        log.info("%s: %s (%s)", field, choice.dtype, choice.reason)
    return TORCH_DTYPES[choice.dtype]
