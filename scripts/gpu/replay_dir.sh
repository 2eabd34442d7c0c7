#!/usr/bin/env bash
# Replay every case file under DIR on CUDA with the kernel it names (flashcheck repro, a fresh
# process each, side by side); logs and exit codes in $2 (default gpu_out/replays).
#   bash scripts/gpu/replay_dir.sh DIR [LOGDIR]
set -uo pipefail
D=${1:?case-file directory}; L=${2:-gpu_out/replays}; mkdir -p "$L"
for f in "$D"/*.json; do
  k=$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['kernel'])" "$f")
  n=$(basename "$f" .json)
  ( python3 -m flashcheck repro "$f" --kernel "$k" --device cuda > "$L/$k-$n.log" 2>&1
    echo "exit=$?" >> "$L/$k-$n.log" ) &
done
wait
grep -H "exit=\|^status" "$L"/*.log
