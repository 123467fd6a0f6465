#!/bin/sh
# Keep what a long comparison has done in the repository (experiments/kept/NAME/; runs/ is ignored), so that a later
# session on a fresh machine can go on with it: each finished run's report.json and metrics.jsonl (gzipped) and
# summary.txt; a run stopped part-way, its checkpoint and metrics (gzipped) and its agents' calibrations (fedfit
# compare --resume goes on from its last checkpointed round; the round it was in is run again); and the comparison's
# own compare.json and config.yaml. Stop the comparison first (kill -TERM its process group) when it is running.
# Restore with experiments/restore_runs.sh NAME DIR, then `fedfit compare --resume DIR`. The LABELs named after NAME
# (e.g. scalefl) keep their finished runs' checkpoint and calibrations too (carry/), so that a later
# `fedfit compare --resume DIR --rounds N` can carry them on.
# Usage: experiments/save_runs.sh COMPARISON_DIR NAME [LABEL ...]
set -eu
src=$1; name=$2; shift 2
dst=$(dirname "$0")/kept/$name
keep_calibrations() {  # RUN_DIR DEST: the run's agents' calibrations, under DEST/agents/<agent>/
  for calibration in "$1"/agents/*/calibration-*.json; do
    [ -f "$calibration" ] || continue
    agent=$(basename "$(dirname "$calibration")")
    mkdir -p "$2/agents/$agent"
    cp "$calibration" "$2/agents/$agent/"
  done
}
mkdir -p "$dst"
cp "$src/compare.json" "$dst/"
[ -f "$src/config.yaml" ] && cp "$src/config.yaml" "$dst/"
for run in "$src"/*/ "$src"/seed-*/*/; do
  run=${run%/}; rel=${run#"$src"/}
  [ -d "$run" ] || continue  # (a pattern that matched nothing)
  case $rel in seed-*/*) ;; seed-*) continue ;; esac  # (a seed's directory holds runs; it is none)
  if [ -f "$run/report.json" ]; then
    rm -rf "${dst:?}/$rel"; mkdir -p "$dst/$rel"
    gzip -9 -n -c "$run/report.json" > "$dst/$rel/report.json.gz"
    gzip -9 -n -c "$run/metrics.jsonl" > "$dst/$rel/metrics.jsonl.gz"
    cp "$run/summary.txt" "$dst/$rel/"
    for label in "$@"; do
      [ "$(basename "$run")" = "$label" ] && [ -f "$run/checkpoint.safetensors" ] || continue
      mkdir -p "$dst/$rel/carry"
      gzip -9 -n -c "$run/checkpoint.safetensors" > "$dst/$rel/carry/checkpoint.safetensors.gz"
      keep_calibrations "$run" "$dst/$rel/carry"
    done
  elif [ -f "$run/checkpoint.safetensors" ]; then
    rm -rf "${dst:?}/$rel"; mkdir -p "$dst/$rel/part-way"
    gzip -9 -n -c "$run/checkpoint.safetensors" > "$dst/$rel/part-way/checkpoint.safetensors.gz"
    gzip -9 -n -c "$run/metrics.jsonl" > "$dst/$rel/part-way/metrics.jsonl.gz"
    keep_calibrations "$run" "$dst/$rel/part-way"
  fi
done
find "$dst" -type f | sort
