#!/usr/bin/env bash
# Stress for lock algorithms: repeated keel-bench lockmatrix runs of ALGO (default atomic_append)
# while memory_map cells load both cores, counting runs that failed (an error, or mutual
# exclusion found broken), the load runs' too (they are memory_map runs: a break there
# counts). Not part of make test: it takes minutes and hunts rare races; `make torture` runs
# it for every algorithm.
#
#   scripts/stress-locks.sh [ALGO] [ROUNDS]      (a round is 6 lockmatrix runs + 3 load runs)
set -uo pipefail
cd "$(dirname "$0")/.."
algo=${1:-atomic_append}
rounds=${2:-4}
keel_bench=build/release/bin/keel-bench
[ -x "$keel_bench" ] || { echo "stress: build first (make build)" >&2; exit 2; }
fails=0 runs=0
for r in $(seq 1 "$rounds"); do
  # The load's own failures are its exit status (0..3).
  (failed=0
   for i in 1 2 3; do
     if ! err=$("$keel_bench" lockmatrix --seconds 1 --waiters 8 --entities 1:8 memory_map 2>&1 \
                >/dev/null); then
       failed=$((failed + 1))
       grep -v "^lockmatrix:" <<<"$err" | head -2 | sed 's/^/load (memory_map): /'
     fi
   done
   exit "$failed") &
  load=$!
  for i in 1 2 3 4 5 6; do
    runs=$((runs + 1))
    if ! err=$("$keel_bench" lockmatrix --seconds 0.5 --waiters 2:4:8 --entities 1:4 "$algo" 2>&1 >/dev/null); then
      fails=$((fails + 1))
      grep -v "^lockmatrix:" <<<"$err" | head -2
    fi
  done
  wait "$load"
  load_failed=$?
  runs=$((runs + 3))
  fails=$((fails + load_failed))
  echo "stress: round $r/$rounds: $fails of $runs runs failed" >&2
done
echo "stress: $algo: $fails of $runs runs failed"
[ "$fails" -eq 0 ]
