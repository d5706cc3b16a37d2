#pragma once
// The crash and fault harness (`keel-bench torture`, and a short pass in `make test`): runs a
// workload again and again under one mode of failure and checks an oracle after each cycle.
//
// Modes: kill (SIGKILL a user at a random moment, recover, check), powerloss (cut the power
// at a random operation on the fault seam, rebuild what survived, reopen, check), io-errors
// (fail the N-th operation, once or from then on: the workload returns the error, never
// crashes or hangs or breaks its promise; after the fault clears, everything reopens
// intact), corrupt (flip bits, zero ranges, truncate the files keel writes: use reports a
// clear error naming the file, never crashes or hangs, and never returns a wrong answer
// where checksums are on), and for keel::aio (the cache workload) two more: fork (the
// writer, with writes in flight, forks children that must be refused the inherited
// controller and run one of their own; the file must end exactly as the writer's
// acknowledged writes left it) and mixed (two writers of any engine, cache or not, any
// submitter, writes in flight, on halves of one file, each killed at a random moment or
// left to finish; what their fsyncs covered, or their writes if they finished, must hold).
//
// Every cycle has its own seed (the run's seed + the cycle number): a failure prints it, and
// `--seed S --cycles 1` replays that cycle alone.

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "base/planted.hpp"

namespace keel::torture {

enum class mode : std::uint8_t { kill, powerloss, io_errors, corrupt, fork, mixed };
enum class workload : std::uint8_t { atomic_append, memory_map, cache, kv };

[[nodiscard]] std::string_view to_string(mode m) noexcept;
[[nodiscard]] std::string_view to_string(workload w) noexcept;
[[nodiscard]] bool mode_from(std::string_view s, mode& out) noexcept;
[[nodiscard]] bool workload_from(std::string_view s, workload& out) noexcept;
[[nodiscard]] std::vector<mode> all_modes();
[[nodiscard]] std::vector<workload> all_workloads();
//! Whether `m` means anything for `w` (the cache has no file format to corrupt; fork and
//! mixed are keel::aio's).
[[nodiscard]] bool applies(mode m, workload w) noexcept;

struct config {
  mode how = mode::kill;
  workload what = workload::atomic_append;
  std::uint64_t cycles = 100;
  std::uint64_t seed = 1;
  //! Where cycles make their files (a directory of this run's own is made inside).
  std::string directory = "/tmp";
  //! Where memory_map puts its maps (tmpfs).
  std::string map_directory = "/dev/shm";
  base::planted_bug plant = base::planted_bug::none;
  //! Stop at the first failure (a planted bug needs no more).
  bool stop_at_first_failure = true;
};

struct failure {
  std::uint64_t seed = 0;  //!< replays the cycle
  std::string what;
};

struct outcome {
  std::uint64_t cycles = 0;
  std::vector<failure> failures;
};

//! Runs `c.cycles` cycles (fewer if one fails and c.stop_at_first_failure; none where the
//! mode does not apply to the workload); `progress` is
//! called after each cycle with the cycles done so far.
[[nodiscard]] outcome run(const config& c,
                          const std::function<void(std::uint64_t done)>& progress = {});

}  // namespace keel::torture
