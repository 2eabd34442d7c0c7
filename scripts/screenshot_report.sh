#!/usr/bin/env bash
# Render a flashcheck report.html in headless Chromium and save a PNG screenshot.
#
#   scripts/screenshot_report.sh [REPORT.html] [OUT.png]
#
# Defaults: flashcheck-out/report.html -> docs/report-screenshot.png. Needs Debian's
# `chromium` package (apt-get install -y chromium). The report is self-contained (inline CSS,
# plots as data: URIs), so networking is switched off entirely; a blank or broken screenshot
# means the page itself is broken.
set -euo pipefail
cd "$(dirname "$0")/.."
report="${1:-flashcheck-out/report.html}"
out="${2:-docs/report-screenshot.png}"
if [ ! -f "$report" ]; then
    echo "screenshot_report.sh: no report at $report (run 'flashcheck run' first)" >&2
    exit 2
fi
command -v chromium >/dev/null || { echo "screenshot_report.sh: chromium not found" >&2; exit 2; }
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$profile" --screenshot="$out" --window-size=1400,2000 \
    "file://$(realpath "$report")" 2>/dev/null
test -s "$out"
echo "wrote $out"
