// keel-bench torture: the crash and fault harness from the command line (torture/torture.hpp).

#include "torture_command.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>

#include "torture.hpp"

namespace keel::tools {

int run_torture_command(int argc, char** argv) {
  CLI::App app{
      "Run keel's workloads under failure, cycle after cycle, and check an oracle after each:\n"
      "  kill       SIGKILL a user at a random moment; a new user must get every lock,\n"
      "             every acknowledged commit must be there\n"
      "  powerloss  cut the power at a random file operation (fault seam), rebuild what\n"
      "             survived (torn writes in half the cycles), reopen, check\n"
      "  io-errors  fail the N-th file operation once or forever (EIO, ENOSPC, and for kv\n"
      "             EDQUOT, EMFILE, ENOMEM): errors are returned, never a crash, hang or\n"
      "             double holder; all reopens after\n"
      "  corrupt    flip bits, zero ranges, truncate (kv: and remove) files of a closed\n"
      "             lock or store: a clear error naming the file, or a wait; never a crash,\n"
      "             hang, wrong grant, or an older or another key's value\n"
      "  fork       (cache) the writer forks children with writes in flight: each must be\n"
      "             refused the inherited controller and run one of its own; the file ends\n"
      "             exactly as the writer's acknowledged writes left it\n"
      "  mixed      (cache) two writers of random engines, cache or not, writes in flight,\n"
      "             on halves of one file, killed at random moments or left to finish\n"
      "Workloads: the atomic_append lock log, the memory_map table, the aio write-back cache\n"
      "(what a successful fsync covered must be in the file), and keel::kv (transactions\n"
      "checked against an oracle of what each wrote and whether it was acknowledged).\n"
      "A failure prints the seed that replays it: --seed S --cycles 1.",
      "keel-bench torture"};
  std::string mode_name = "all";
  std::string workload_name = "all";
  torture::config c;
  std::string plant = "none";
  bool keep_going = false;
  app.add_option("--mode", mode_name, "kill, powerloss, io-errors, corrupt, fork, mixed, or all")
      ->capture_default_str();
  app.add_option("--workload", workload_name, "atomic_append, memory_map, cache, kv, or all")
      ->capture_default_str();
  app.add_option("--cycles", c.cycles, "Cycles per mode and workload")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{100'000'000}));
  app.add_option("--seed", c.seed, "Seed of the first cycle (cycle i uses seed + i)")
      ->capture_default_str();
  app.add_option("--dir", c.directory, "Where cycles make their files")
      ->capture_default_str()
      ->check(CLI::ExistingDirectory);
  app.add_option("--map-dir", c.map_directory, "Where memory_map puts its maps (tmpfs)")
      ->capture_default_str()
      ->check(CLI::ExistingDirectory);
  app.add_option(
         "--plant", plant,
         "Run with a bug planted on purpose, to see the harness catch it: "
         "memory_map_skips_recovery, atomic_append_skips_header_sync, "
         "atomic_append_ignores_failed_append, atomic_append_skips_checksum, "
         "cache_skips_fsync, cache_forgets_failed_write_out, aio_child_uses_parents_controller")
      ->capture_default_str();
  app.add_flag("--keep-going", keep_going, "Go on after a failure (default: stop at the first)");
  try {
    app.parse(argc, argv);
    if (!base::planted_bug_from(plant, c.plant)) {
      throw CLI::ValidationError("--plant", "no planted bug named '" + plant + "'");
    }
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  std::vector<torture::mode> modes;
  std::vector<torture::workload> workloads;
  if (mode_name == "all") {
    modes = torture::all_modes();
  } else {
    torture::mode m{};
    if (!torture::mode_from(mode_name, m)) {
      fmt::print(stderr, "keel-bench torture: --mode: no mode named '{}'\n", mode_name);
      return 2;
    }
    modes.push_back(m);
  }
  if (workload_name == "all") {
    workloads = torture::all_workloads();
  } else {
    torture::workload w{};
    if (!torture::workload_from(workload_name, w)) {
      fmt::print(stderr, "keel-bench torture: --workload: no workload named '{}'\n", workload_name);
      return 2;
    }
    workloads.push_back(w);
  }
  c.stop_at_first_failure = !keep_going;
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  fmt::print("{:<10} {:<14} {:>9} {:>9} {:>9}  {}\n", "mode", "workload", "cycles", "failures",
             "seconds", "first failure (seed: what)");
  bool failed = false;
  for (const torture::mode m : modes) {
    for (const torture::workload w : workloads) {
      if (!torture::applies(m, w)) continue;  // the cache has no file format to corrupt
      c.how = m;
      c.what = w;
      const auto start = std::chrono::steady_clock::now();
      auto last = start;
      const auto progress = [&](std::uint64_t done) {
        const auto now = std::chrono::steady_clock::now();
        if (now - last < std::chrono::seconds(1) && done != c.cycles) return;
        last = now;
        fmt::print(stderr, "{}{}/{}: {}/{} cycles{}", tty ? "\r" : "", torture::to_string(m),
                   torture::to_string(w), done, c.cycles, tty ? "   " : "\n");
      };
      const torture::outcome out = torture::run(c, progress);
      if (tty) fmt::print(stderr, "\n");
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::string first;
      if (!out.failures.empty()) {
        failed = true;
        first = fmt::format("{}: {}", out.failures.front().seed, out.failures.front().what);
      }
      fmt::print("{:<10} {:<14} {:>9} {:>9} {:>9.1f}  {}\n", torture::to_string(m),
                 torture::to_string(w), out.cycles, out.failures.size(), secs, first);
      for (std::size_t k = 1; k < out.failures.size() && k < 10; ++k) {
        fmt::print("{:>57}  {}: {}\n", "", out.failures[k].seed, out.failures[k].what);
      }
      std::fflush(stdout);
    }
  }
  if (c.plant != base::planted_bug::none) {
    fmt::print("planted bug {}: {}\n", base::to_string(c.plant), failed ? "caught" : "NOT caught");
  }
  return failed ? 1 : 0;
}

}  // namespace keel::tools
