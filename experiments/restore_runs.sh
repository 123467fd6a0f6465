#!/bin/sh
# The runs experiments/save_runs.sh kept, put back as a comparison directory fedfit compare --resume goes on with.
# Usage: experiments/restore_runs.sh NAME COMPARISON_DIR
set -eu
name=$1; dst=$2
src=$(dirname "$0")/kept/$name
mkdir -p "$dst"
cp "$src/compare.json" "$dst/"
[ -f "$src/config.yaml" ] && cp "$src/config.yaml" "$dst/"
for kept in "$src"/seed-*/*/report.json.gz; do
  [ -f "$kept" ] || continue
  run=$(dirname "$kept"); rel=${run#"$src"/}
  mkdir -p "$dst/$rel"
  gunzip -c "$run/report.json.gz" > "$dst/$rel/report.json"
  gunzip -c "$run/metrics.jsonl.gz" > "$dst/$rel/metrics.jsonl"
  cp "$run/summary.txt" "$dst/$rel/"
done
