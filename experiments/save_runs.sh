#!/bin/sh
# Keep what a long comparison has finished in the repository (experiments/kept/NAME/; runs/ is ignored), so that a later session on a
# fresh machine can go on with it: each finished run's report.json and metrics.jsonl (gzipped) and summary.txt, and
# the comparison's own compare.json and config.yaml. Restore with experiments/restore_runs.sh, then
# `fedfit compare --resume DIR` runs what is not finished (a run stopped part-way starts over).
# Usage: experiments/save_runs.sh COMPARISON_DIR NAME
set -eu
src=$1; name=$2
dst=$(dirname "$0")/kept/$name
mkdir -p "$dst"
cp "$src/compare.json" "$src/config.yaml" "$dst/" 2>/dev/null || cp "$src/compare.json" "$dst/"
for report in "$src"/seed-*/*/report.json; do
  [ -f "$report" ] || continue
  run=$(dirname "$report"); rel=${run#"$src"/}
  mkdir -p "$dst/$rel"
  gzip -9 -n -c "$run/report.json" > "$dst/$rel/report.json.gz"
  gzip -9 -n -c "$run/metrics.jsonl" > "$dst/$rel/metrics.jsonl.gz"
  cp "$run/summary.txt" "$dst/$rel/"
done
ls -R "$dst" | head -40
