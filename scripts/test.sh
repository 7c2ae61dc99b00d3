#!/usr/bin/env bash
# Set up and run the whole test suite (fast unit tests + the slow end-to-end ones on SmolLM2).
# Arguments go to pytest. TIDAL_SKIP_SETUP=1 uses the existing .venv as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${TIDAL_SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup.sh
fi
. .venv/bin/activate
python -c "import torch; print(f'torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}')"
python -m pytest "$@"
