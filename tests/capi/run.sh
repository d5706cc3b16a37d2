#!/usr/bin/env bash
# Runs the C API's test program in a scratch directory of its own. Usage: run.sh PROGRAM
set -euo pipefail
dir=$(mktemp -d "${TMPDIR:-/tmp}/keel-capi.XXXXXX")
trap 'rm -rf "$dir"' EXIT
"$1" "$dir"
