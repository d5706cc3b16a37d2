// keel's locks on a real distributed filesystem: two GlusterFS clients (two FUSE mounts of one
// volume, each with its own caches) used by processes at once. Every algorithm whose header
// says it works on network filesystems must exclude across the clients and recover from a
// holder killed on either; the others must refuse to open, saying why.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "keel/error.hpp"
#include "keel/lock/algorithms.hpp"
#include "netfs/glusterfs.hpp"
#include "support/process.hpp"

namespace keel::lock {
namespace {

using namespace std::chrono_literals;

// What the processes of one run share, in anonymous shared memory: who is inside the
// critical section (the check of exclusion itself, on this machine), and a plain counter.
struct shared_counts {
  std::atomic<int> inside{0};
  std::atomic<int> overlaps{0};
  std::atomic<int> errors{0};
  int counter = 0;  // incremented only inside the lock, without atomics
};

shared_counts* map_counts() {
  void* p = ::mmap(nullptr, sizeof(shared_counts), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) std::abort();
  return new (p) shared_counts;
}

std::string lock_path_in(const test::shared_dir& d, int client, const std::string& algo) {
  return d.on(client, uses_directory(algo) ? "lockdir" : "lockfile");
}

class GlusterfsLocks : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    clients_ = test::glusterfs();
    if (!clients_.why_not.empty()) GTEST_SKIP() << clients_.why_not;
  }
  test::glusterfs_clients clients_;
};

// Six workers, three per client, each running its rounds one after the other in a process of
// the round's own that opens the lock, takes one entity, counts inside it and exits, as
// `keel lock` does: the names a client still has cached are then mostly of dead owners.
TEST_P(GlusterfsLocks, ExcludeAcrossTheTwoClients) {
  const std::string algo = GetParam();
  test::shared_dir dir(clients_);
  shared_counts* counts = map_counts();
  const auto fail = [&](const char* what, const std::string& path, const error& e, int code) {
    std::fprintf(stderr, "%s %s: %s\n", what, path.c_str(), e.message().c_str());
    counts->errors.fetch_add(1);
    return code;
  };
  const auto one_round = [&](const std::string& path) {
    auto m = open_mutex(algo, path);
    if (!m) return fail("open", path, m.error(), 1);
    auto g = (*m)->lock({entity(7)}, 60s);
    if (!g) return fail("lock", path, g.error(), 2);
    if (counts->inside.fetch_add(1) != 0) counts->overlaps.fetch_add(1);
    const int v = counts->counter;
    ::sched_yield();
    counts->counter = v + 1;
    counts->inside.fetch_sub(1);
    if (auto u = g->unlock(); !u) return fail("unlock", path, u.error(), 3);
    return 0;
  };
  constexpr int workers = 6;
  constexpr int rounds = 25;
  std::vector<pid_t> children;
  for (int w = 0; w < workers; ++w) {
    const std::string path = lock_path_in(dir, w % 2, algo);
    children.push_back(test::fork_child([&] {
      for (int r = 0; r < rounds; ++r) {
        const int code = test::wait_exit(test::fork_child([&] { return one_round(path); }));
        if (code != 0) return code;
      }
      return 0;
    }));
  }
  for (const pid_t c : children)
    EXPECT_EQ(test::wait_exit(c), 0);
  EXPECT_EQ(counts->overlaps.load(), 0) << "two holders at once";
  EXPECT_EQ(counts->errors.load(), 0);
  EXPECT_EQ(counts->counter, workers * rounds);
  ::munmap(counts, sizeof *counts);
  (void)remove_mutex_resources(algo, lock_path_in(dir, 0, algo));
}

// A holder on one client is SIGKILLed; a process on the other client then gets the entity.
TEST_P(GlusterfsLocks, AHolderKilledOnOneClientIsRecoveredOnTheOther) {
  const std::string algo = GetParam();
  test::shared_dir dir(clients_);
  for (int killed_on = 0; killed_on < 2; ++killed_on) {
    SCOPED_TRACE(killed_on == 0 ? "holder on client a" : "holder on client b");
    test::signal_pipe holding;
    const std::string holder_path = lock_path_in(dir, killed_on, algo);
    const pid_t holder = test::fork_child([&] {
      auto m = open_mutex(algo, holder_path);
      if (!m) return 1;
      auto g = (*m)->lock({entity(3)}, 60s);
      if (!g) return 2;
      holding.notify('h');
      for (;;)
        ::pause();
    });
    test::killed_on_failure guard{holder};
    ASSERT_EQ(holding.wait(), 'h');
    const std::string other_path = lock_path_in(dir, 1 - killed_on, algo);
    auto m = open_mutex(algo, other_path);
    ASSERT_TRUE(m) << m.error().message();
    EXPECT_EQ((*m)->try_lock({entity(3)}).error(), std::errc::operation_would_block)
        << "the live holder on the other client was not seen";
    ::kill(holder, SIGKILL);
    EXPECT_EQ(test::wait_exit(holder), 128 + SIGKILL);
    guard.pid = 0;
    auto g = (*m)->lock({entity(3)}, 60s);
    ASSERT_TRUE(g) << g.error().message();
    ASSERT_TRUE(g->unlock());
  }
  (void)remove_mutex_resources(algo, lock_path_in(dir, 0, algo));
}

// The system call `pid` is in now (-1: running, or unknown).
long current_syscall(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/syscall");
  long nr = -1;
  if (!(f >> nr)) return -1;
  return nr;
}

// Whether `pid` is seen asleep between two asks (the poll) by `until`.
bool seen_polling(pid_t pid, std::chrono::steady_clock::time_point until) {
  while (std::chrono::steady_clock::now() < until) {
    const long nr = current_syscall(pid);
    if (nr == SYS_clock_nanosleep || nr == SYS_nanosleep) return true;
    std::this_thread::sleep_for(1ms);  // sampling a state, not waiting for an event
  }
  return false;
}

// Waiters of both clients, endless and timed, while a holder on one client keeps the entity:
// each is seen polling (asleep between asks), never asleep in the filesystem's lock wait; once
// the holder lets go each gets the entity in turn. GlusterFS 10.3 wedged the volume when a
// waiter asleep in that wait was killed or woken by its deadline's signal (both clients lost
// the volume, every waiter stayed in D state): keel never sleeps there on such a filesystem.
TEST_P(GlusterfsLocks, WaitersOnBothClientsPollAndAllGetIt) {
  const std::string algo = GetParam();
  test::shared_dir dir(clients_);
  test::signal_pipe holding, release;
  const pid_t holder = test::fork_child([&] {
    auto m = open_mutex(algo, lock_path_in(dir, 0, algo));
    if (!m) return 1;
    auto g = (*m)->lock({entity(5)}, 60s);
    if (!g) return 2;
    holding.notify('h');
    (void)release.wait();
    return g->unlock() ? 0 : 3;
  });
  test::killed_on_failure holder_guard{holder};
  ASSERT_EQ(holding.wait(), 'h');
  shared_counts* counts = map_counts();
  std::vector<pid_t> waiters;
  for (int w = 0; w < 6; ++w) {
    const bool timed = w >= 4;  // two that keep timing out and asking again
    waiters.push_back(test::fork_child([&, w, timed] {
      auto m = open_mutex(algo, lock_path_in(dir, w % 2, algo));
      if (!m) return 1;
      for (;;) {
        auto g = timed ? (*m)->lock({entity(5)}, 100ms) : (*m)->lock({entity(5)});
        if (!g && g.error() == std::errc::timed_out) continue;
        if (!g) return 5;
        if (counts->inside.fetch_add(1) != 0) counts->overlaps.fetch_add(1);
        counts->inside.fetch_sub(1);
        return g->unlock() ? 0 : 6;
      }
    }));
  }
  const auto by = std::chrono::steady_clock::now() + 60s;
  for (const pid_t w : waiters)
    EXPECT_TRUE(seen_polling(w, by)) << "a waiter slept in the filesystem's lock wait";
  release.notify('r');
  EXPECT_EQ(test::wait_exit(holder), 0);
  holder_guard.pid = 0;
  for (const pid_t w : waiters)
    EXPECT_EQ(test::wait_exit(w), 0);
  EXPECT_EQ(counts->overlaps.load(), 0) << "two holders at once";
  ::munmap(counts, sizeof *counts);
  (void)remove_mutex_resources(algo, lock_path_in(dir, 0, algo));
}

INSTANTIATE_TEST_SUITE_P(NetworkSafe, GlusterfsLocks,
                         ::testing::Values("lock_files", "byte_ranges", "memory_map", "flock",
                                           "fcntl"),
                         [](const auto& param_info) { return param_info.param; });

// atomic_append (a shared O_APPEND log read back) and sysv (a semaphore of this kernel) cannot
// work across machines: they refuse to open on a filesystem other machines may share.
class GlusterfsLocalOnly : public GlusterfsLocks {};

TEST_P(GlusterfsLocalOnly, RefusesToOpenSayingWhy) {
  const std::string algo = GetParam();
  test::shared_dir dir(clients_);
  const std::string path = lock_path_in(dir, 0, algo);
  auto m = open_mutex(algo, path);
  ASSERT_FALSE(m) << algo << " opened on GlusterFS";
  EXPECT_EQ(m.error(), keel::errc::needs_local_filesystem) << m.error().message();
  EXPECT_NE(m.error().message().find(path), std::string::npos) << m.error().message();
}

INSTANTIATE_TEST_SUITE_P(OneMachineOnly, GlusterfsLocalOnly,
                         ::testing::Values("atomic_append", "sysv"),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace keel::lock
