"""tidal: reinforcement-learning post-training for language models, from a laptop to a cluster."""

import os

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
