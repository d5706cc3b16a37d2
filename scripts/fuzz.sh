#!/usr/bin/env bash
# Runs every fuzz harness (build/fuzz/bin/fuzz_*, the `fuzz` preset) for SECONDS each, one
# after the other, over its corpus in fuzz/corpus/<name>/. The repository's corpus is only
# read: new inputs go to build/fuzz/new/<name>/, crashes to build/fuzz/crashes/. Prints each
# fuzzer's last status line (cov: ft: exec/s) and exits 1 if any found something.
#
# Usage: scripts/fuzz.sh [SECONDS] [NAME...]     (make fuzz FUZZ_SECONDS=3600)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-60}
shift || true
bin="$root/build/fuzz/bin"
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in "$bin"/fuzz_*; do names+=("$(basename "$f" | sed 's/^fuzz_//')"); done
fi
[ -x "$bin/fuzz_${names[0]}" ] || { echo "no fuzzers in $bin: build the fuzz preset (make fuzz)"; exit 1; }

failed=()
for name in "${names[@]}"; do
  new="$root/build/fuzz/new/$name"
  crashes="$root/build/fuzz/crashes/$name"
  mkdir -p "$new" "$crashes"
  log="$root/build/fuzz/$name.log"
  echo "== $name: ${seconds}s (log: build/fuzz/$name.log)"
  # -timeout: one input running 10 s is a hang (the log harness waits 5 ms at most).
  "$bin/fuzz_$name" "$new" "$root/fuzz/corpus/$name" -max_total_time="$seconds" -timeout=10 \
    -rss_limit_mb=4096 -max_len=16384 -artifact_prefix="$crashes/" -print_final_stats=1 \
    >"$log" 2>&1
  rc=$?
  grep -E '^#[0-9]+[[:space:]]+(DONE|pulse|NEW|REDUCE)' "$log" | tail -n 1
  grep -E '^stat::(number_of_executed_units|average_exec_per_sec)' "$log"
  if [ $rc -ne 0 ]; then
    failed+=("$name")
    echo "!! $name found a problem: see build/fuzz/$name.log and $crashes/"
  fi
done
if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzzers that failed: ${failed[*]}"
  exit 1
fi
