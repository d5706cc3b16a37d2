#pragma once
// Helpers for tests that need real processes: a private temporary directory, forked children
// with a pipe to talk to them, and their exit status.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>

namespace keel::test {

//! A fresh directory under $TMPDIR (or /tmp), removed with its content on destruction.
class temp_dir {
 public:
  explicit temp_dir(const char* base = nullptr) {
    std::string tmpl = base != nullptr                    ? base
                       : std::getenv("TMPDIR") != nullptr ? std::getenv("TMPDIR")
                                                          : "/tmp";
    tmpl += "/keel-test.XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    path_ = tmpl;
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  [[nodiscard]] std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

//! A one-way pipe for "I'm ready" / "go on" between a parent and a forked child.
class signal_pipe {
 public:
  signal_pipe() {
    if (::pipe2(fds_, O_CLOEXEC) != 0) std::abort();
  }
  signal_pipe(const signal_pipe&) = delete;
  signal_pipe& operator=(const signal_pipe&) = delete;
  ~signal_pipe() {
    ::close(fds_[0]);
    ::close(fds_[1]);
  }
  void notify(char c = '!') const {
    if (::write(fds_[1], &c, 1) != 1) std::abort();
  }
  //! Whether a byte (or the end of the pipe) arrives within `timeout`; does not consume it.
  [[nodiscard]] bool ready_within(std::chrono::milliseconds timeout) const {
    pollfd p{fds_[0], POLLIN, 0};
    for (;;) {
      const int n = ::poll(&p, 1, static_cast<int>(timeout.count()));
      if (n >= 0) return n == 1;
      if (errno != EINTR) std::abort();
    }
  }
  //! Waits for one byte; returns it, or 0 when the writer closed the pipe (e.g. was killed).
  [[nodiscard]] char wait() const {
    char c = 0;
    for (;;) {
      const ssize_t n = ::read(fds_[0], &c, 1);
      if (n == 1) return c;
      if (n == 0) return 0;
      if (errno != EINTR) std::abort();
    }
  }

 private:
  int fds_[2] = {-1, -1};
};

//! Runs `body` in a forked child, which exits with the int it returns (or is killed).
template <class F>
pid_t fork_child(F&& body) {
  const pid_t pid = ::fork();
  if (pid < 0) std::abort();
  if (pid == 0) {
    int code = 99;
    code = std::forward<F>(body)();
    ::_exit(code);
  }
  return pid;
}

//! The raw wait status of `pid`.
inline int wait_status(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) std::abort();
  }
  return status;
}

//! A child killed (SIGKILL) and waited for unless the test lets it go (pid 0): a failed
//! assertion must not leave it stopped or running on (the test run would wait for it).
struct killed_on_failure {
  pid_t pid;
  ~killed_on_failure() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      (void)wait_status(pid);
    }
  }
};

//! The exit code of `pid`, or 128 + signal if it was killed.
inline int wait_exit(pid_t pid) {
  const int status = wait_status(pid);
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

//! A process that need not be our child (a grandchild, say), held by a pidfd opened while it
//! is known to live, so that a pid reused after it is gone is never taken for it.
class watched_process {
 public:
  watched_process() = default;
  //! `pid` must be alive (or a zombie) now.
  explicit watched_process(pid_t pid) : fd_(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0))) {
    if (fd_ < 0) std::abort();  // Linux >= 5.3: every kernel keel supports has pidfd_open
  }
  watched_process(watched_process&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  watched_process& operator=(watched_process&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  ~watched_process() {
    if (fd_ >= 0) ::close(fd_);
  }
  //! Kills it and returns once it has exited, so that the files it held, and the locks on
  //! them, are closed: kill(2) returns before that happens; a pidfd is readable once it has.
  void kill_and_await_exit() const {
    if (fd_ < 0) return;
    (void)::syscall(SYS_pidfd_send_signal, fd_, SIGKILL, nullptr, 0);  // ESRCH: gone already
    pollfd p{fd_, POLLIN, 0};
    while (::poll(&p, 1, -1) < 0) {
      if (errno != EINTR) std::abort();
    }
  }

 private:
  int fd_ = -1;
};

}  // namespace keel::test

#include <sched.h>
#include <sys/mount.h>

namespace keel::test {

//! Exit code of a child that could not set up what a test needs (reported as a skip).
constexpr int cannot_set_up = 77;

//! In a forked child only: mounts a private tmpfs of `bytes` on `dir`, in a mount namespace
//! of the child's own, so it vanishes with the child and nothing outside ever sees it.
//! Returns false where the kernel or privileges do not allow it.
inline bool mount_private_tmpfs(const std::string& dir, std::size_t bytes) {
  if (::unshare(CLONE_NEWNS) != 0) return false;
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return false;
  const std::string options = "size=" + std::to_string(bytes);
  return ::mount("tmpfs", dir.c_str(), "tmpfs", 0, options.c_str()) == 0;
}

//! In a child: a mount namespace of its own, then a `type` filesystem (mkfs.`type`) of
//! `bytes` made on an image file at `image` and mounted on `dir` through a loop device (the
//! device goes with the namespace). Empty, or why not (no root, no mkfs, no loop devices).
inline std::string mount_private_loop(const std::string& type, const std::string& image,
                                      const std::string& dir, std::size_t bytes) {
  if (::unshare(CLONE_NEWNS) != 0 ||
      ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    return "no private mount namespace (needs root)";
  }
  const int fd = ::open(image.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0600);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) return "cannot make " + image;
  ::close(fd);
  // ext2/3/4's mke2fs forces with -F; btrfs and xfs with -f.
  const std::string force = type.starts_with("ext") ? " -F" : " -f";
  const std::string mkfs = "mkfs." + type + " -q" + force + " '" + image + "' >/dev/null 2>&1";
  if (std::system(mkfs.c_str()) != 0) return "mkfs." + type + " failed (not installed?)";
  const std::string mount = "mount -o loop '" + image + "' '" + dir + "' >/dev/null 2>&1";
  if (std::system(mount.c_str()) != 0) return "cannot mount a loop device here";
  ::unlink(image.c_str());
  return "";
}

}  // namespace keel::test
