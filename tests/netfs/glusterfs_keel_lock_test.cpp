// `keel lock FILE` (flock(1) on the file) on a real distributed filesystem: two GlusterFS
// clients. A waiter must never sleep in the kernel there (a waiter killed or signalled in
// that sleep can wedge the volume: io/byte_lock.hpp), and gets the file once it is free.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include "netfs/glusterfs.hpp"
#include "support/process.hpp"

namespace {

using namespace std::chrono_literals;

// The system call `pid` is in now (-1: running, or unknown).
long current_syscall(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/syscall");
  long nr = -1;
  if (!(f >> nr)) return -1;
  return nr;
}

TEST(GlusterfsKeelLock, AWaiterOnTheOtherClientPollsAndGetsIt) {
  const auto clients = keel::test::glusterfs();
  if (!clients.why_not.empty()) GTEST_SKIP() << clients.why_not;
  keel::test::shared_dir dir(clients);
  keel::test::signal_pipe holding, release;
  const std::string file_a = dir.on(0, "f"), file_b = dir.on(1, "f");
  const pid_t holder = keel::test::fork_child([&] {
    const int fd = ::open(file_a.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || ::flock(fd, LOCK_EX) != 0) return 1;
    holding.notify('h');
    (void)release.wait();
    return 0;
  });
  keel::test::killed_on_failure holder_guard{holder};
  ASSERT_EQ(holding.wait(), 'h');
  const pid_t waiter = keel::test::fork_child([&] {
    ::execl(KEEL_BINARY, "keel", "lock", file_b.c_str(), "--", "true", static_cast<char*>(nullptr));
    return 127;
  });
  keel::test::killed_on_failure waiter_guard{waiter};
  // Seen asleep between two asks (the poll), not inside flock(2) for the wait.
  const auto until = std::chrono::steady_clock::now() + 30s;
  bool polling = false;
  while (!polling && std::chrono::steady_clock::now() < until) {
    const long nr = current_syscall(waiter);
    polling = nr == SYS_clock_nanosleep || nr == SYS_nanosleep;
    std::this_thread::sleep_for(1ms);  // sampling a state, not waiting for an event
  }
  EXPECT_TRUE(polling) << "keel lock waited inside flock(2) on a network filesystem";
  release.notify('r');
  EXPECT_EQ(keel::test::wait_exit(holder), 0);
  holder_guard.pid = 0;
  EXPECT_EQ(keel::test::wait_exit(waiter), 0) << "the waiter did not get the file once free";
  waiter_guard.pid = 0;
}

}  // namespace
