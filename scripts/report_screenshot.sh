#!/usr/bin/env bash
# Render `tidal report RUN_DIR` in headless Chromium (Debian: apt-get install chromium) to a PNG.
#   scripts/report_screenshot.sh RUN_DIR OUT.png [WIDTH,HEIGHT]
# The page goes to a temporary folder (never into the repository); Chromium runs with a throwaway
# profile and every background network feature off, so the screenshot shows what the file alone holds.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 RUN_DIR OUT.png [WIDTH,HEIGHT]" >&2
  exit 2
fi
# both paths absolute before the cd below: relative ones are meant from where the script was started
run_dir=$(realpath -m "$1")
out=$(realpath -m "$2")
size=${3:-1400,2400}
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
[ -x .venv/bin/python ] && py=.venv/bin/python
browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then
  echo "$0: chromium not found (Debian/Ubuntu: apt-get install -y chromium)" >&2
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m tidal.cli report "$run_dir" --out "$tmp/report.html" >/dev/null
"$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$tmp/profile" --hide-scrollbars --window-size="$size" \
  --screenshot="$out" "file://$tmp/report.html" 2>"$tmp/chromium.log" || {
  cat "$tmp/chromium.log" >&2
  exit 1
}
[ -s "$out" ] || { echo "$0: chromium wrote no screenshot" >&2; cat "$tmp/chromium.log" >&2; exit 1; }
echo "$out"
