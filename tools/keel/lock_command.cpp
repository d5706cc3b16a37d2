// keel lock [--algo NAME] [--shared] [--timeout SECONDS | --nonblock] LOCKPATH NAME... -- COMMAND
//
// Takes the lock, then becomes COMMAND (exec, the same process): the lock is held for exactly
// as long as COMMAND runs, and there is no wrapper whose death could leave COMMAND running
// unlocked. The descriptors the lock opened are handed to COMMAND (as flock(1) does): what is
// held through one (byte_ranges, fcntl, flock) stays held while COMMAND, or a child that
// inherited it, lives; what is held in this process's name stays held while COMMAND does.
//
// Exit status: COMMAND's (a signal ends it as it ends COMMAND); 1 with a one-line message
// when the lock could not be had (timed out, held with --nonblock, or an I/O error); 2 for
// usage errors; 126/127 when COMMAND cannot be run / is not found (the lock is let go).

#include "lock_command.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "keel/lock/algorithms.hpp"

namespace keel::tools {
namespace {

// The descriptors open in this process.
std::vector<int> open_descriptors() {
  std::vector<int> fds;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    const std::string name = e.path().filename().string();
    if (!name.empty() && name.find_first_not_of("0123456789") == std::string::npos) {
      fds.push_back(std::stoi(name));
    }
  }
  // Not the listing's own (closed by now, and perhaps the next one opened).
  std::erase_if(fds, [](int fd) { return ::fcntl(fd, F_GETFD) < 0; });
  std::ranges::sort(fds);
  return fds;
}

std::string algorithms_list() {
  std::string s;
  for (auto name : lock::algorithm_names()) {
    if (!s.empty()) s += ", ";
    s += name;
  }
  return s;
}

}  // namespace

int run_lock_command(int argc, char** argv) {
  // Everything after the first "--" is the command; CLI11 parses what comes before.
  int split = -1;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--") {
      split = i;
      break;
    }
  }
  CLI::App app{
      "keel lock [OPTIONS] LOCKPATH NAME... -- COMMAND [ARGS...]\n"
      "Run COMMAND while holding the entities NAME... of the lock at LOCKPATH.",
      "keel lock"};
  app.footer(
      "LOCKPATH is a lock file, or a directory for lock_files and flock (created if missing).\n"
      "Names are hashed into entities, so any string works.\n"
      "keel lock takes the lock, then becomes COMMAND (the same process): the lock is held\n"
      "exactly while COMMAND runs, and killing that process ends COMMAND and the lock together.\n"
      "COMMAND inherits the lock's descriptors, as with flock(1).\n"
      "Exit status: COMMAND's; 1 if the lock could not be had (timeout, --nonblock, I/O\n"
      "error); 2 for usage errors; 126/127 if COMMAND cannot run (the lock is let go).");
  std::string algo = "byte_ranges";
  bool shared = false;
  double timeout = -1;
  bool nonblock = false;
  std::string lock_path;
  std::vector<std::string> names;
  app.add_option("-a,--algo", algo, "Algorithm: " + algorithms_list())
      ->capture_default_str()
      ->check(CLI::IsMember(std::vector<std::string>(lock::algorithm_names().begin(),
                                                     lock::algorithm_names().end())));
  app.add_flag("-s,--shared", shared, "Take shared locks (default: exclusive)");
  auto* t = app.add_option("-w,--timeout", timeout, "Give up after SECONDS (fractions allowed)")
                ->check(CLI::NonNegativeNumber);
  auto* n = app.add_flag("-n,--nonblock", nonblock, "Fail at once if the lock is held");
  t->excludes(n);
  app.add_option("LOCKPATH", lock_path, "The lock file (or directory)")->required();
  app.add_option("NAME", names, "Names of the entities to lock")->required();

  const int parse_argc = split < 0 ? argc : split;
  try {
    app.parse(parse_argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  if (split < 0 || split + 1 >= argc) {
    fmt::print(stderr, "keel lock: no command given (put it after --); see keel lock --help\n");
    return 2;
  }
  if (!std::isfinite(timeout) && timeout != -1) {
    fmt::print(stderr, "keel lock: --timeout must be a finite number of seconds\n");
    return 2;
  }

  // What is open now is not the lock's: what opens from here on is, and COMMAND gets it.
  const std::vector<int> before = open_descriptors();
  auto mutex = lock::open_mutex(algo, lock_path);
  if (!mutex) {
    fmt::print(stderr, "keel lock: cannot open {} lock {}: {}\n", algo, lock_path,
               mutex.error().message());
    return 1;
  }
  std::vector<lock::entity> set;
  for (const auto& name : names)
    set.push_back(lock::entity::from_string(name, !shared));
  io::deadline d;
  if (nonblock) {
    d = io::deadline::zero();
  } else if (timeout >= 0) {
    d = std::chrono::duration<double>(timeout);
  }
  auto guard = (*mutex)->lock(set, d);
  if (!guard) {
    if (guard.error() == std::errc::operation_would_block) {
      fmt::print(stderr, "keel lock: {} is locked\n", lock_path);
    } else if (guard.error() == std::errc::timed_out) {
      fmt::print(stderr, "keel lock: timed out after {} s waiting for {}\n", timeout, lock_path);
    } else {
      fmt::print(stderr, "keel lock: cannot lock {}: {}\n", lock_path, guard.error().message());
    }
    return 1;
  }

  // The lock's descriptors kept across the exec; everything else stays as it was.
  for (const int fd : open_descriptors()) {
    if (std::ranges::binary_search(before, fd)) continue;
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC) != 0) (void)::fcntl(fd, F_SETFD, flags & ~FD_CLOEXEC);
  }
  ::execvp(argv[split + 1], argv + split + 1);
  const int e = errno;
  fmt::print(stderr, "keel lock: cannot run {}: {}\n", argv[split + 1], std::strerror(e));
  if (auto u = guard->unlock(); !u) {
    fmt::print(stderr, "keel lock: unlocking {}: {}\n", lock_path, u.error().message());
  }
  return e == ENOENT ? 127 : 126;
}

}  // namespace keel::tools
