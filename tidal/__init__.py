"""tidal: reinforcement-learning post-training for language models, from a laptop to a cluster.

The Python API (docs/python-api.md) is importable from here; each name loads its module on first
use, so `import tidal` stays light (no torch) and a command starts as fast as before:

    make_config, run, evaluate        build a config in code, train it, score a model (tidal.api)
    Config, ConfigError               the config and its error (tidal.config, tidal.options)
    Sample, Status, RunStopped, InputError      records and errors (tidal.types)
    RewardFn, GroupRewardFn           what reward.fn and reward.group_fn name (tidal.reward.checks)
    GenerateFn, GenerateContext, SamplingParams, GenerationOutput   rollout.generate's signature
    AgentFn                           what agent.fn names (tidal.rollout.agent)
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# PyTorch's CPU allocator backs allocations of 2 MB and more with transparent huge pages when
# THP_MEM_ALLOC_ENABLE is set. A training step allocates its vocabulary-wide logits, their
# gradients and the output projection's gradient afresh every micro-batch, and each 4 KB page of
# them faults on first touch: ~12% of a SmolLM2 step on a 2-core CPU (docs/performance.md). torch
# reads the variable once, at its first allocation, so it is set here, before anything of tidal
# imports torch; it reaches the processes tidal starts (Ray workers, engines) through the
# environment. THP_MEM_ALLOC_ENABLE=0 keeps 4 KB pages.
ALLOCATOR_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}
for _name, _value in ALLOCATOR_ENV.items():
    os.environ.setdefault(_name, _value)


def _one_malloc_arena() -> None:
    """Every thread of this process allocates from one glibc heap (`mallopt(M_ARENA_MAX, 1)`),
    set here, before threads make arenas of their own. A CPU trainer keeps the blocks it frees
    (`hardware.keep_freed_memory`); with an arena per thread, the in-process engine's packed
    weights, re-made after each training step by its packing threads, went to heaps the trainer
    never reuses: a GRPO run of SmolLM2 in fp32 peaked at 4.5-4.8 GB, and at 3.9 GB with one
    arena (`python -m bench memory`, docs/performance.md). Left alone where `MALLOC_ARENA_MAX` is
    set, with `TIDAL_KEEP_FREED_MEMORY=0`, and where the C library has no `mallopt`."""
    if "MALLOC_ARENA_MAX" in os.environ or os.environ.get("TIDAL_KEEP_FREED_MEMORY") == "0":
        return
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX
    except (AttributeError, OSError):
        pass


_one_malloc_arena()

# public name -> the module defining it, imported when the name is first read (PEP 562)
_LAZY: dict[str, str] = {
    "make_config": "tidal.api",
    "run": "tidal.api",
    "evaluate": "tidal.api",
    "Config": "tidal.config",
    "ConfigError": "tidal.options",
    "Sample": "tidal.types",
    "Status": "tidal.types",
    "RunStopped": "tidal.types",
    "InputError": "tidal.types",
    "RewardFn": "tidal.reward.checks",
    "GroupRewardFn": "tidal.reward.checks",
    "GenerateFn": "tidal.rollout.generate",
    "GenerateContext": "tidal.rollout.generate",
    "SamplingParams": "tidal.contracts",
    "GenerationOutput": "tidal.contracts",
    "AgentFn": "tidal.rollout.agent",
}

__all__ = [  # the names of _LAZY, spelled out for linters and `from tidal import *`
    "AgentFn",
    "Config",
    "ConfigError",
    "GenerateContext",
    "GenerateFn",
    "GenerationOutput",
    "GroupRewardFn",
    "InputError",
    "RewardFn",
    "RunStopped",
    "Sample",
    "SamplingParams",
    "Status",
    "__version__",
    "evaluate",
    "make_config",
    "run",
]

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from tidal.api import evaluate, make_config, run
    from tidal.config import Config
    from tidal.contracts import GenerationOutput, SamplingParams
    from tidal.options import ConfigError
    from tidal.reward.checks import GroupRewardFn, RewardFn
    from tidal.rollout.agent import AgentFn
    from tidal.rollout.generate import GenerateContext, GenerateFn
    from tidal.types import InputError, RunStopped, Sample, Status


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later reads find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
