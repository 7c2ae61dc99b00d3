"""What the machine computes on and computes fast: the device and the precision tidal picks.

Every device choice is made here and nowhere else: `resolve_device` turns `cluster.device`
(`auto`: CUDA where torch sees a GPU, else the CPU) into the device each process computes on, and
`dist_backend` / `autocast_type` / `bind_device` follow from it, so the CPU and the GPU run the
same code with a different device.

bf16 pays only where the hardware computes it natively: a CUDA GPU with bf16, or a CPU with
AVX512-BF16 or AMX (as oneDNN reports it). A CPU with AVX2 only emulates bf16 matmuls, about 60×
slower than fp32 (measured: 0.9 against 53 GFLOP/s on one core), so `auto` there means fp32.

    choice = resolve_dtype("auto", "engine.dtype")   # DtypeChoice("float32", "...AVX2...")
    device = resolve_device("auto", "cluster.device")  # DeviceChoice("cpu", "auto: torch sees no CUDA device")
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass

import torch

from tidal.backends import DEVICES

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


CPU = "cpu"  # the host: where tokenizers, samples and checkpoints live whatever the compute device


@dataclass(frozen=True)
class DeviceChoice:
    """The device a `cluster.device` setting resolved to in this process, and why."""

    device: str
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_device(requested: str, field: str = "cluster.device") -> DeviceChoice:
    """The device this process computes on: `auto` is `cuda` where `torch.cuda.is_available()`,
    else `cpu`; `cuda` without a CUDA device is an error naming `field`. On Ray every rank and
    engine resolves it on its own node (`bind_device` then picks the GPU Ray gave it)."""
    if requested not in DEVICES:
        raise ValueError(f"{field}: one of {', '.join(DEVICES)}, got {requested!r}")
    has_cuda = torch.cuda.is_available()
    if requested == "auto":
        if has_cuda:
            return DeviceChoice("cuda", f"auto: torch sees {torch.cuda.device_count()} CUDA device(s)")
        return DeviceChoice("cpu", "auto: torch sees no CUDA device")
    if requested == "cuda" and not has_cuda:
        raise ValueError(
            f"{field}: cuda, but torch {torch.__version__} sees no CUDA device "
            f"(torch.version.cuda={torch.version.cuda}); use auto or cpu"
        )
    return DeviceChoice(requested, "set explicitly")


def is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def dist_backend(device: str | torch.device) -> str:
    """The torch.distributed backend of trainer ranks computing on `device`: gloo for CPU tensors;
    on CUDA, NCCL for CUDA tensors with gloo beside it for any CPU tensor a collective meets
    (checkpoint state gathered to the host)."""
    return "cpu:gloo,cuda:nccl" if is_cuda(device) else "gloo"


def autocast_type(device: str | torch.device) -> str:
    """The `device_type` of `torch.autocast` for tensors on `device`."""
    return torch.device(device).type


def bind_device(device: str) -> torch.device:
    """The concrete device of this process: on CUDA its local GPU, made current. Ray sets
    `CUDA_VISIBLE_DEVICES` to the GPUs of an actor's bundle, so an actor's GPU is the first one it
    sees; a process started by torchrun takes `LOCAL_RANK`."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


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
    """The dtype `field` (`engine.dtype`, `train.dtype`, `serve --dtype`) runs in.

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


def memory_metrics(device: str | torch.device) -> dict[str, float]:
    """The device's peak allocated memory since the last call and what its allocator holds, in GiB,
    for a step's metrics (`memory/*`); empty on the CPU, whose memory torch does not account."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {}
    out = {
        "memory/max_allocated_gib": torch.cuda.max_memory_allocated(dev) / 2**30,
        "memory/reserved_gib": torch.cuda.memory_reserved(dev) / 2**30,
    }
    torch.cuda.reset_peak_memory_stats(dev)
    return out


def release_cached(device: str | torch.device) -> None:
    """Give the allocator's cached blocks back to the device (after freeing the KV cache and
    weights for the trainers); the CPU allocator returns freed memory by itself."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


@functools.cache
def libc_function(name: str):
    """The function `name` of the C library or of a library loaded for the whole process (glibc's
    `mallopt`, torch's OpenMP runtime's `omp_pause_resource_all`), or None where there is none
    (macOS's C library has no `mallopt`, Windows)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError, TypeError):
        return None


OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: let the runtime's threads go, keep its settings


def release_openmp_workers() -> bool:
    """Let the calling thread's OpenMP workers exit before it waits on another thread's compute;
    True if the runtime did (`omp_pause_resource_all(omp_pause_soft)`; its next parallel region
    starts them again, once).

    torch's CPU kernels run on the OpenMP runtime it ships (libgomp), where each thread that runs
    parallel regions keeps a team of workers. Once the runtime manages more threads than there
    are CPUs, it lets an idle worker spin only 100 times before it sleeps, so every parallel
    region of the thread that computes wakes its workers through the kernel. In a run with the
    engine in-process, the engine's thread generates while the loop's thread waits, then the
    loop's thread trains while the engine's waits: two teams alive, one computing. On a 2-core
    Zen 4 (fp32, 2 threads), a rollout of 16 samples on the engine's thread took 2.57-2.89 s with
    the loop thread's workers alive and 2.00-2.05 s with them released (docs/performance.md).
    False where the process has no such runtime function (a torch built without OpenMP) and where
    its runtime is LLVM's or Intel's (`__kmpc_fork_call`), whose pause stops every thread's team."""
    pause = libc_function("omp_pause_resource_all")
    if pause is None or libc_function("__kmpc_fork_call") is not None:
        return False
    return pause(OMP_PAUSE_SOFT) == 0


KEEP_FREED_MEMORY = "TIDAL_KEEP_FREED_MEMORY"  # "0": leave glibc's malloc as it is
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters
_GLIBC_MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def keep_freed_memory(device: str | torch.device) -> bool:
    """Make this process reuse the large blocks it frees, when it trains on the CPU; True if it did.

    glibc's malloc serves every block over 32 MB (its largest mmap threshold) with a fresh mmap
    and unmaps it when freed. A training step allocates its vocabulary-wide logits, their
    gradients and the output projection's gradient (113 MB for SmolLM2) again every micro-batch,
    so each is new memory whose every page faults on first touch, and on huge pages the kernel
    may compact memory to find them: 1.3-2.3 s of a ~9 s fp32 step on 2 cores (docs/performance.md). With
    mmap off (`M_MMAP_MAX` 0) such blocks come from the heap, and with trimming only past 2 GB
    free at its top (`M_TRIM_THRESHOLD`) a freed block stays for the next micro-batch. The
    process keeps its peak memory instead of returning it between micro-batches. Left alone where
    `TIDAL_KEEP_FREED_MEMORY=0`, where one of glibc's own `MALLOC_*_` variables is set, on a GPU
    (whose tensors this does not touch) and where the C library has no `mallopt`."""
    if torch.device(device).type != CPU or os.environ.get(KEEP_FREED_MEMORY) == "0":
        return False
    mallopt = libc_function("mallopt")
    if mallopt is None or any(name in os.environ for name in _GLIBC_MALLOC_ENV):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def on_host(fn):
    """Run `fn` with the host as torch's default device: it builds tensors from Python lists
    (batches, index plans) that then reach the compute device in one copy (`to_device`). Everything
    else makes its tensors on the device of the tensors it computes with."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.device(CPU):
            return fn(*args, **kwargs)

    return wrapper


def host_values(values, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A tensor of Python `values` on `device`. To a GPU through pinned memory, without waiting:
    a copy from ordinary host memory waits for everything queued on the stream first, which
    would stall the host behind the step the GPU is computing."""
    if is_cuda(device):
        return torch.tensor(values, dtype=dtype, device=CPU).pin_memory().to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def to_device(value, device: str | torch.device):
    """`value` on `device`: a tensor, a dict or list of them, or an object with a `to(device)`
    method (a packed layout); anything else unchanged. Host-to-GPU copies do not block."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_device(v, device) for v in value)
    if callable(getattr(value, "to", None)):
        return value.to(device)
    return value
