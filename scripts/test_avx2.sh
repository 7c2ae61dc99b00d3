#!/usr/bin/env bash
# Run the test suite with torch restricted to AVX2 kernels, as on a CPU without AVX-512: the other
# kind of machine the suite must pass on (docs/testing.md). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${TIDAL_SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup.sh
fi
# ATen's kernels, oneDNN's and MKL's each pick their instruction set on their own: cap all three.
export ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
cap=$(.venv/bin/python -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
if [ "$cap" != AVX2 ]; then
  echo "test_avx2.sh: torch reports CPU capability $cap, not AVX2 (a CPU without AVX2?)" >&2
  exit 1
fi
TIDAL_SKIP_SETUP=1 exec bash scripts/test.sh "$@"
