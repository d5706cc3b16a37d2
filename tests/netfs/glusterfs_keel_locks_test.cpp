// `keel locks` beside a mount that no longer answers: a process with a file open on a
// GlusterFS client whose daemon is stopped. Matching every descriptor of every process by
// stat() followed the link into that mount and hung there for good; the look must end.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include "netfs/glusterfs.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

using namespace std::chrono_literals;

// The glusterfs client process that serves the mount at `mount_point` (0: none found).
pid_t client_of(const std::string& mount_point) {
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string cmdline = keel::test::slurp(e.path() / "cmdline");
    if (cmdline.find("glusterfs") == std::string::npos) continue;
    // Its arguments end with the mount point.
    const std::string tail = std::string(1, '\0') + mount_point + '\0';
    if (cmdline.size() >= tail.size() &&
        cmdline.compare(cmdline.size() - tail.size(), tail.size(), tail) == 0) {
      return static_cast<pid_t>(std::stol(name));
    }
  }
  return 0;
}

// A stopped process, continued however the test ends.
struct continued_on_exit {
  pid_t pid;
  ~continued_on_exit() { ::kill(pid, SIGCONT); }
};

// Whether `pid` has exited, waiting for it at most `bound` (polling a state, bounded).
bool exits_within(pid_t pid, std::chrono::seconds bound, int& code) {
  const auto until = std::chrono::steady_clock::now() + bound;
  do {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return true;
    }
    std::this_thread::sleep_for(10ms);
  } while (std::chrono::steady_clock::now() < until);
  return false;
}

TEST(GlusterfsKeelLocks, AMountThatNoLongerAnswersDoesNotHangTheLook) {
  const auto clients = keel::test::glusterfs();
  if (!clients.why_not.empty()) GTEST_SKIP() << clients.why_not;
  keel::test::shared_dir dir(clients);
  keel::test::temp_dir local;
  const std::string held = dir.on(1, "held");
  keel::test::signal_pipe opened, done;
  constexpr int held_fd = 50;
  const pid_t user = keel::test::fork_child([&] {
    const int fd = ::open(held.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || ::dup2(fd, held_fd) != held_fd) return 1;
    opened.notify('o');
    (void)done.wait();
    return 0;
  });
  keel::test::killed_on_failure user_guard{user};
  ASSERT_EQ(opened.wait(), 'o');
  const pid_t client = client_of(clients.b);
  if (client == 0) GTEST_SKIP() << "no glusterfs process serves " << clients.b;
  // Reaped after the client is continued (declared before it: destroyed after it), as a
  // process stuck in the stopped mount cannot be reaped before.
  keel::test::killed_on_failure stuck_guard{0}, look_guard{0};
  ASSERT_EQ(::kill(client, SIGSTOP), 0);
  continued_on_exit go_on{client};
  // The mount no longer answers once its attribute cache (a second) runs out: a stat of the
  // open file through /proc (what a look by stat does) is then stuck, in a wait no signal
  // ends while the client is stopped (it is reaped after). Started again until one has not
  // ended within two seconds (a stat from the cache takes microseconds).
  const std::string link = "/proc/" + std::to_string(user) + "/fd/" + std::to_string(held_fd);
  pid_t stuck = 0;
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (stuck == 0 && std::chrono::steady_clock::now() < until) {
    const pid_t probe = keel::test::fork_child([&] {
      struct stat st {};
      (void)::stat(link.c_str(), &st);
      return 0;
    });
    int code = 0;
    if (!exits_within(probe, 2s, code)) stuck = probe;
  }
  if (stuck == 0) GTEST_SKIP() << "the stopped client still answered from its cache";
  stuck_guard.pid = stuck;

  ASSERT_EQ(::close(::open(local.file("lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)), 0);
  const pid_t look = keel::test::start_program(KEEL_BINARY, {"locks", local.file("lock")},
                                               local.file("out"), local.file("err"));
  look_guard.pid = look;
  int code = -1;
  const bool ended = exits_within(look, 60s, code);
  EXPECT_TRUE(ended) << "keel locks hung on a descriptor of the stopped mount";
  if (ended) look_guard.pid = 0;
  EXPECT_EQ(code, 0) << keel::test::slurp(local.file("err"));
  ::kill(client, SIGCONT);
  (void)keel::test::wait_status(stuck);
  stuck_guard.pid = 0;
  done.notify('d');
  EXPECT_EQ(keel::test::wait_exit(user), 0);
  user_guard.pid = 0;
}

}  // namespace
