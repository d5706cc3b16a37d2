// keel-bench lockcli: what running a command under `keel lock` costs a shell user, beside
// flock(1) doing the same, in one run. Each round starts `flock -n FILE true`, `keel lock -n
// FILE -- true`, `keel --version` (keel's start-up alone) and `true` (the floor: what any
// program costs to start here) one after the other, so a busy moment costs each the same.
// Medians per program, and keel lock's against flock's.

#include "lockcli_command.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <expected>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_util.hpp"
#include "lockscale_command.hpp"

extern char** environ;

namespace keel::tools {
namespace {

struct program {
  std::string id;     // the JSON name
  std::string label;  // the table's
  std::vector<std::string> argv;
  std::vector<double> us;  // one run each
};

// Runs argv to its end with stdout and stderr on /dev/null; the wall time in µs, or an error
// saying why it did not run or did not exit 0.
std::expected<double, std::string> time_one(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const auto& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = 0;
  const int e = ::posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (e != 0) return std::unexpected(fmt::format("{}: {}", argv[0], std::strerror(e)));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return std::unexpected(fmt::format("waitpid: {}", std::strerror(errno)));
  }
  const auto end = std::chrono::steady_clock::now();
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return std::unexpected(
        fmt::format("{} exited with status {}", fmt::join(argv, " "),
                    WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status)));
  }
  return std::chrono::duration<double, std::micro>(end - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::string beside_self(const char* name) {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : (self.parent_path() / name).string();
}

}  // namespace

int run_lockcli_command(int argc, char** argv) {
  CLI::App app{
      "keel-bench lockcli [--runs N] [--keel PATH] [--flock PATH] [--dir D] [--json F]\n"
      "Starts `flock -n FILE true`, `keel lock -n FILE -- true`, `keel --version` and `true`\n"
      "in turn, N rounds, and prints each one's median wall time per run and keel lock's\n"
      "against flock's (the target: at most 1.5x).",
      "keel-bench lockcli"};
  int runs = 200;
  std::string keel = beside_self("keel");
  std::string flock = "/usr/bin/flock";
  std::string dir;
  std::string json_path;
  app.add_option("--runs", runs, "Rounds (each program runs once a round)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  app.add_option("--keel", keel, "The keel program (default: the one beside keel-bench)")
      ->capture_default_str();
  app.add_option("--flock", flock, "flock(1)")->capture_default_str();
  app.add_option("--dir", dir, "Directory for the lock file (default: a fresh one on /dev/shm)");
  app.add_option("--json", json_path, "Also write the results as JSON to this file ('-': stdout)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  // A name without a slash is looked up in PATH when it runs (posix_spawnp), as a shell does.
  for (const std::string* p : {&keel, &flock}) {
    if (p->empty() || (p->find('/') != std::string::npos && ::access(p->c_str(), X_OK) != 0)) {
      fmt::print(stderr, "keel-bench lockcli: {}: {}\n", p->empty() ? "keel" : *p,
                 std::strerror(p->empty() ? ENOENT : errno));
      return 2;
    }
  }
  // Where the JSON goes is checked before the run, not after it.
  if (!json_path.empty() && json_path != "-") {
    const auto parent = std::filesystem::path(json_path).parent_path();
    const std::string where = parent.empty() ? "." : parent.string();
    if (::access(where.c_str(), W_OK) != 0) {
      fmt::print(stderr, "keel-bench lockcli: --json {}: {}: {}\n", json_path, where,
                 std::strerror(errno));
      return 2;
    }
  }
  auto scratch = scratch_dir::make(dir);
  if (!scratch) {
    fmt::print(stderr, "keel-bench lockcli: cannot make a directory in {}: {}\n",
               dir.empty() ? "/dev/shm" : dir, scratch.error().message());
    return 1;
  }
  // With the JSON on stdout, the table goes to stderr.
  std::FILE* const table = json_path == "-" ? stderr : stdout;
  const std::string file = scratch->path + "/lock";
  std::vector<program> programs{
      {"flock", "flock -n FILE true", {flock, "-n", file, "/bin/true"}, {}},
      {"keel_lock", "keel lock -n FILE -- true", {keel, "lock", "-n", file, "--", "/bin/true"}, {}},
      {"keel_version", "keel --version", {keel, "--version"}, {}},
      {"true", "true", {"/bin/true"}, {}},
  };
  for (int r = 0; r < runs; ++r) {
    for (auto& p : programs) {
      auto t = time_one(p.argv);
      if (!t) {
        fmt::print(stderr, "keel-bench lockcli: {}\n", t.error());
        return 1;
      }
      p.us.push_back(*t);
    }
  }
  nlohmann::json doc{{"runs", runs}, {"keel", keel}, {"flock", flock}};
  fmt::print(table, "{:<34} {:>12} {:>12}\n", "program", "median µs", "mean µs");
  for (const auto& p : programs) {
    const double med = median(p.us);
    double sum = 0;
    for (double v : p.us)
      sum += v;
    fmt::print(table, "{:<34} {:>12.0f} {:>12.0f}\n", p.label, med,
               sum / static_cast<double>(p.us.size()));
    doc["median_us"][p.id] = med;
    doc["mean_us"][p.id] = sum / static_cast<double>(p.us.size());
  }
  const double ratio =
      doc["median_us"]["keel_lock"].get<double>() / doc["median_us"]["flock"].get<double>();
  doc["keel_lock_vs_flock"] = ratio;
  fmt::print(table,
             "keel lock -n FILE -- true costs {:.2f}x flock -n FILE true (target: at most 1.5x)\n",
             ratio);
  if (!json_path.empty() && !write_json("lockcli", json_path, doc)) return 1;
  return 0;
}

}  // namespace keel::tools
