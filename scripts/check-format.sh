#!/usr/bin/env bash
# Fails when a C++ file of the tree differs from what clang-format (.clang-format) makes of it.
# Usage: scripts/check-format.sh [SOURCE_DIR]    fix with: make format
set -euo pipefail
root=${1:-$(dirname "$0")/..}
cd "$root"
command -v clang-format >/dev/null || { echo "clang-format is not installed (scripts/deps.sh)"; exit 1; }
mapfile -t files < <(find include src tests bench tools torture fuzz python/src -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.c' -o -name '*.h' \) | sort)
[ ${#files[@]} -gt 0 ] || { echo "no C++ files found under $root"; exit 1; }
if ! clang-format --dry-run --Werror "${files[@]}"; then
  echo "formatting differs: run 'make format'"
  exit 1
fi
echo "${#files[@]} files formatted"
