#!/usr/bin/env bash
# Clang's thread-safety analysis over keel's sources: every access to state a mutex guards
# (KEEL_GUARDED_BY, src/base/thread_safety.hpp) must hold it. GCC builds keel; this check
# compiles (-fsyntax-only) with clang++ just for the analysis. First it proves the check can
# fail: a snippet that reads guarded state without the lock must be rejected.
#
# Usage: check.sh SOURCE_DIR BUILD_DIR   (BUILD_DIR for the generated version header)
set -euo pipefail
src=$1
build=$2
clang=""
for c in clang++-19 clang++; do
  if command -v "$c" >/dev/null && "$c" --version | grep -qE 'version (1[7-9]|[2-9][0-9])'; then
    clang=$c
    break
  fi
done
if [ -z "$clang" ]; then
  # ctest reads this as a skip (SKIP_RETURN_CODE 77), with the reason.
  echo "skipped: no clang++ >= 17 (scripts/deps.sh installs clang-19)"
  exit 77
fi
flags=(-std=c++23 -fsyntax-only -Wthread-safety -Wthread-safety-beta -Werror=thread-safety
       -Wno-unknown-warning-option -I"$src/src" -I"$src/include" -I"$build/include")

bad=$(mktemp --suffix=.cpp)
trap 'rm -f "$bad"' EXIT
cat >"$bad" <<'CPP'
#include "base/thread_safety.hpp"
struct counter {
  keel::base::mutex m;
  int n KEEL_GUARDED_BY(m) = 0;
  int peek() { return n; }  // no lock: the analysis must say so
};
int main() { counter c; return c.peek(); }
CPP
if "$clang" "${flags[@]}" "$bad" 2>/dev/null; then
  echo "FAIL: the analysis accepted an unguarded read: the check proves nothing" >&2
  exit 1
fi

cd "$src"
# Every mutex is one the analysis knows: a plain std::mutex (or its guards) would go unchecked.
if plain=$(grep -rnE 'std::(mutex|recursive_mutex|shared_mutex|scoped_lock|lock_guard|unique_lock)\b' \
             src include | grep -v '^src/base/thread_safety.hpp:' | grep -v '//.*std::mutex'); then
  echo "FAIL: a lock the analysis cannot see (use base::mutex and its guards):" >&2
  echo "$plain" >&2
  exit 1
fi
mapfile -t files < <(find src -name '*.cpp' | sort)
printf '%s\n' "${files[@]}" |
  xargs -P "$(nproc)" -I{} "$clang" "${flags[@]}" -Wno-everything -Wthread-safety \
    -Wthread-safety-beta -Werror=thread-safety -I/usr/include/liburing {}
echo "thread-safety analysis: ${#files[@]} sources clean"
