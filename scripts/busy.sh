#!/usr/bin/env bash
# Run a command while one CPU-bound process per core keeps the machine busy, to check that tests
# do not depend on timing (docs/testing.md). BUSY_PROCS overrides the count (default: nproc).
#   bash scripts/busy.sh bash scripts/test.sh
set -euo pipefail
if [ $# -eq 0 ]; then
  echo "usage: bash scripts/busy.sh COMMAND [ARGS...]" >&2
  exit 2
fi
n=${BUSY_PROCS:-$(nproc)}
pids=()
cmd=
stop() {
  if [ -n "$cmd" ]; then kill "$cmd" 2>/dev/null || true; fi
  if [ ${#pids[@]} -gt 0 ]; then kill "${pids[@]}" 2>/dev/null || true; fi
}
trap stop EXIT
trap 'exit 130' INT TERM # exiting runs the EXIT trap
for _ in $(seq "$n"); do
  (while :; do :; done) &
  pids+=($!)
done
echo "busy.sh: $n CPU-bound processes running (pids ${pids[*]})" >&2
# in the background and waited on, so that a signal to this script is handled at once
"$@" &
cmd=$!
status=0
wait "$cmd" || status=$?
cmd= # reaped: nothing of it to stop
exit "$status"
