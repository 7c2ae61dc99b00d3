#!/usr/bin/env bash
# Set up, convert SmolLM2-135M-Instruct once, and run the quickstart GRPO job on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
tidal convert
tidal train --config examples/quickstart/config.yaml "$@"
