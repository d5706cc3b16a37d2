#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then builds and runs a tiny consumer against
# it twice: with CMake's find_package(keel) and with pkg-config. Usage: run.sh BUILD_DIR CONSUMER_DIR CXX
set -euo pipefail
build=$1 consumer=$2 cxx=$3
tmp=$(mktemp -d "${TMPDIR:-/tmp}/keel-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

cmake --install "$build" --prefix "$tmp/prefix" >/dev/null

# CMake: find_package(keel), both the shared and the static library.
cmake -S "$consumer" -B "$tmp/cmake-build" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" \
      -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
cmake --build "$tmp/cmake-build" >/dev/null
LD_LIBRARY_PATH="$tmp/prefix/lib:$tmp/prefix/lib64" "$tmp/cmake-build/consumer_shared" "$tmp"
"$tmp/cmake-build/consumer_static" "$tmp"
if ldd "$tmp/cmake-build/consumer_static" | grep -q libkeel; then
  echo "consumer_static links libkeel.so: the static library was not used" >&2
  exit 1
fi

# pkg-config.
pcdir=$(dirname "$(find "$tmp/prefix" -name keel.pc | head -1)")
flags=$(PKG_CONFIG_PATH="$pcdir" pkg-config --cflags --libs keel)
# shellcheck disable=SC2086
"$cxx" "$consumer/main.cpp" -o "$tmp/consumer_pc" $flags
LD_LIBRARY_PATH="$tmp/prefix/lib:$tmp/prefix/lib64" "$tmp/consumer_pc" "$tmp"
echo "install tree works with find_package(keel) and pkg-config"
