#include "keel/io/file_lock.hpp"

#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "support/process.hpp"

namespace keel::io {

using namespace std::chrono_literals;
using keel::test::fork_child;
using keel::test::killed_on_failure;
using keel::test::signal_pipe;
using keel::test::temp_dir;
using keel::test::wait_exit;

namespace {

// A child that flock()s `path` whole as `kind`, says so, and holds it until told to let go
// (or until killed or stopped).
struct holder {
  pid_t pid = -1;
  signal_pipe ready;
  signal_pipe go;

  holder(const std::string& path, lock_kind kind) {
    pid = fork_child([&, path, kind] {
      auto f = open_and_lock_file(path, kind);
      if (!f) return 1;
      ready.notify();
      (void)go.wait();
      return 0;
    });
    if (ready.wait() != '!') std::abort();
  }
  int finish() {
    go.notify();
    const int code = wait_exit(pid);
    pid = -1;
    return code;
  }
  ~holder() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      (void)wait_exit(pid);
    }
  }
};

std::uint64_t inode_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) std::abort();
  return st.st_ino;
}

// Whether /proc/locks shows a waiter blocked on a FLOCK of inode `ino`.
bool someone_waits_on(std::uint64_t ino) {
  std::ifstream locks("/proc/locks");
  std::string line;
  const std::string suffix = ":" + std::to_string(ino) + " ";
  while (std::getline(locks, line)) {
    if (line.find("-> FLOCK") != std::string::npos && line.find(suffix) != std::string::npos) {
      return true;
    }
  }
  return false;
}

}  // namespace

TEST(FileLock, TwoDescriptionsInOneThreadExcludeEachOther) {
  temp_dir dir;
  const std::string path = dir.file("lock");
  auto a = open_and_lock_file(path, lock_kind::exclusive);
  ASSERT_TRUE(a) << a.error().message();
  auto b = open_and_lock_file(path, lock_kind::exclusive, deadline::zero());
  ASSERT_FALSE(b);
  EXPECT_EQ(b.error(), std::errc::operation_would_block);
  ASSERT_TRUE(unlock_file(*a));
  auto c = open_and_lock_file(path, lock_kind::exclusive, deadline::zero());
  EXPECT_TRUE(c) << c.error().message();
}

TEST(FileLock, SharedHoldersShareAndKeepAWriterOut) {
  temp_dir dir;
  const std::string path = dir.file("lock");
  holder reader(path, lock_kind::shared);
  auto mine = open_and_lock_file(path, lock_kind::shared, deadline::zero());
  ASSERT_TRUE(mine) << mine.error().message();
  auto writer = open_and_lock_file(path, lock_kind::exclusive, 20ms);
  ASSERT_FALSE(writer);
  EXPECT_EQ(writer.error(), std::errc::timed_out);
  EXPECT_EQ(reader.finish(), 0);
}

// flock(1) and Python's filelock take the same lock: a plain flock(2) on the file.
TEST(FileLock, ExcludesAndIsExcludedByAPlainFlock) {
  temp_dir dir;
  const std::string path = dir.file("lock");
  signal_pipe ready;
  signal_pipe go;
  const pid_t pid = fork_child([&] {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || ::flock(fd, LOCK_EX) != 0) return 1;
    ready.notify();
    (void)go.wait();
    return 0;
  });
  killed_on_failure guard{pid};
  ASSERT_EQ(ready.wait(), '!');
  auto held = open_and_lock_file(path, lock_kind::exclusive, deadline::zero());
  ASSERT_FALSE(held);
  EXPECT_EQ(held.error(), std::errc::operation_would_block);
  go.notify();
  guard.pid = 0;
  EXPECT_EQ(wait_exit(pid), 0);
  auto mine = open_and_lock_file(path, lock_kind::exclusive, deadline::zero());
  ASSERT_TRUE(mine) << mine.error().message();
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_NE(::flock(fd, LOCK_EX | LOCK_NB), 0);
  ::close(fd);
}

TEST(FileLock, AFiniteWaitEndsAtItsDeadlineWhileAStoppedHolderHoldsOn) {
  temp_dir dir;
  const std::string path = dir.file("lock");
  holder h(path, lock_kind::exclusive);
  ASSERT_EQ(::kill(h.pid, SIGSTOP), 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto f = open_and_lock_file(path, lock_kind::exclusive, 50ms);
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(f);
  EXPECT_EQ(f.error(), std::errc::timed_out);
  EXPECT_GE(took, 50ms);
  ASSERT_EQ(::kill(h.pid, SIGCONT), 0);
  EXPECT_EQ(h.finish(), 0);
}

TEST(FileLock, AHolderKilledLetsTheWaiterIn) {
  temp_dir dir;
  const std::string path = dir.file("lock");
  holder h(path, lock_kind::exclusive);
  std::thread killer;
  const std::uint64_t ino = inode_of(path);
  killer = std::thread([&] {
    while (!someone_waits_on(ino))
      std::this_thread::yield();
    ::kill(h.pid, SIGKILL);
  });
  auto f = open_and_lock_file(path, lock_kind::exclusive);  // for ever: the kill ends it
  killer.join();
  ASSERT_TRUE(f) << f.error().message();
  EXPECT_EQ(wait_exit(h.pid), 128 + SIGKILL);
  h.pid = -1;
}

// A waiter that was queued on a file the holder then replaced must not return holding a lock
// on the old file, which nobody else will ever lock again.
TEST(FileLock, AWaiterOnAFileReplacedMeanwhileEndsOnTheNewOne) {
  temp_dir dir;
  const std::string path = dir.file("lock");
  auto first = open_and_lock_file(path, lock_kind::exclusive);
  ASSERT_TRUE(first) << first.error().message();
  const std::uint64_t old_ino = inode_of(path);
  result<file_handle> waited = errc_error(std::errc::invalid_argument);
  std::thread waiter([&] { waited = open_and_lock_file(path, lock_kind::exclusive, 30s); });
  while (!someone_waits_on(old_ino))
    std::this_thread::yield();
  // Replace the file (as a cleanup script would), then let the old one go.
  const std::string fresh = dir.file("fresh");
  std::ofstream(fresh).put('x');
  ASSERT_EQ(::rename(fresh.c_str(), path.c_str()), 0);
  ASSERT_TRUE(unlock_file(*first));
  waiter.join();
  ASSERT_TRUE(waited) << waited.error().message();
  auto held = waited->status();
  ASSERT_TRUE(held);
  EXPECT_EQ(held->inode, inode_of(path));
  EXPECT_NE(held->inode, old_ino);
  // And it holds it: another taker is kept out of the file the path names.
  auto other = open_and_lock_file(path, lock_kind::exclusive, deadline::zero());
  ASSERT_FALSE(other);
  EXPECT_EQ(other.error(), std::errc::operation_would_block);
}

TEST(FileLock, AHandleKeptOpenIsUsedAgainUntilThePathNamesAnotherFile) {
  temp_dir dir;
  const std::string path = dir.file("lock");
  file_handle kept;
  ASSERT_TRUE(lock_file_at(kept, path, lock_kind::exclusive));
  const int fd = kept.fd();
  ASSERT_TRUE(unlock_file(kept));
  ASSERT_TRUE(lock_file_at(kept, path, lock_kind::exclusive));
  EXPECT_EQ(kept.fd(), fd);  // the same descriptor: no open(2)
  ASSERT_TRUE(unlock_file(kept));
  // Removed while unlocked: the next lock is on the file made anew at the path.
  ASSERT_EQ(::unlink(path.c_str()), 0);
  ASSERT_TRUE(lock_file_at(kept, path, lock_kind::exclusive));
  auto held = kept.status();
  ASSERT_TRUE(held);
  EXPECT_EQ(held->inode, inode_of(path));
  auto other = open_and_lock_file(path, lock_kind::exclusive, deadline::zero());
  ASSERT_FALSE(other);
  EXPECT_EQ(other.error(), std::errc::operation_would_block);
}

// A child forked while another thread waits must not keep a copy of the waiter's descriptor:
// it shares the lock the waiter gets next, which would then outlive the parent in the child.
TEST(FileLock, AChildForkedDuringAWaitKeepsNoCopyOfTheWaitersDescriptor) {
  temp_dir dir;
  const std::string path = dir.file("lock");
  auto first = open_and_lock_file(path, lock_kind::exclusive);
  ASSERT_TRUE(first) << first.error().message();
  const std::uint64_t ino = inode_of(path);
  result<file_handle> waited = errc_error(std::errc::invalid_argument);
  std::thread waiter([&] { waited = open_and_lock_file(path, lock_kind::exclusive, 30s); });
  while (!someone_waits_on(ino))
    std::this_thread::yield();
  const int held_fd = first->fd();
  const pid_t child = fork_child([&] {
    // Every descriptor on the lock file is the holder's own (inherited, not the waiter's).
    int on_it = 0;
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
      struct stat st {};
      const int fd = std::stoi(e.path().filename().string());
      if (fd != held_fd && ::fstat(fd, &st) == 0 && st.st_ino == ino) ++on_it;
    }
    return on_it;
  });
  EXPECT_EQ(wait_exit(child), 0);
  ASSERT_TRUE(unlock_file(*first));
  waiter.join();
  EXPECT_TRUE(waited) << waited.error().message();
}

// A lock taken privately is the process's own: a child forked while it is held (not only
// while it was waited for) closes its copy, and after unlock_private_file a child forked keeps
// nothing noted either (the number is free for other files, which a child must keep).
TEST(FileLock, APrivateLocksDescriptorIsClosedInEveryForkedChild) {
  temp_dir dir;
  const std::string path = dir.file("lock");
  auto held = lock_file_privately(path, lock_kind::exclusive);
  ASSERT_TRUE(held) << held.error().message();
  const std::uint64_t ino = inode_of(path);
  const int held_fd = held->fd();
  const auto copies_in_child = [&] {
    return fork_child([&] {
      int on_it = 0;
      for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
        struct stat st {};
        const int fd = std::stoi(e.path().filename().string());
        if (::fstat(fd, &st) == 0 && st.st_ino == ino) ++on_it;
      }
      return on_it;
    });
  };
  EXPECT_EQ(wait_exit(copies_in_child()), 0) << "the child kept a copy of the held lock's";
  // Kept by the parent all the same.
  auto other = open_and_lock_file(path, lock_kind::exclusive, deadline::zero());
  EXPECT_FALSE(other);
  ASSERT_TRUE(unlock_private_file(*held));
  EXPECT_FALSE(held->is_open());
  EXPECT_TRUE(open_and_lock_file(path, lock_kind::exclusive, deadline::zero()));
  // The number, reused by a file of the parent's, is the child's to keep.
  auto reused = file_handle::open(path.c_str(), open_flags::read);
  ASSERT_TRUE(reused);
  ASSERT_EQ(reused->fd(), held_fd);
  EXPECT_EQ(wait_exit(copies_in_child()), 1) << "the child lost a descriptor it inherited";
  EXPECT_EQ(unlock_private_file(*held).error(), std::errc::bad_file_descriptor);
}

TEST(FileLock, ADirectoryIsLockedThroughAReadOnlyDescriptor) {
  temp_dir dir;
  const std::string path = dir.file("d");
  ASSERT_EQ(::mkdir(path.c_str(), 0755), 0);
  auto a = open_and_lock_file(path, lock_kind::exclusive);
  ASSERT_TRUE(a) << a.error().message();
  auto b = open_and_lock_file(path, lock_kind::shared, deadline::zero());
  ASSERT_FALSE(b);
  EXPECT_EQ(b.error(), std::errc::operation_would_block);
}

TEST(FileLock, BadInputIsNamed) {
  temp_dir dir;
  auto missing = open_and_lock_file(dir.file("no/such/dir/lock"), lock_kind::exclusive);
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error(), std::errc::no_such_file_or_directory);
  file_handle closed;
  auto r = lock_file(closed, lock_kind::exclusive);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), std::errc::bad_file_descriptor);
  EXPECT_FALSE(unlock_file(closed));
}

}  // namespace keel::io
