#!/usr/bin/env bash
# Runs keel's benchmark suite and renders build/report/ (called by `make bench`, after the
# release build). Defaults need no configuration: the benchmarks run in a fresh directory on
# tmpfs (/dev/shm) where there is one, else under $TMPDIR.
#
#   QUICK=1        smoke run (under 3 minutes)
#   BENCH_DIR=DIR  run the benchmarks in DIR instead (to measure another filesystem)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=build/release/bin
out=build/report
mkdir -p "$out/raw"
rm -f "$out"/raw/*.json

if [ -n "${BENCH_DIR:-}" ]; then
  mkdir -p "$BENCH_DIR"
  dir=$(mktemp -d "$BENCH_DIR/keel-bench.XXXXXX")
elif [ "$(stat -f -c %T /dev/shm 2>/dev/null)" = "tmpfs" ] && [ -w /dev/shm ]; then
  dir=$(mktemp -d /dev/shm/keel-bench.XXXXXX)
else
  dir=$(mktemp -d "${TMPDIR:-/tmp}/keel-bench.XXXXXX")
fi
trap 'rm -rf "$dir"' EXIT
echo "bench: running in $dir ($(stat -f -c %T "$dir"))" >&2

# Many short repetitions, interleaved, and the median: robust against the bursts of noise of a
# shared 2-core machine.
if [ "${QUICK:-}" = "1" ]; then
  reps=5 min_time=0.05
else
  reps=20 min_time=0.2
fi

step() { echo "bench: [$1] $2" >&2; }

step 1/2 "io micro-benchmarks ($reps repetitions, interleaved)"
"$bin/keel_bench_io" --dir="$dir" \
  --benchmark_repetitions="$reps" --benchmark_min_time="$min_time" \
  --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=false \
  --benchmark_out="$out/raw/io.json" --benchmark_out_format=json \
  --benchmark_format=console --benchmark_display_aggregates_only=true >&2

step 2/2 "report"
"$bin/keel_report" --out "$out" --targets bench/targets.json --dir "$dir" "$out"/raw/*.json
