// keel lock [--algo NAME] [--shared] [--timeout SECONDS | --nonblock] LOCKPATH NAME... -- COMMAND
//
// Exit status: COMMAND's (128 + N if a signal N ended it); 1 with a one-line message when
// the lock could not be had (timed out, held with --nonblock, or an I/O error); 2 for usage
// errors; 126/127 when COMMAND cannot be run / is not found. The lock never leaks into
// COMMAND: keel's descriptors are close-on-exec, so killing `keel lock` releases it.

#include "lock_command.hpp"

#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "keel/lock/algorithms.hpp"

extern char** environ;

namespace keel::tools {
namespace {

volatile sig_atomic_t child_pid = 0;

extern "C" void forward_signal(int signo) {
  if (child_pid > 0) ::kill(child_pid, signo);
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
      "Exit status: COMMAND's (128+N if killed by signal N); 1 if the lock could not be had\n"
      "(timeout, --nonblock, I/O error); 2 for usage errors; 126/127 if COMMAND cannot run.");
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

  // Terminal signals reach COMMAND directly (same process group); these are passed on.
  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  sigemptyset(&sa.sa_mask);
  for (int s : {SIGTERM, SIGHUP})
    ::sigaction(s, &sa, nullptr);
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  for (int s : {SIGINT, SIGQUIT})
    ::sigaction(s, &ignore, nullptr);

  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGQUIT);
  sigaddset(&defaults, SIGTERM);
  sigaddset(&defaults, SIGHUP);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF);
  pid_t pid = 0;
  const int e = ::posix_spawnp(&pid, argv[split + 1], nullptr, &attr, argv + split + 1, environ);
  posix_spawnattr_destroy(&attr);
  if (e != 0) {
    fmt::print(stderr, "keel lock: cannot run {}: {}\n", argv[split + 1], std::strerror(e));
    return e == ENOENT ? 127 : 126;
  }
  child_pid = pid;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      fmt::print(stderr, "keel lock: waitpid: {}\n", std::strerror(errno));
      return 1;
    }
  }
  child_pid = 0;
  if (auto u = guard->unlock(); !u) {
    fmt::print(stderr, "keel lock: unlocking {}: {}\n", lock_path, u.error().message());
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace keel::tools
