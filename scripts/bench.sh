#!/usr/bin/env bash
# Runs keel's benchmark suite and renders build/report/ (called by `make bench`, after the
# release build). Defaults need no configuration: the benchmarks run in a fresh directory on
# tmpfs (/dev/shm) where there is one, else under $TMPDIR.
#
#   QUICK=1        smoke run (under 3 minutes)
#   FULL=1         the lock benchmarks at the seed's full sizes (takes long)
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
# shared 2-core machine. Lock runs: lockscale's sizes scaled down (FULL=1: the seed's sizes).
if [ "${QUICK:-}" = "1" ]; then
  reps=5 min_time=0.05
  scale_t=0.5 scale_w=10:100 matrix_s=0.1 matrix_w=1:2:4:8 matrix_e=1:4:8 short_w=2:10
elif [ "${FULL:-}" = "1" ]; then
  reps=20 min_time=0.2
  scale_t=10 scale_w=10:20:50:100:200:500:1000 matrix_s=1 matrix_w=1:2:3:4:5:6:7:8 short_w=2:5:10:20:50:100
  matrix_e=1:2:3:4:5:6:7:8
else
  reps=20 min_time=0.2
  scale_t=2 scale_w=10:100:1000 matrix_s=1 matrix_w=1:2:4:8 matrix_e=1:4:8 short_w=2:10:100
fi
keel=build/release/bin/keel

step() { echo "bench: [$1] $2" >&2; }

step 1/5 "io micro-benchmarks ($reps repetitions, interleaved)"
"$bin/keel_bench_io" --dir="$dir" \
  --benchmark_repetitions="$reps" --benchmark_min_time="$min_time" \
  --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=false \
  --benchmark_out="$out/raw/io.json" --benchmark_out_format=json \
  --benchmark_format=console --benchmark_display_aggregates_only=true >&2

step 2/5 "lockscale: every algorithm and baseline, workers $scale_w, $scale_t s each"
scale_files=()
for algo in flock fcntl sysv lock_files byte_ranges atomic_append memory_map; do
  "$keel" lockscale -t "$scale_t" -w "$scale_w" --dir "$dir" \
    --json "$out/raw/lockscale-$algo.json" "$algo" >&2
  scale_files+=(--lockscale "$out/raw/lockscale-$algo.json")
done

step 3/5 "lockscale with short critical sections (busy 10 µs, idle 10 µs), workers $short_w"
for algo in flock fcntl sysv memory_map; do
  "$keel" lockscale -b 10 -i 10 -t "$scale_t" -w "$short_w" --dir "$dir" \
    --json "$out/raw/lockscale-short-$algo.json" "$algo" >&2
  scale_files+=(--lockscale-short "$out/raw/lockscale-short-$algo.json")
done

step 4/5 "lockmatrix: waiters $matrix_w x entities $matrix_e, $matrix_s s per cell"
"$keel" lockmatrix --peers --seconds "$matrix_s" --waiters "$matrix_w" --entities "$matrix_e" \
  --dir "$dir" --json "$out/raw/lockmatrix.json" >&2

step 5/5 "report"
"$bin/keel_report" --out "$out" --targets bench/targets.json --dir "$dir" \
  "${scale_files[@]}" --lockmatrix "$out/raw/lockmatrix.json" "$out/raw/io.json"
