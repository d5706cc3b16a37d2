#!/usr/bin/env bash
# Stress for lock algorithms: repeated keel lockmatrix runs of ALGO (default atomic_append)
# while memory_map cells load both cores, counting runs that failed (an error, or mutual
# exclusion found broken). Not part of make test: it takes minutes and hunts rare races.
#
#   scripts/stress-locks.sh [ALGO] [ROUNDS]      (a round is 6 lockmatrix runs)
set -uo pipefail
cd "$(dirname "$0")/.."
algo=${1:-atomic_append}
rounds=${2:-4}
keel=build/release/bin/keel
[ -x "$keel" ] || { echo "stress: build first (make build)" >&2; exit 2; }
fails=0 runs=0
for r in $(seq 1 "$rounds"); do
  (for i in 1 2 3; do "$keel" lockmatrix --seconds 1 --waiters 8 --entities 1:8 memory_map \
     >/dev/null 2>&1; done) &
  load=$!
  for i in 1 2 3 4 5 6; do
    runs=$((runs + 1))
    if ! err=$("$keel" lockmatrix --seconds 0.5 --waiters 2:4:8 --entities 1:4 "$algo" 2>&1 >/dev/null); then
      fails=$((fails + 1))
      grep -v "^lockmatrix:" <<<"$err" | head -2
    fi
  done
  wait "$load"
  echo "stress: round $r/$rounds: $fails of $runs runs failed" >&2
done
echo "stress: $algo: $fails of $runs runs failed"
[ "$fails" -eq 0 ]
