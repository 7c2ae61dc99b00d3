"""`auto` precision follows the hardware: bf16 only where it is native (the check faked here)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import make_model
from tidal import hardware
from tidal.config import Config
from tidal.hardware import resolve_dtype, weights_dtype
from tidal.loop import resolve_precision
from tidal.train.options import TrainConfig


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Set whether the (faked) CPU computes bf16 natively; forget earlier warnings."""

    def set_native(native: bool) -> None:
        monkeypatch.setattr(hardware, "_mkldnn_bf16", lambda: native)
        monkeypatch.setattr(hardware, "_warned", set())
        monkeypatch.setattr(hardware, "measured_bf16_slowdown", lambda: 61.0)

    return set_native


@pytest.mark.parametrize(("native", "expected"), [(False, "float32"), (True, "bfloat16")])
def test_auto_resolves_from_native_bf16(cpu_bf16, native, expected):
    cpu_bf16(native)
    for field in ("engine.dtype", "train.dtype"):
        choice = resolve_dtype("auto", field)
        assert choice.dtype == expected
        assert choice.reason.startswith("auto: ")
    assert weights_dtype("auto", "engine dtype") == {"float32": torch.float32, "bfloat16": torch.bfloat16}[expected]


def test_explicit_bf16_without_native_warns_once_with_the_measured_reason(cpu_bf16, caplog):
    cpu_bf16(False)
    with caplog.at_level(logging.WARNING, logger="tidal"):
        first = resolve_dtype("bfloat16", "train.dtype")
        resolve_dtype("bfloat16", "train.dtype")
    assert first.dtype == "bfloat16"  # kept: the user asked for it
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "train.dtype: bfloat16 is slow here" in warnings[0]
    assert "emulated" in warnings[0] and "61x slower than fp32" in warnings[0]


def test_explicit_choices_on_native_hardware_are_kept_silently(cpu_bf16, caplog):
    cpu_bf16(True)
    with caplog.at_level(logging.WARNING, logger="tidal"):
        assert resolve_dtype("float32", "engine.dtype").dtype == "float32"
        assert resolve_dtype("autocast", "train.dtype").dtype == "autocast"
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_weights_dtype_rejects_unknown_names():
    with pytest.raises(ValueError, match="engine dtype: one of auto, bfloat16, float32, got 'fp16'"):
        weights_dtype("fp16", "engine dtype")


@pytest.mark.parametrize(("native", "expected"), [(False, "float32"), (True, "bfloat16")])
def test_run_config_records_the_choice_and_its_reason(cpu_bf16, native, expected):
    cpu_bf16(native)
    cfg, record = resolve_precision(Config())
    assert (cfg.engine.dtype, cfg.train.dtype) == (expected, expected)
    for field in ("engine.dtype", "train.dtype"):
        assert record[field]["requested"] == "auto"
        assert record[field]["dtype"] == expected
        assert ("emulated" in record[field]["reason"]) != native
    assert record["machine"]["bf16_native"] is native
    assert set(record["machine"]) >= {"cpu_model", "cpu_capability", "cores"}


def test_actor_on_auto_computes_in_what_the_hardware_has(cpu_bf16):
    from tidal.algo.options import AlgoConfig
    from tidal.train.actor import Actor

    cpu_bf16(False)
    actor = Actor(make_model(), TrainConfig(), AlgoConfig())
    assert actor.mixed is None and next(actor.compute.parameters()).dtype == torch.float32
    cpu_bf16(True)
    actor = Actor(make_model(), TrainConfig(), AlgoConfig())
    assert actor.mixed is not None and next(actor.compute.parameters()).dtype == torch.bfloat16


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else ""
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else "unknown"


def _huge_kb_after_a_64mb_tensor(env_value: str | None) -> tuple[bool, int]:
    """(torch imported by `import tidal`, AnonHugePages kB) in a fresh process that imports tidal,
    then torch, and fills a 64 MB tensor."""
    code = (
        "import sys; import tidal; imported = 'torch' in sys.modules; import torch; "
        "x = torch.ones(64 << 20, dtype=torch.uint8); "
        "kb = [int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages:')][0]; "
        "print(imported, kb)"
    )
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    imported, kb = out.stdout.split()
    return imported == "True", int(kb)


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="the kernel gives no transparent huge pages")
def test_importing_tidal_gives_torchs_large_cpu_allocations_huge_pages():
    imported, kb = _huge_kb_after_a_64mb_tensor(None)
    assert not imported  # the variable is set before torch's first allocation reads it
    assert kb >= 32 * 1024  # most of the 64 MB on 2 MB pages
    if _thp_mode() == "madvise":  # only madvised memory gets huge pages: the opt-out keeps 4 KB ones
        assert _huge_kb_after_a_64mb_tensor("0")[1] < 32 * 1024


def _rss_kept_after_freeing_64mb(env: dict[str, str], call: str) -> tuple[str, int]:
    """(what `call` returned, MB of resident memory a fresh process still holds after allocating,
    touching and freeing a 64 MB tensor, to the nearest 8 MB), with `env` added to the environment.
    To the nearest 8: the process's other pages come and go by a megabyte or so meanwhile (a shared
    CI machine measured 65 MB handed back)."""
    code = (
        "import tidal, torch; from tidal import hardware; "
        f"made = {call}; "
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096 >> 20; "
        "x = torch.ones(64 << 20, dtype=torch.uint8); held = rss(); del x; "
        "print(made, held - rss())"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != hardware.KEEP_FREED_MEMORY}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    made, returned = out.stdout.split()
    return made, 8 * round((64 - int(returned)) / 8)


@pytest.mark.skipif(
    hardware.libc_function("mallopt") is None or not Path("/proc/self/statm").exists(), reason="no glibc malloc"
)
def test_a_cpu_trainer_keeps_the_large_blocks_it_frees_and_each_opt_out_leaves_glibc_alone():
    assert _rss_kept_after_freeing_64mb({}, "hardware.keep_freed_memory('cpu')") == ("True", 64)
    # glibc's default: a block over its mmap threshold goes back to the OS when freed
    assert _rss_kept_after_freeing_64mb({}, "None") == ("None", 0)
    assert _rss_kept_after_freeing_64mb({}, "hardware.keep_freed_memory('meta')") == ("False", 0)
    optouts = ({hardware.KEEP_FREED_MEMORY: "0"}, {"MALLOC_MMAP_MAX_": "65536"}, {"MALLOC_TRIM_THRESHOLD_": "131072"})
    for env in optouts:
        assert _rss_kept_after_freeing_64mb(env, "hardware.keep_freed_memory('cpu')") == ("False", 0), env


def _mb_a_thread_left_unused(env: dict[str, str]) -> int:
    """MB a fresh process's main thread adds after another thread allocated, touched and freed a
    24 MB tensor and the main thread allocates one of the same size (a CPU trainer's settings)."""
    code = (
        "import tidal, threading, torch; from tidal import hardware; hardware.keep_freed_memory('cpu'); "
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096 >> 20; "
        "t = threading.Thread(target=lambda: torch.ones(24 << 20, dtype=torch.uint8).sum()); t.start(); t.join(); "
        "held = rss(); y = torch.ones(24 << 20, dtype=torch.uint8); print(rss() - held)"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != hardware.KEEP_FREED_MEMORY}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(
    hardware.libc_function("mallopt") is None or not Path("/proc/self/statm").exists(), reason="no glibc malloc"
)
def test_every_thread_reuses_the_blocks_another_freed():
    """One malloc arena for the process: a block another thread freed serves the main thread (the
    engine's packed weights fill what the trainer's step freed); each opt-out leaves glibc's
    arena per thread, where the main thread takes new memory."""
    assert _mb_a_thread_left_unused({}) <= 2
    assert _mb_a_thread_left_unused({"MALLOC_ARENA_MAX": "8"}) >= 20


def test_a_trained_model_on_the_cpu_asks_to_keep_freed_memory(monkeypatch):
    from tidal.train import model as trained_model

    asked = []
    monkeypatch.setattr(trained_model, "keep_freed_memory", lambda device: asked.append(device) or True)
    trained_model.TrainedModel(make_model(), TrainConfig())
    assert asked == [torch.device("cpu")]


def _new_openmp_threads(code: str) -> str:
    """What a fresh process prints after running `code` with `new(fn)`: how many threads the
    process gained while `fn()` ran (its OpenMP workers are new threads; ones that exit meanwhile
    are not counted), and `parallel()`: one reduction torch splits over 2 threads."""
    prelude = (
        "import os, torch\n"
        "from tidal import hardware\n"
        "torch.set_num_threads(2)\n"
        "def tids(): return set(os.listdir('/proc/self/task'))\n"
        "def parallel(): return float(torch.ones(1 << 22).sum())\n"
        "def new(fn):\n"
        "    before = tids(); fn(); return len(tids() - before)\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", prelude + code], env=env, cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


needs_openmp = pytest.mark.skipif(
    hardware.libc_function("omp_pause_resource_all") is None
    or hardware.libc_function("__kmpc_fork_call") is not None
    or not Path("/proc/self/task").exists(),
    reason="torch's OpenMP runtime here is not GNU's (a team per thread), or no /proc",
)


@needs_openmp
def test_a_thread_gives_back_its_openmp_workers_and_its_next_parallel_region_starts_new_ones():
    code = (
        "parallel()\n"
        "kept = new(parallel)\n"  # the thread's team is alive: no new thread
        "released = hardware.release_openmp_workers()\n"
        "print(kept, released, new(parallel))\n"  # the team starts again: one new worker
    )
    assert _new_openmp_threads(code) == "0 True 1"


@needs_openmp
def test_the_engine_thread_gives_back_its_openmp_workers_whenever_it_waits_for_work():
    """The in-process engine's thread computes in bursts (a rollout, a weight update) while the
    loop's thread waits, and the other way round: each gives back its workers before it waits, so
    only the thread that computes has a team (`hardware.release_openmp_workers`)."""
    code = (
        "from tests.fake_core import FakeCore\n"
        "from tidal.adapters.async_engine import AsyncEngine\n"
        "engine = AsyncEngine(FakeCore(None))\n"
        "within = engine.call(lambda: (parallel(), new(parallel))[1])\n"  # one burst: the team stays
        "engine.call(parallel)\n"
        "after_waiting = engine.call(lambda: new(parallel))\n"  # it waited between the two calls
        "engine.close()\n"
        "print(within, after_waiting)\n"
    )
    assert _new_openmp_threads(code) == "0 1"
