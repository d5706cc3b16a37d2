// keel-bench lockscale: how a lock scales with the number of processes contending for it, with the
// options, semantics and output of the lockscale program (see doc and --help), for the kernel
// primitives and every keel algorithm alike.

#include "lockscale_command.hpp"

#include <fmt/format.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "cli_util.hpp"
#include "keel/io/fs_info.hpp"
#include "keel/lock/algorithms.hpp"
#include "worker_pool.hpp"

namespace keel::tools {
namespace {

// lockscale's names for the kernel primitives are keel's baselines of the same names.
std::vector<std::string> accepted_algorithms() {
  return {lock::algorithm_names().begin(), lock::algorithm_names().end()};
}

// nanosleep(2) for `us` µs, made even for 0 as the original lockscale does (a system call,
// and the timer slack's wait): the same options then give the same figures for the same
// kernel lock. (std::this_thread::sleep_for skips the call for 0.) keel-bench lockmatrix measures
// the lock alone.
void sleep_us(long us) {
  timespec ts{static_cast<time_t>(us / 1'000'000), static_cast<long>(us % 1'000'000) * 1000};
  while (::nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

void hold_for(long busy_us) {
  if (busy_us >= 0) {
    sleep_us(busy_us);
  } else {
    // A real busy-wait, as lockscale does for negative values.
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(-busy_us);
    while (std::chrono::steady_clock::now() < until) {
    }
  }
}

}  // namespace

result<scratch_dir> scratch_dir::make(const std::string& parent) {
  std::string base = parent;
  if (base.empty()) {
    auto shm = io::stat_fs("/dev/shm");
    const char* tmp = std::getenv("TMPDIR");
    base = shm && shm->type == io::fs_type::tmpfs && ::access("/dev/shm", W_OK) == 0
               ? "/dev/shm"
               : (tmp != nullptr ? tmp : "/tmp");
  }
  std::string tmpl = base + "/keel-lock.XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) return last_errno_error();
  scratch_dir d;
  d.path = tmpl;
  return d;
}

scratch_dir::~scratch_dir() {
  if (!path.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
}

scratch_dir::scratch_dir(scratch_dir&& o) noexcept : path(std::move(o.path)) {
  o.path.clear();
}

int run_lockscale_command(int argc, char** argv) {
  CLI::App app{
      "keel-bench lockscale [-i IDLE_US] [-b BUSY_US] [-t SECONDS] [-w N:N:...] ALGO\n"
      "Worker processes contend for one lock: each acquires it, holds it BUSY_US, releases it,\n"
      "sleeps IDLE_US, and counts. Prints, per worker count: workers, measured duration, user\n"
      "and system CPU (s), total acquisitions, min, max, mean and standard deviation per\n"
      "worker. Mutual exclusion is verified at every acquisition.",
      "keel-bench lockscale"};
  long idle_us = 10;
  long busy_us = 1000;
  double seconds = 10;
  std::string workers_list = "10:20:50:100:200:500:1000";
  std::string algo;
  std::string dir;
  std::string json_path;
  std::string through;
  bool break_exclusion = false;
  app.add_option("-i", idle_us,
                 "Idle time after releasing, µs (nanosleep, called for 0 too, as lockscale does)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("-b", busy_us,
                 "Time holding the lock, µs (nanosleep, called for 0 too, as lockscale does; "
                 "negative: busy-wait)")
      ->capture_default_str();
  app.add_option("-t", seconds, "Seconds per worker count")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 86400.0));
  app.add_option("-w", workers_list, "Colon-separated worker counts")->capture_default_str();
  app.add_option("--dir", dir,
                 "Directory to create the lock in (default: a fresh one on /dev/shm)");
  app.add_option("--through", through,
                 "Another mount of --dir's filesystem (a second client of a network "
                 "filesystem): every second worker locks through it")
      ->check(CLI::ExistingDirectory);
  app.add_option("--json", json_path, "Also write the results as JSON to this file ('-': stdout)");
  app.add_flag("--break-exclusion", break_exclusion,
               "Skip the lock (tests that the exclusion check catches it)")
      ->group("");
  app.add_option("ALGO", algo, "flock, fcntl, sysv, or a keel algorithm")
      ->required()
      ->check(CLI::IsMember(accepted_algorithms()));
  std::vector<std::size_t> workers;
  try {
    app.parse(argc, argv);
    workers = parse_count_list("-w", workers_list, 100000);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  if (!through.empty() && dir.empty()) {
    fmt::print(stderr, "keel-bench lockscale: --through needs --dir (the other mount of it)\n");
    return 2;
  }

  auto scratch = scratch_dir::make(dir);
  if (!scratch) {
    fmt::print(stderr, "keel-bench lockscale: cannot make a directory in {}: {}\n",
               dir.empty() ? "/dev/shm" : dir, scratch.error().message());
    return 1;
  }
  const std::string lock_path = scratch->path + "/lock";
  auto fs = io::stat_fs(scratch->path.c_str());
  // The same lock seen through the other mount: the scratch directory's name under it.
  std::string other_path;
  bool other_mount = false;
  if (!through.empty()) {
    const std::string name = std::filesystem::path(scratch->path).filename().string();
    const std::string other_dir = through + "/" + name;
    if (!std::filesystem::is_directory(other_dir)) {
      fmt::print(stderr, "keel-bench lockscale: --through {}: no {} there (not a mount of {}?)\n",
                 through, name, dir);
      return 1;
    }
    other_path = other_dir + "/lock";
    // Another client only where the kernel sees another filesystem (a FUSE or NFS mount has
    // a device of its own): a symlink or a bind mount reaches the same one, with one cache.
    struct stat here {
    }, there{};
    other_mount = ::stat(scratch->path.c_str(), &here) == 0 &&
                  ::stat(other_dir.c_str(), &there) == 0 && here.st_dev != there.st_dev;
  }

  nlohmann::json out;
  out["algorithm"] = algo;
  out["busy_us"] = busy_us;
  out["idle_us"] = idle_us;
  out["seconds"] = seconds;
  out["filesystem"] = fs ? std::string(fs->type_name()) : "unknown";
  out["through"] = !through.empty();  // every second worker used the other path
  out["two_mounts"] = other_mount;    // and that path is another mount (another client)
  out["rows"] = nlohmann::json::array();
  const bool json_to_stdout = json_path == "-";
  if (!json_to_stdout) fmt::print("# {} {} {} {}\n", algo, busy_us, idle_us, seconds);
  std::fflush(stdout);

  bool broken = false;
  for (const std::size_t n : workers) {
    run_options opts;
    opts.workers = n;
    opts.duration = std::chrono::duration<double>(seconds);
    opts.progress = [&](const std::string& s) {
      fmt::print(stderr, "lockscale: {} with {} workers: {}\n", algo, n, s);
    };
    fmt::print(stderr, "lockscale: {} with {} workers: starting\n", algo, n);
    run_result r;
    try {
      r = run_workers(opts, [&](worker_context& ctx) {
        const bool other = !other_path.empty() && ctx.index() % 2 == 1;
        auto m = lock::open_mutex(algo, other ? other_path : lock_path);
        if (!m) {
          ctx.fail("open: " + m.error().message());
          return;
        }
        const lock::entity e(1);
        while (!ctx.stopping()) {
          lock::entities_guard g;
          if (!break_exclusion) {
            auto got = (*m)->lock({e});
            if (!got) {
              ctx.fail("lock: " + got.error().message());
              return;
            }
            g = std::move(*got);
          }
          ctx.enter(true);
          hold_for(busy_us);
          ctx.leave(true);
          if (auto u = g.unlock(); !u) {
            ctx.fail("unlock: " + u.error().message());
            return;
          }
          ctx.count();
          sleep_us(idle_us);
        }
      });
    } catch (const std::exception& e) {
      fmt::print(stderr, "keel-bench lockscale: {}\n", e.what());
      return 1;
    }
    // Workers killed while holding a lock leave what a crash leaves: clear it for the next run.
    (void)lock::remove_mutex_resources(algo, lock_path);
    if (r.failures > 0) {
      fmt::print(stderr, "keel-bench lockscale: {} worker(s) failed; first: {}\n", r.failures,
                 r.first_error);
      return 1;
    }
    if (r.violations > 0) {
      broken = true;
      fmt::print(
          stderr,
          "keel-bench lockscale: MUTUAL EXCLUSION BROKEN: {} acquisitions found another holder "
          "inside ({} with {} workers)\n",
          r.violations, algo, n);
    }
    if (!json_to_stdout) {
      fmt::print("{} {:.3e} {:.3e} {:.3e} {} {} {} {:.1f} {:.1f}\n", n, r.seconds, r.user_cpu,
                 r.system_cpu, r.total(), r.min(), r.max(), r.mean(), r.stddev());
      std::fflush(stdout);
    }
    const double ideal = busy_us > 0   ? 1e6 * r.seconds / static_cast<double>(busy_us)
                         : busy_us < 0 ? 1e6 * r.seconds / static_cast<double>(-busy_us)
                                       : 0.0;
    out["rows"].push_back({{"workers", n},
                           {"seconds", r.seconds},
                           {"user_cpu", r.user_cpu},
                           {"system_cpu", r.system_cpu},
                           {"total", r.total()},
                           {"min", r.min()},
                           {"max", r.max()},
                           {"mean", r.mean()},
                           {"stddev", r.stddev()},
                           {"ideal", ideal},
                           {"violations", r.violations}});
  }
  out["exclusion_verified"] = !broken;
  if (!json_path.empty() && !write_json("lockscale", json_path, out)) return 1;
  return broken ? 1 : 0;
}

}  // namespace keel::tools
