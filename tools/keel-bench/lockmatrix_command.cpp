// keel-bench lockmatrix: the waiters × entities tables of the shared_fs_mutex talk. For each
// algorithm, processes lock and unlock sets of entities for a fixed time per cell; cells hold
// lock+unlock operations per second. Contended: every waiter locks the same entities,
// exclusively. Uncontended: each waiter locks entities of its own.

#include "lockmatrix_command.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli_util.hpp"
#include "keel/io/fs_info.hpp"
#include "keel/lock/algorithms.hpp"
#include "lockscale_command.hpp"
#include "worker_pool.hpp"

namespace keel::tools {
namespace {

// Peers measured by the same harness, outside the shared_fs_mutex interface: what the
// algorithms' costs are judged against.
//   cas: a bare spinlock per entity in shared memory (compare-and-swap 0 -> 1, store 0),
//        taken in order, spinning with a pause instruction.
//   ofd: raw fcntl(F_OFD_SETLKW) / F_OFD_SETLK unlock per entity on one lock file.
const std::vector<std::string> peer_names = {"cas", "ofd"};

struct cell_outcome {
  double ops_per_second = 0;
  std::int64_t violations = 0;
  std::string error;
};

cell_outcome run_cell(const std::string& algo, const std::string& lock_path, std::size_t waiters,
                      std::size_t entities, bool contended, double seconds) {
  run_options opts;
  opts.workers = waiters;
  opts.duration = std::chrono::duration<double>(seconds);
  opts.groups = contended ? 1 : waiters;
  if (!contended) opts.group_of = [](std::size_t i) { return i; };
  // The cas peer's spinlocks: one word per (waiter, entity), shared with the forked workers.
  const std::size_t words = (waiters + 1) * entities;
  auto* spin = static_cast<std::atomic<std::uint32_t>*>(
      ::mmap(nullptr, words * 64, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (spin == MAP_FAILED) throw std::runtime_error("mmap of the cas peer's spinlocks failed");
  const auto unmap = [&] { ::munmap(spin, words * 64); };
  const auto peer_body = [&](worker_context& ctx) {
    const std::size_t first = contended ? 0 : (ctx.index() + 1) * entities;
    if (algo == "cas") {
      while (!ctx.stopping()) {
        for (std::size_t e = 0; e < entities; ++e) {
          auto& w = spin[(first + e) * 16];  // a cache line each
          std::uint32_t expected = 0;
          while (!w.compare_exchange_weak(expected, 1, std::memory_order_acquire)) {
            expected = 0;
            _mm_pause();
          }
        }
        ctx.enter(true);
        ctx.leave(true);
        for (std::size_t e = entities; e-- > 0;) {
          spin[(first + e) * 16].store(0, std::memory_order_release);
        }
        ctx.count();
      }
      return;
    }
    const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      ctx.fail(std::string("open: ") + std::strerror(errno));
      return;
    }
    struct flock fl {};
    fl.l_whence = SEEK_SET;
    fl.l_len = 1;
    while (!ctx.stopping()) {
      for (std::size_t e = 0; e < entities; ++e) {
        fl.l_type = F_WRLCK;
        fl.l_start = static_cast<off_t>(first + e + 1);
        if (::fcntl(fd, F_OFD_SETLKW, &fl) != 0) {
          ctx.fail(std::string("fcntl: ") + std::strerror(errno));
          return;
        }
      }
      ctx.enter(true);
      ctx.leave(true);
      for (std::size_t e = 0; e < entities; ++e) {
        fl.l_type = F_UNLCK;
        fl.l_start = static_cast<off_t>(first + e + 1);
        ::fcntl(fd, F_OFD_SETLK, &fl);
      }
      ctx.count();
    }
  };
  const bool is_peer = std::find(peer_names.begin(), peer_names.end(), algo) != peer_names.end();
  run_result r;
  if (is_peer) {
    r = run_workers(opts, peer_body);
    unmap();
    cell_outcome c;
    c.ops_per_second = static_cast<double>(r.total()) / r.seconds;
    c.violations = r.violations;
    if (r.failures > 0) c.error = r.first_error;
    return c;
  }
  unmap();
  r = run_workers(opts, [&](worker_context& ctx) {
    auto m = lock::open_mutex(algo, lock_path);
    if (!m) {
      ctx.fail("open: " + m.error().message());
      return;
    }
    std::vector<lock::entity> set;
    const std::uint64_t base = contended ? 1 : 1 + 1000 * (ctx.index() + 1);
    for (std::size_t e = 0; e < entities; ++e)
      set.push_back(lock::entity(base + e));
    while (!ctx.stopping()) {
      auto g = (*m)->lock(set);
      if (!g) {
        ctx.fail("lock: " + g.error().message());
        return;
      }
      ctx.enter(true);
      ctx.leave(true);
      if (auto u = g->unlock(); !u) {
        ctx.fail("unlock: " + u.error().message());
        return;
      }
      ctx.count();
    }
  });
  (void)lock::remove_mutex_resources(algo, lock_path);
  cell_outcome c;
  c.ops_per_second = static_cast<double>(r.total()) / r.seconds;
  c.violations = r.violations;
  if (r.failures > 0) c.error = r.first_error;
  return c;
}

}  // namespace

int run_lockmatrix_command(int argc, char** argv) {
  CLI::App app{
      "keel-bench lockmatrix [OPTIONS] [ALGO...]\n"
      "For each algorithm, waiters × entities lock+unlock operations per second, in two modes:\n"
      "contended (every waiter locks the same entities, exclusively) and uncontended (each\n"
      "waiter its own entities). Waiters are processes; exclusion is verified in every cell.",
      "keel-bench lockmatrix"};
  double seconds = 1.0;
  std::string waiters_list = "1:2:3:4:5:6:7:8";
  std::string entities_list = "1:2:3:4:5:6:7:8";
  std::string mode = "both";
  std::string dir;
  std::string json_path;
  std::vector<std::string> algos;
  const std::vector<std::string> all(lock::algorithm_names().begin(),
                                     lock::algorithm_names().end());
  std::vector<std::string> accepted = all;
  accepted.insert(accepted.end(), peer_names.begin(), peer_names.end());
  app.add_option("--seconds", seconds, "Seconds per cell")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 3600.0));
  app.add_option("--waiters", waiters_list, "Colon-separated waiter counts")->capture_default_str();
  app.add_option("--entities", entities_list, "Colon-separated entity counts")
      ->capture_default_str();
  app.add_option("--mode", mode, "contended, uncontended or both")
      ->capture_default_str()
      ->check(CLI::IsMember({"contended", "uncontended", "both"}));
  app.add_option("--dir", dir, "Directory to create the locks in (default: /dev/shm)");
  app.add_option("--json", json_path, "Also write the tables as JSON to this file");
  bool peers = false;
  app.add_flag("--peers", peers,
               "Also measure the peers: cas (a bare shared-memory spinlock) and ofd (raw fcntl "
               "OFD calls)");
  app.add_option("ALGO", algos, "Algorithms, or the peers cas and ofd (default: all algorithms)")
      ->check(CLI::IsMember(accepted));
  std::vector<std::size_t> waiters;
  std::vector<std::size_t> entities;
  try {
    app.parse(argc, argv);
    waiters = parse_count_list("--waiters", waiters_list, 4096);
    entities = parse_count_list("--entities", entities_list, 4096);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  if (algos.empty()) algos = all;
  if (peers) {
    for (const auto& p : peer_names) {
      if (std::find(algos.begin(), algos.end(), p) == algos.end()) algos.push_back(p);
    }
  }
  std::vector<std::pair<std::string, bool>> modes;
  if (mode != "uncontended") modes.emplace_back("contended", true);
  if (mode != "contended") modes.emplace_back("uncontended", false);

  auto scratch = scratch_dir::make(dir);
  if (!scratch) {
    fmt::print(stderr, "keel-bench lockmatrix: cannot make a directory: {}\n",
               scratch.error().message());
    return 1;
  }
  auto fs = io::stat_fs(scratch->path.c_str());
  nlohmann::json out;
  out["seconds"] = seconds;
  out["waiters"] = waiters;
  out["entities"] = entities;
  out["filesystem"] = fs ? std::string(fs->type_name()) : "unknown";
  out["algorithms"] = nlohmann::json::object();

  const std::size_t cells = algos.size() * modes.size() * waiters.size() * entities.size();
  std::size_t done = 0;
  const auto t0 = std::chrono::steady_clock::now();
  bool broken = false;
  for (const auto& algo : algos) {
    const std::string lock_path = scratch->path + "/" + algo;
    for (const auto& [mode_name, contended] : modes) {
      fmt::print("!{} ({})\n{:<10}", algo, mode_name, "");
      for (auto e : entities)
        fmt::print(" {:>11}", fmt::format("{} entities", e));
      fmt::print("\n");
      nlohmann::json table = nlohmann::json::array();
      for (auto w : waiters) {
        fmt::print("{:<10}", fmt::format("{} waiters", w));
        nlohmann::json row = nlohmann::json::array();
        for (auto e : entities) {
          const double elapsed =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          const double left =
              done == 0 ? cells * seconds
                        : elapsed / static_cast<double>(done) * static_cast<double>(cells - done);
          fmt::print(stderr,
                     "lockmatrix: {} {} {} waiters × {} entities (cell {}/{}, ~{:.0f} s left)\n",
                     algo, mode_name, w, e, done + 1, cells, left);
          cell_outcome c;
          try {
            c = run_cell(algo, lock_path, w, e, contended, seconds);
          } catch (const std::exception& ex) {
            fmt::print(stderr, "keel-bench lockmatrix: {}\n", ex.what());
            return 1;
          }
          ++done;
          if (!c.error.empty()) {
            fmt::print(stderr, "keel-bench lockmatrix: {}: {}\n", algo, c.error);
            return 1;
          }
          if (c.violations > 0) {
            broken = true;
            fmt::print(stderr,
                       "keel-bench lockmatrix: MUTUAL EXCLUSION BROKEN: {} ({}, {} waiters, {} "
                       "entities): {} acquisitions found another holder inside\n",
                       algo, mode_name, w, e, c.violations);
          }
          fmt::print(" {:>11.0f}", c.ops_per_second);
          std::fflush(stdout);
          row.push_back(c.ops_per_second);
        }
        fmt::print("\n");
        table.push_back(row);
      }
      fmt::print("\n");
      out["algorithms"][algo][mode_name] = table;
    }
  }
  out["exclusion_verified"] = !broken;
  if (!json_path.empty() && !write_json("lockmatrix", json_path, out)) return 1;
  return broken ? 1 : 0;
}

}  // namespace keel::tools
