#pragma once
// The harness's processes: a child that cannot hang for ever, and a bounded wait for it.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

namespace keel::torture::detail {

//! Runs `body` in a forked child, in a process group of its own (which dies of SIGALRM after
//! two minutes).
template <class F>
pid_t spawn(F&& body) {
  std::fflush(nullptr);  // or the child would print the parent's buffered output again
  const pid_t pid = ::fork();
  if (pid == 0) {
    // A group of its own: the processes it forks (which no alarm covers) go with it when
    // it is killed for hanging.
    (void)::setpgid(0, 0);
    ::alarm(120);  // a child that hangs dies of SIGALRM: the parent reports it
    const int code = body();
    std::fflush(nullptr);
    ::_exit(code);
  }
  return pid;
}

struct exit_status {
  bool timed_out = false;
  bool exited = false;
  int code = 0;
  int signal = 0;
  [[nodiscard]] bool clean() const noexcept { return exited && code == 0; }
  [[nodiscard]] std::string describe() const {
    if (timed_out) return "hung (killed after its time limit)";
    if (exited) return "exited " + std::to_string(code);
    return std::string("died of ") + ::strsignal(signal);
  }
};

// Waits until `ready()` holds, `pid` has ended (left for wait_for to reap) or `limit` has
// passed; says whether `ready()` held. A cycle's kill waits for its victim to be at work so,
// the start of a process being slow under a sanitizer or a busy machine, the kill still lands
// where the cycle meant it to.
template <class Ready>
bool wait_until(pid_t pid, Ready&& ready, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!ready()) {
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
        info.si_pid == pid)
      return ready();
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

// Waits for `pid` at most `limit`; past it, kills it and its group.
inline exit_status wait_for(pid_t pid, std::chrono::milliseconds limit) {
  exit_status s;
  const auto until = std::chrono::steady_clock::now() + limit;
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) return s;
    if (std::chrono::steady_clock::now() >= until) {
      s.timed_out = true;
      ::kill(-pid, SIGKILL);  // its group: a child it forked may be what hangs
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (WIFEXITED(status)) {
    s.exited = true;
    s.code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    s.signal = WTERMSIG(status);
  }
  return s;
}

}  // namespace keel::torture::detail
