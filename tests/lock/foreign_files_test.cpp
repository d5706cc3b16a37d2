// A FIFO (or socket, or device) at a lock path is not keel's, and is never opened: opening a
// FIFO lets a writer blocked in its open through, and locks taken on it would exclude nobody
// who uses a real lock file. Every algorithm refuses it with not_keel_file.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "keel/error.hpp"
#include "keel/lock/algorithms.hpp"
#include "support/process.hpp"

namespace keel::lock {
namespace {

using namespace std::chrono_literals;

// A child blocked opening `fifo` for writing (until a reader opens it); seen inside openat.
struct blocked_writer {
  explicit blocked_writer(const std::string& fifo)
      : pid(test::fork_child([&] {
          const int fd = ::open(fifo.c_str(), O_WRONLY | O_CLOEXEC);
          return fd < 0 ? 1 : 0;
        })) {
    const auto until = std::chrono::steady_clock::now() + 30s;
    while (!in_open() && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(1ms);  // sampling a state, bounded
  }
  [[nodiscard]] bool in_open() const {
    std::ifstream f("/proc/" + std::to_string(pid) + "/syscall");
    long nr = -1;
    return static_cast<bool>(f >> nr) && nr == SYS_openat;
  }
  pid_t pid;
  test::killed_on_failure guard{pid};
};

class ForeignFileAtTheLockPath : public ::testing::TestWithParam<std::string> {};

TEST_P(ForeignFileAtTheLockPath, AFifoIsRefusedAndNeverOpened) {
  const std::string algo = GetParam();
  test::temp_dir dir;
  std::string path = dir.file("lock"), fifo = path;
  char entity_name[17];
  std::snprintf(entity_name, sizeof entity_name, "%016llx",
                static_cast<unsigned long long>(entity(7).value));
  if (uses_directory(algo)) {
    ASSERT_EQ(::mkdir(path.c_str(), 0755), 0);
    // lock_files' breaker file; flock's file of entity 7.
    fifo = path + "/" + (algo == "lock_files" ? std::string(".keel-break") : entity_name);
  }
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  blocked_writer w(fifo);
  ASSERT_TRUE(w.in_open());
  auto m = open_mutex(algo, path);
  if (m) {
    auto g = (*m)->try_lock({entity(7)});
    ASSERT_FALSE(g) << algo << " locked an entity through a FIFO";
    EXPECT_EQ(g.error(), errc::not_keel_file) << g.error().message();
  } else {
    EXPECT_EQ(m.error(), errc::not_keel_file) << m.error().message();
  }
  EXPECT_TRUE(w.in_open()) << algo << " opened the FIFO: its writer went through";
}

// Review finding: one put there after the lock was opened, met by a new thread's own open
// of the file: atomic_append's blocked in open() for good, and the others let the writer
// through (lock_files' breaker, its inode reused, was even locked).
TEST_P(ForeignFileAtTheLockPath, AFifoPutThereLaterIsRefusedByANewThread) {
  const std::string algo = GetParam();
  test::temp_dir dir;
  const std::string path = dir.file("lock");
  char entity_name[17];
  std::snprintf(entity_name, sizeof entity_name, "%016llx",
                static_cast<unsigned long long>(entity(7).value));
  auto m = open_mutex(algo, path);
  ASSERT_TRUE(m) << m.error().message();
  std::string fifo = path;
  if (uses_directory(algo)) {
    fifo = path + "/" + (algo == "lock_files" ? std::string(".keel-break") : entity_name);
  }
  (void)::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  blocked_writer w(fifo);
  ASSERT_TRUE(w.in_open());
  bool locked = false;
  std::thread([&] { locked = static_cast<bool>((*m)->try_lock({entity(7)})); }).join();
  // sysv's lock is the semaphore set it found at open: it never opens the file again.
  if (algo != "sysv") {
    EXPECT_FALSE(locked) << algo << " locked an entity through a FIFO";
  }
  EXPECT_TRUE(w.in_open()) << algo << " opened the FIFO: its writer went through";
}

INSTANTIATE_TEST_SUITE_P(Every, ForeignFileAtTheLockPath, ::testing::ValuesIn([] {
                           std::vector<std::string> v;
                           for (const auto a : algorithm_names())
                             v.emplace_back(a);
                           return v;
                         }()),
                         [](const auto& p) { return p.param; });

}  // namespace
}  // namespace keel::lock
