#!/usr/bin/env bash
# Prints what each test that failed in the last ctest run of a build directory printed (the
# last LINES lines of it, 60 by default), after ctest's summary: a CI log that keeps only its
# end then still shows why. Usage: scripts/ctest-failures.sh BUILD_DIR [LINES]
set -u
log="${1:?usage: scripts/ctest-failures.sh BUILD_DIR [LINES]}/Testing/Temporary/LastTest.log"
lines="${2:-60}"
[ -r "$log" ] || { echo "ctest-failures: no $log" >&2; exit 2; }
awk -v keep="$lines" '
  /^[0-9]+\/[0-9]+ Test: / { name = substr($0, index($0, ": ") + 2); n = 0; inside = 0; next }
  /^Output:$/ { inside = 1; getline; next }   # (the dashes under it)
  /^<end of output>$/ { inside = 0; next }
  inside { out[n++] = $0; next }
  /^Test Failed/ && name != "" {
    print "\n=== failed: " name " (" $0 "), its last lines:"
    for (i = (n > keep ? n - keep : 0); i < n; ++i) print out[i]
    name = ""; n = 0
  }
' "$log"
