# The two commands a newcomer needs: `make bench` and `make test`. Everything else is here for
# those who work on keel. Each target installs missing Debian packages first (scripts/deps.sh).
#
#   make bench [QUICK=1|FULL=1] [BENCH_DIR=PATH]  build, run the benchmarks, write build/report/
#   make test                               build release, run every test (ctest)
#   make build                              build the release preset (bin/keel, bin/keel-bench)
#   make torture [TORTURE_CYCLES=N] [STRESS_ROUNDS=N]  the crash and fault harness's long pass,
#                                           then the lock stress for every algorithm
#   make test-asan | test-tsan | test-debug build and test one sanitizer/debug preset
#   make fuzz [FUZZ_SECONDS=60]             build the libFuzzer harnesses (clang), run each that long
#   make install [PREFIX=/usr/local]        install headers, libraries, CMake and pkg-config files
#   make format                             reformat the tree with clang-format
#   make clean

PREFIX ?= /usr/local
JOBS ?= $(shell nproc)
FUZZ_SECONDS ?= 60

STRESS_ROUNDS ?= 4
TORTURE_CYCLES ?= 10000

.PHONY: all deps build test bench torture fuzz install format clean test-asan test-tsan test-debug

all: build

deps:
	@scripts/deps.sh

build: deps
	cmake --preset release >/dev/null
	cmake --build --preset release -j $(JOBS)

# A failure prints each failed test's last lines again after ctest's summary (a CI log kept
# only by its end still says why).
test: build
	ctest --preset release || { scripts/ctest-failures.sh build/release; exit 1; }

# Implicit rules are never searched for phony targets, hence one explicit rule per preset.
define preset_test
test-$(1): deps
	cmake --preset $(1) >/dev/null
	cmake --build --preset $(1) -j $$(JOBS)
	ctest --preset $(1) || { scripts/ctest-failures.sh build/$(1); exit 1; }
endef
$(foreach p,asan tsan debug,$(eval $(call preset_test,$(p))))

bench: build
	QUICK=$(QUICK) FULL=$(FULL) BENCH_DIR=$(BENCH_DIR) scripts/bench.sh

# Every mode on every workload, TORTURE_CYCLES cycles each (10 000: about an hour and a half
# on 2 cores). Prints cycles, failures and the seed that replays a failure.
torture: build
	build/release/bin/keel-bench torture --cycles $(TORTURE_CYCLES) --keep-going
	for a in lock_files byte_ranges atomic_append memory_map flock fcntl sysv; do \
	  scripts/stress-locks.sh $$a $(STRESS_ROUNDS) || exit 1; done

# New inputs go to build/fuzz/new/, crashes to build/fuzz/crashes/ (README: Fuzzing).
fuzz:
	@scripts/deps.sh fuzz
	cmake --preset fuzz >/dev/null
	cmake --build --preset fuzz -j $(JOBS)
	scripts/fuzz.sh $(FUZZ_SECONDS)

install: build
	cmake --install build/release --prefix $(PREFIX)

format:
	find include src tests bench tools torture fuzz python/src -name '*.cpp' -o -name '*.hpp' -o -name '*.c' -o -name '*.h' | xargs clang-format -i

clean:
	rm -rf build
