#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then builds and runs a tiny consumer against
# it twice: with CMake's find_package(keel) and with pkg-config; then a C consumer of the C API
# (keel/keel.h) the same two ways. Usage: run.sh BUILD_DIR CONSUMER_DIR CXX CONSUMER_C_DIR CC
set -euo pipefail
build=$1 consumer=$2 cxx=$3 consumer_c=$4 cc=$5
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

# C: find_package(keel) from a C and C++ project, and pkg-config's keel-c (shared and static).
cmake -S "$consumer_c" -B "$tmp/cmake-build-c" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" \
      -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
cmake --build "$tmp/cmake-build-c" >/dev/null
LD_LIBRARY_PATH="$tmp/prefix/lib:$tmp/prefix/lib64" "$tmp/cmake-build-c/consumer_c" "$tmp"
flags=$(PKG_CONFIG_PATH="$pcdir" pkg-config --cflags --libs keel-c)
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Werror "$consumer_c/main.c" -o "$tmp/consumer_c_pc" $flags
LD_LIBRARY_PATH="$tmp/prefix/lib:$tmp/prefix/lib64" "$tmp/consumer_c_pc" "$tmp"
libdir=$(PKG_CONFIG_PATH="$pcdir" pkg-config --variable=libdir keel-c)
static_flags=$(PKG_CONFIG_PATH="$pcdir" pkg-config --static --cflags --libs-only-other --libs-only-l keel-c \
               | sed 's/-lkeel //')
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Werror "$consumer_c/main.c" -o "$tmp/consumer_c_static" \
      $(PKG_CONFIG_PATH="$pcdir" pkg-config --cflags keel-c) "$libdir/libkeel.a" $static_flags
if ldd "$tmp/consumer_c_static" | grep -q libkeel; then
  echo "consumer_c_static links libkeel.so: the static library was not used" >&2
  exit 1
fi
"$tmp/consumer_c_static" "$tmp"
echo "install tree works with find_package(keel) and pkg-config, from C++ and from C"
