#!/bin/sh
# The runs experiments/save_runs.sh kept, put back as a comparison directory fedfit compare --resume goes on with.
# Usage: experiments/restore_runs.sh NAME COMPARISON_DIR
set -eu
name=$1; dst=$2
src=$(dirname "$0")/kept/$name
mkdir -p "$dst"
cp "$src/compare.json" "$dst/"
[ -f "$src/config.yaml" ] && cp "$src/config.yaml" "$dst/"
for run in "$src"/*/ "$src"/seed-*/*/; do
  run=${run%/}; rel=${run#"$src"/}
  [ -d "$run" ] || continue  # (a pattern that matched nothing)
  case $rel in seed-*/*) ;; seed-*) continue ;; esac  # (a seed's directory holds runs; it is none)
  mkdir -p "$dst/$rel"
  if [ -f "$run/report.json.gz" ]; then
    gunzip -c "$run/report.json.gz" > "$dst/$rel/report.json"
    gunzip -c "$run/metrics.jsonl.gz" > "$dst/$rel/metrics.jsonl"
    cp "$run/summary.txt" "$dst/$rel/"
    if [ -d "$run/carry" ]; then  # (kept to be carried on: its checkpoint and calibrations)
      gunzip -c "$run/carry/checkpoint.safetensors.gz" > "$dst/$rel/checkpoint.safetensors"
      [ -d "$run/carry/agents" ] && cp -r "$run/carry/agents" "$dst/$rel/"
    fi
  elif [ -d "$run/part-way" ]; then
    gunzip -c "$run/part-way/checkpoint.safetensors.gz" > "$dst/$rel/checkpoint.safetensors"
    gunzip -c "$run/part-way/metrics.jsonl.gz" > "$dst/$rel/metrics.jsonl"
    [ -d "$run/part-way/agents" ] && cp -r "$run/part-way/agents" "$dst/$rel/"
  fi
done
