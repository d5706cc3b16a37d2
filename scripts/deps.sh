#!/usr/bin/env bash
# Installs the Debian packages keel needs when any is missing. Non-interactive and
# idempotent: it runs `apt-get update` only when something must be installed, and does
# nothing at all on a machine that already has everything.
#
# Usage: scripts/deps.sh            library, tests, tools and benchmarks
#        scripts/deps.sh fuzz       the same, and what the libFuzzer build needs (make fuzz)
#        scripts/deps.sh --check [fuzz]  list what is missing, install nothing (exit 1 if any)
set -euo pipefail

packages=(
  # build
  cmake ninja-build g++ pkg-config git
  # library
  liburing-dev   # io_uring engine of keel::aio
  libxxhash-dev  # hashing and checksums
  # tests, tools, benchmarks
  libgtest-dev libgmock-dev  # unit and process tests
  libbenchmark-dev           # micro-benchmarks
  libcli11-dev               # command-line parsing of keel's programs
  nlohmann-json3-dev         # machine-readable results
  libfmt-dev                 # formatting of tables and messages
  gnuplot-nox                # plots of the benchmark report
  clang-format               # the formatting check that runs as a test
  clang-19                   # the thread-safety analysis check that runs as a test
  e2fsprogs xfsprogs btrfs-progs  # mkfs for the report's per-filesystem lock rows
  fio                             # the peer of keel-bench aiobench's random reads
  glusterfs-server glusterfs-client  # a real distributed filesystem for the netfs tests
  python3-filelock python3-portalocker  # the Python locks `keel lock FILE` and keel.FileLock must exclude
  # the Python module (python/): its headers and binding library, and its tests
  python3-dev pybind11-dev python3-pytest
  lmdb-utils  # tests only: LMDB's mdb_load and mdb_dump read and write keel kv dump's format
  # keel-bench kvbench's peers (benchmark-only, never the library's)
  liblmdb-dev libtkrzw-dev librocksdb-dev libleveldb-dev libsqlite3-dev libtdb-dev
  python3-lmdb  # the Python benchmark's peer of keel.Store (python/bench/bench.py)
)

# Only for `make fuzz`: clang with libFuzzer and the sanitizer runtimes (GCC has no
# libFuzzer; `make test` replays the corpus with GCC and needs none of these).
fuzz_packages=(clang-19 libclang-rt-19-dev)

check=0
for arg in "$@"; do
  case "$arg" in
    --check) check=1 ;;
    fuzz) packages+=("${fuzz_packages[@]}") ;;
    *) echo "usage: $0 [--check] [fuzz]" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ $check -eq 1 ]; then
  echo "missing: ${missing[*]}"
  exit 1
fi

echo "deps: installing ${missing[*]}" >&2
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "deps: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q >&2
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
