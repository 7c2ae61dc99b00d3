#!/usr/bin/env bash
# Set up and run the whole test suite (fast unit tests + the slow end-to-end ones on SmolLM2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest "$@"
