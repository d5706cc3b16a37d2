// keel lock [OPTIONS] LOCKPATH [NAME...] (-- COMMAND [ARGS...] | -c COMMAND)
// keel lock [OPTIONS] FD
//
// Takes the lock, then becomes COMMAND (exec, the same process): the lock is held for exactly
// as long as COMMAND runs, and there is no wrapper whose death could leave COMMAND running
// unlocked. The descriptors the lock opened are handed to COMMAND (as flock(1) does): what is
// held through one (every algorithm but lock_files and sysv) stays held while COMMAND, or a
// child that inherited it, lives; what is held in this process's name stays held while
// COMMAND does.
//
// With no NAME it is flock(1) on LOCKPATH itself (flock(2) on the whole file), so it excludes,
// and is excluded by, flock(1), Python's filelock and portalocker on the same file. With a
// descriptor number and no command it is flock(1)'s descriptor form: the open file behind FD
// (the shell's) is flock()ed, and stays locked after keel lock exits, until the shell closes
// it.
//
// Exit status: COMMAND's; the conflict code (1, or -E's) when the lock is held (--nonblock) or
// the timeout passed; 2 for usage errors; 66 when LOCKPATH cannot be opened or the lock set
// up, 73 when it cannot be made (read-only or full), 71 for other system errors; 126/127 when
// COMMAND cannot be run / is not found (the lock is let go).

#include "lock_command.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "keel/io/file_lock.hpp"
#include "keel/io/fs_info.hpp"
#include "keel/lock/algorithms.hpp"

namespace keel::tools {
namespace {

// sysexits(3), as flock(1) uses them.
constexpr int exit_usage = 2;
constexpr int exit_no_input = 66;
constexpr int exit_os_error = 71;
constexpr int exit_cannot_create = 73;

// The descriptors open in this process: from /proc/self/fd, or, where there is no /proc (a
// chroot, a bare container), by asking each number up to the descriptor limit.
std::vector<int> open_descriptors() {
  std::vector<int> fds;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    const std::string name = e.path().filename().string();
    if (!name.empty() && name.find_first_not_of("0123456789") == std::string::npos) {
      fds.push_back(std::stoi(name));
    }
  }
  if (ec || fds.empty()) {
    fds.clear();
    rlimit r{};
    const rlim_t most = ::getrlimit(RLIMIT_NOFILE, &r) == 0 ? r.rlim_cur : 1024;
    for (int fd = 0; static_cast<rlim_t>(fd) < std::min<rlim_t>(most, 1 << 20); ++fd)
      if (::fcntl(fd, F_GETFD) >= 0) fds.push_back(fd);
  }
  // Not the listing's own (closed by now, and perhaps the next one opened).
  std::erase_if(fds, [](int fd) { return ::fcntl(fd, F_GETFD) < 0; });
  std::ranges::sort(fds);
  return fds;
}

// What the command is given as stdin, stdout and stderr stays what it was: while the lock is
// opened, a closed one of them is held by /dev/null, close-on-exec (so that no lock file is
// opened there, where the command would read or write it as its own).
void hold_standard_descriptors() {
  for (int fd = 0; fd < 3; ++fd) {
    if (::fcntl(fd, F_GETFD) >= 0) continue;
    const int n = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    if (n >= 0 && n != fd) {
      (void)::dup3(n, fd, O_CLOEXEC);
      ::close(n);
    }
  }
}

// A message's user-given part, cut short.
std::string shown(std::string_view s) {
  constexpr std::size_t most = 80;
  return s.size() <= most ? std::string(s) : std::string(s.substr(0, most)) + "...";
}

std::string algorithms_list() {
  std::string s;
  for (auto name : lock::algorithm_names()) {
    if (!s.empty()) s += ", ";
    s += name;
  }
  return s;
}

// The exit status for a lock that could not be opened or set up, by its errno.
int setup_failure(const std::error_code& e) {
  if (e == std::errc::read_only_file_system || e == std::errc::no_space_on_device ||
      e == std::error_code(EDQUOT, std::system_category())) {
    return exit_cannot_create;
  }
  if (e == std::errc::not_enough_memory || e == std::errc::too_many_files_open ||
      e == std::errc::too_many_files_open_in_system) {
    return exit_os_error;
  }
  return exit_no_input;
}

// `timeout` seconds (< 0: for ever; 0: not at all) as a deadline.
io::deadline deadline_of(double timeout) {
  if (timeout == 0) return io::deadline::zero();
  if (timeout > 0) return std::chrono::duration<double>(timeout);
  return io::deadline::never();
}

// flock(2) on `fd`, waiting at most `timeout` seconds (< 0: for ever; 0: not at all), as
// io::lock_file waits. 0, or the errno (EWOULDBLOCK: held until the deadline).
int flock_within(int fd, bool shared, double timeout) {
  const io::deadline d = deadline_of(timeout);
  io::file_handle borrowed(fd);  // for the call: the descriptor stays the caller's
  auto locked =
      io::lock_file(borrowed, shared ? io::lock_kind::shared : io::lock_kind::exclusive, d);
  (void)borrowed.release();
  if (locked) return 0;
  if (locked.error() == std::errc::timed_out) return EWOULDBLOCK;
  return locked.error().code().value();
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
      "keel lock [OPTIONS] LOCKPATH [NAME...] -- COMMAND [ARGS...]\n"
      "keel lock [OPTIONS] LOCKPATH [NAME...] -c 'COMMAND STRING'\n"
      "keel lock [OPTIONS] FD\n"
      "Run COMMAND while holding the entities NAME... of the lock at LOCKPATH; with no NAME,\n"
      "while holding flock(2) on LOCKPATH itself, as flock(1) does.",
      "keel lock"};
  app.footer(
      "LOCKPATH is a lock file, or a directory for lock_files and flock (created if missing).\n"
      "Names are hashed into entities, so any string works. With no NAME, LOCKPATH is a file\n"
      "locked whole with flock(2): keel lock then excludes, and is excluded by, flock(1),\n"
      "Python's filelock and portalocker on that file. FD alone (no command): the shell's\n"
      "descriptor FD is flock()ed and stays locked after keel lock exits, as `flock FD`.\n"
      "keel lock takes the lock, then becomes COMMAND (the same process): the lock is held\n"
      "exactly while COMMAND runs, and killing that process ends COMMAND and the lock together\n"
      "(flock(1) instead runs COMMAND as a child; -o/--close has no counterpart here).\n"
      "COMMAND inherits the lock's descriptors, as with flock(1). On a filesystem that is not\n"
      "local (network, cluster, FUSE) a wait asks again and again instead of sleeping in the\n"
      "kernel, whatever the algorithm (see the README: a waiter killed there can wedge "
      "GlusterFS).\n"
      "Exit status: COMMAND's; 1 (or -E's code) if the lock is held (--nonblock) or the\n"
      "timeout passed; 2 for usage errors; 66 if LOCKPATH cannot be opened or the lock set up,\n"
      "73 if it cannot be made (read-only, full), 71 for other system errors; 126/127 if\n"
      "COMMAND cannot run (the lock is let go).");
  hold_standard_descriptors();
  std::string algo = "byte_ranges";
  bool shared = false;
  std::string timeout_text;
  double timeout = -1;
  bool nonblock = false;
  int conflict_code = 1;
  std::string command_string;
  std::string lock_path;
  std::vector<std::string> names;
  auto* a = app.add_option("-a,--algo", algo, "Algorithm: " + algorithms_list())
                ->capture_default_str()
                ->check(CLI::IsMember(std::vector<std::string>(lock::algorithm_names().begin(),
                                                               lock::algorithm_names().end())));
  app.add_flag("-s,--shared", shared, "Take shared locks (default: exclusive)");
  auto* t =
      app.add_option("-w,--timeout", timeout_text, "Give up after SECONDS (fractions allowed)");
  auto* n = app.add_flag("-n,--nonblock", nonblock, "Fail at once if the lock is held");
  t->excludes(n);
  app.add_option("-E,--conflict-exit-code", conflict_code,
                 "Exit status when the lock is held or the timeout passed (default 1)");
  app.add_option("-c,--command", command_string, "Run COMMAND STRING with /bin/sh -c");
  app.add_option("LOCKPATH", lock_path, "The lock file (or directory), or a descriptor number")
      ->required();
  app.add_option("NAME", names, "Names of the entities to lock (none: flock(2) on LOCKPATH)");

  const int parse_argc = split < 0 ? argc : split;
  try {
    app.parse(parse_argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "keel lock: {}; see keel lock --help\n", shown(e.what()));
    return exit_usage;
  }
  const auto usage = [](std::string_view why) {
    fmt::print(stderr, "keel lock: {}; see keel lock --help\n", why);
    return exit_usage;
  };
  if (t->count() != 0) {
    char* end = nullptr;
    timeout = std::strtod(timeout_text.c_str(), &end);
    if (timeout_text.empty() || end == nullptr || *end != '\0' || !std::isfinite(timeout) ||
        timeout < 0 || timeout > 1e9) {
      return usage("--timeout takes a number of seconds from 0 to 1e9");
    }
  }
  if (conflict_code < 0 || conflict_code > 255) {
    return usage("--conflict-exit-code takes a status from 0 to 255");
  }
  const bool has_command = split >= 0 && split + 1 < argc;
  if (split >= 0 && !has_command) return usage("no command after --");
  if (has_command && !command_string.empty()) return usage("give COMMAND after -- or -c, not both");
  if (names.empty() && a->count() != 0) {
    return usage("--algo needs NAME...: with no NAME, keel lock is flock(1) on LOCKPATH");
  }
  const bool whole_file = names.empty();
  // A number with no command (with one, it is a file of that name, as for flock(1)).
  const bool descriptor = whole_file && !has_command && command_string.empty() &&
                          !lock_path.empty() && lock_path.size() <= 9 &&
                          lock_path.find_first_not_of("0123456789") == std::string::npos;
  if (!has_command && command_string.empty() && !descriptor) {
    return usage("no command given (put it after --, or use -c)");
  }
  if (descriptor && (has_command || !command_string.empty())) {
    return usage("a descriptor number takes no command (it stays locked for the shell)");
  }
  const double wait = nonblock ? 0 : timeout;

  const auto conflict = [&](std::string_view what) {
    if (wait == 0) {
      fmt::print(stderr, "keel lock: {} is locked\n", what);
    } else {
      fmt::print(stderr, "keel lock: timed out after {} s waiting for {}\n", timeout, what);
    }
    return conflict_code;
  };

  if (descriptor) {
    const int fd = std::stoi(lock_path);
    if (::fcntl(fd, F_GETFD) < 0) {
      fmt::print(stderr, "keel lock: descriptor {} is not open: {}\n", fd, std::strerror(errno));
      return exit_no_input;
    }
    const int e = flock_within(fd, shared, wait);
    if (e == EWOULDBLOCK) return conflict(fmt::format("descriptor {}", fd));
    if (e != 0) {
      fmt::print(stderr, "keel lock: cannot lock descriptor {}: {}\n", fd, std::strerror(e));
      return exit_os_error;
    }
    return 0;
  }

  // What is open now is not the lock's: what opens from here on is, and COMMAND gets it.
  const std::vector<int> before = open_descriptors();
  std::unique_ptr<lock::shared_fs_mutex> mutex;
  std::optional<lock::entities_guard> guard;
  if (whole_file) {
    // As flock(1): made if missing, opened for reading where it cannot be for writing.
    int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_NOCTTY | O_CLOEXEC, 0666);
    int why = errno;
    if (fd < 0 && (why == EISDIR || why == EACCES || why == EROFS)) {
      fd = ::open(lock_path.c_str(), O_RDONLY | O_NOCTTY | O_CLOEXEC);
      if (fd < 0 && errno != ENOENT) why = errno;  // (missing: why it could not be made)
    }
    if (fd < 0) {
      fmt::print(stderr, "keel lock: cannot open {}: {}\n", lock_path, std::strerror(why));
      return setup_failure(std::error_code(why, std::system_category()));
    }
    const int e = flock_within(fd, shared, wait);
    if (e == EWOULDBLOCK) return conflict(lock_path);
    if (e != 0) {
      fmt::print(stderr, "keel lock: cannot lock {}: {}\n", lock_path, std::strerror(e));
      return exit_os_error;
    }
  } else {
    auto opened = lock::open_mutex(algo, lock_path);
    if (!opened) {
      fmt::print(stderr, "keel lock: cannot open {} lock {}: {}\n", algo, lock_path,
                 opened.error().message());
      return setup_failure(opened.error().code());
    }
    mutex = std::move(*opened);
    std::vector<lock::entity> set;
    for (const auto& name : names)
      set.push_back(lock::entity::from_string(name, !shared));
    auto got = mutex->lock(set, deadline_of(wait));
    if (!got) {
      if (got.error() == std::errc::operation_would_block || got.error() == std::errc::timed_out) {
        return conflict(lock_path);
      }
      fmt::print(stderr, "keel lock: cannot lock {}: {}\n", lock_path, got.error().message());
      return exit_os_error;
    }
    guard = std::move(*got);
  }

  // The lock's descriptors kept across the exec; everything else stays as it was.
  for (const int fd : open_descriptors()) {
    if (std::ranges::binary_search(before, fd)) continue;
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC) != 0) (void)::fcntl(fd, F_SETFD, flags & ~FD_CLOEXEC);
  }
  const char* shell_argv[] = {"/bin/sh", "-c", command_string.c_str(), nullptr};
  char* const* command =
      command_string.empty() ? argv + split + 1 : const_cast<char* const*>(shell_argv);
  ::execvp(command[0], command);
  const int e = errno;
  fmt::print(stderr, "keel lock: cannot run {}: {}\n", command[0], std::strerror(e));
  if (guard) {
    if (auto u = guard->unlock(); !u) {
      fmt::print(stderr, "keel lock: unlocking {}: {}\n", lock_path, u.error().message());
    }
  }
  return e == ENOENT ? 127 : 126;
}

}  // namespace keel::tools
