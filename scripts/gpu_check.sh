#!/usr/bin/env bash
# What a user with a GPU runs first: the environment (torch, CUDA, NCCL, GPUs, memory), the
# quickstart on cuda for 5 steps, and a 2-rank NCCL FSDP2 step when 2 GPUs are present, each
# with PASS/FAIL/SKIP and its figures. Needs a CUDA build of torch in .venv (see docs/gpu.md).
# `bash scripts/gpu_check.sh --device cpu` rehearses the same checks on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
.venv/bin/python -m tidal.cli convert >/dev/null
.venv/bin/python scripts/gpu_check.py "$@"
