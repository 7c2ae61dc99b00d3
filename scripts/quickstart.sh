#!/usr/bin/env bash
# Set up, convert SmolLM2-135M-Instruct once, and run the quickstart GRPO job on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
TIDAL_EXTRAS="" bash scripts/setup.sh  # no test tools: just what the run needs
. .venv/bin/activate
tidal convert
# a second run goes to a new folder: tidal refuses to start a new run in a used one
out=runs/quickstart
[ -e "$out" ] && out="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
tidal train --config examples/quickstart/config.yaml --train.output_dir "$out" "$@"
