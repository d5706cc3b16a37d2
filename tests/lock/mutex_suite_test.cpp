// The correctness suite every shared_fs_mutex runs: one list (algorithm_names()) drives it,
// so an algorithm cannot be added without being tested. Concurrency claims are tested with
// forked processes and SIGKILL, and again with threads.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "keel/io/file_handle.hpp"
#include "keel/lock/algorithms.hpp"
#include "support/process.hpp"

namespace keel::lock {
namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;
using test::fork_child;
using test::signal_pipe;
using test::temp_dir;
using test::wait_exit;

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

class MutexSuite : public ::testing::TestWithParam<std::string_view> {
 protected:
  void TearDown() override { (void)remove_mutex_resources(algo(), lock_path()); }

  [[nodiscard]] std::string algo() const { return std::string(GetParam()); }
  [[nodiscard]] std::string lock_path() const { return dir_.file("lock"); }
  [[nodiscard]] bool shared_is_exclusive() const { return algo() == "lock_files"; }

  [[nodiscard]] std::unique_ptr<shared_fs_mutex> open() const {
    auto m = open_mutex(algo(), lock_path());
    if (!m) {
      ADD_FAILURE() << "open_mutex(" << algo() << "): " << m.error().message();
      std::abort();
    }
    return std::move(*m);
  }

  // A counter file the critical sections increment with a read, a yield and a write: any
  // break of exclusion loses updates.
  [[nodiscard]] io::file_handle counter_file() const {
    auto f = io::file_handle::open(dir_.file("counters").c_str(),
                                   io::open_flags::read_write | io::open_flags::create);
    if (!f) std::abort();
    return std::move(*f);
  }
  static void increment(const io::file_handle& f, std::size_t slot) {
    std::uint64_t v = 0;
    const auto at = static_cast<off_t>(slot * sizeof v);
    (void)f.read_at(at, std::as_writable_bytes(std::span(&v, 1)));
    std::this_thread::yield();
    ++v;
    if (!f.write_at(at, std::as_bytes(std::span(&v, 1)))) std::abort();
  }
  static std::uint64_t read_counter(const io::file_handle& f, std::size_t slot) {
    std::uint64_t v = 0;
    (void)f.read_at(static_cast<off_t>(slot * sizeof v), std::as_writable_bytes(std::span(&v, 1)));
    return v;
  }

  // Forks `processes` children that each add `increments` to counter 0 while holding entity 1
  // of the mutex `get()` gives them; the total must be exact.
  template <class Get>
  void count_in_children(int processes, int increments, Get get) {
    std::vector<pid_t> pids;
    for (int p = 0; p < processes; ++p) {
      pids.push_back(fork_child([&] {
        auto m = get();
        auto f = counter_file();
        for (int i = 0; i < increments; ++i) {
          auto g = m->lock({entity(1)}, 30s);
          if (!g) return 2;
          increment(f, 0);
        }
        return 0;
      }));
    }
    for (pid_t pid : pids)
      EXPECT_EQ(wait_exit(pid), 0);
    EXPECT_EQ(read_counter(counter_file(), 0),
              static_cast<std::uint64_t>(processes) * static_cast<std::uint64_t>(increments));
  }

  // A child that holds `set` until told to go (or is killed).
  pid_t hold_in_child(std::vector<entity> set, signal_pipe& ready, signal_pipe& go) const {
    const pid_t pid = fork_child([&, set] {
      auto m = open();
      auto g = m->lock(set, 10s);
      if (!g) return 1;
      ready.notify();
      (void)go.wait();
      return 0;
    });
    EXPECT_EQ(ready.wait(), '!');
    return pid;
  }

  temp_dir dir_;
};

TEST_P(MutexSuite, ProcessesCountExactly) {
  count_in_children(8, 150, [&] { return open(); });
}

// Instances opened before fork() and used in the children: descriptors inherited from the
// parent must not make the children share one lock owner.
TEST_P(MutexSuite, InstanceOpenedBeforeForkStillExcludes) {
  std::shared_ptr<shared_fs_mutex> m = open();
  {
    auto warm = m->lock({entity(1)});
    ASSERT_TRUE(warm);
  }  // per-thread state now exists
  count_in_children(4, 100, [&] { return m; });
}

TEST_P(MutexSuite, RandomMultiEntitySetsCountExactly) {
  constexpr int processes = 8;
  constexpr int rounds = 60;
  constexpr std::size_t entities = 16;
  std::vector<pid_t> pids;
  for (int p = 0; p < processes; ++p) {
    pids.push_back(fork_child([&, p] {
      auto m = open();
      auto f = counter_file();
      std::mt19937 rng(static_cast<unsigned>(p * 7919 + 1));
      std::vector<std::uint64_t> mine(entities, 0);
      for (int r = 0; r < rounds; ++r) {
        std::vector<entity> set;
        const std::size_t n = 1 + rng() % 4;
        for (std::size_t k = 0; k < n; ++k)
          set.push_back(entity(100 + rng() % entities));
        auto g = m->lock(set, 30s);
        if (!g) return 2;
        for (const entity e : g->entities()) {
          increment(f, e.value - 100);
          ++mine[e.value - 100];
        }
      }
      auto out = io::file_handle::open(dir_.file("tally." + std::to_string(p)).c_str(),
                                       io::open_flags::write | io::open_flags::create);
      if (!out || !out->write_at(0, std::as_bytes(std::span(mine)))) return 3;
      return 0;
    }));
  }
  for (pid_t pid : pids)
    EXPECT_EQ(wait_exit(pid), 0);
  std::vector<std::uint64_t> expected(entities, 0);
  for (int p = 0; p < processes; ++p) {
    auto in = io::file_handle::open(dir_.file("tally." + std::to_string(p)).c_str(),
                                    io::open_flags::read);
    ASSERT_TRUE(in);
    std::vector<std::uint64_t> t(entities);
    ASSERT_EQ(in->read_at(0, std::as_writable_bytes(std::span(t))).value(),
              entities * sizeof(std::uint64_t));
    for (std::size_t i = 0; i < entities; ++i)
      expected[i] += t[i];
  }
  auto f = counter_file();
  for (std::size_t i = 0; i < entities; ++i)
    EXPECT_EQ(read_counter(f, i), expected[i]) << i;
}

TEST_P(MutexSuite, SharedHoldersCoexistExclusiveExcludes) {
  signal_pipe ready, go;
  const pid_t holder = hold_in_child({entity(5, false)}, ready, go);
  auto m = open();
  auto shared = m->try_lock({entity(5, false)});
  if (shared_is_exclusive()) {
    // Documented: this algorithm treats shared as exclusive.
    ASSERT_FALSE(shared);
    EXPECT_EQ(shared.error(), std::errc::operation_would_block);
  } else {
    ASSERT_TRUE(shared) << shared.error().message();
  }
  auto excl = m->try_lock({entity(5, true)});
  if (!shared_is_exclusive()) {
    // This thread holds entity 5 shared already: relocking is a deadlock, not contention.
    ASSERT_FALSE(excl);
    EXPECT_EQ(excl.error(), std::errc::resource_deadlock_would_occur);
    shared = entities_guard{};
    auto other = m->try_lock({entity(5, true)});
    ASSERT_FALSE(other);
    EXPECT_EQ(other.error(), std::errc::operation_would_block);
  }
  go.notify();
  EXPECT_EQ(wait_exit(holder), 0);
  EXPECT_TRUE(m->try_lock({entity(5, true)}));
}

TEST_P(MutexSuite, ExclusiveExcludesShared) {
  signal_pipe ready, go;
  const pid_t holder = hold_in_child({entity(6, true)}, ready, go);
  auto m = open();
  auto r = m->try_lock({entity(6, false)});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), std::errc::operation_would_block);
  EXPECT_TRUE(m->try_lock({entity(7, true)}));  // other entities are free
  go.notify();
  EXPECT_EQ(wait_exit(holder), 0);
}

TEST_P(MutexSuite, OppositeOrdersNeverDeadlock) {
  constexpr int rounds = 150;
  std::vector<pid_t> pids;
  for (int p = 0; p < 4; ++p) {
    pids.push_back(fork_child([&, p] {
      auto m = open();
      std::vector<entity> set = {entity(1), entity(2), entity(3), entity(4)};
      if (p % 2 == 1) std::reverse(set.begin(), set.end());
      for (int r = 0; r < rounds; ++r) {
        auto g = m->lock(set, 20s);  // a deadlock would end here with timed_out
        if (!g) return 2;
      }
      return 0;
    }));
  }
  for (pid_t pid : pids)
    EXPECT_EQ(wait_exit(pid), 0);
}

TEST_P(MutexSuite, DeadlinesAreHonoured) {
  signal_pipe ready, go;
  const pid_t holder = hold_in_child({entity(9)}, ready, go);
  auto m = open();

  auto t0 = clock_type::now();
  auto zero = m->lock({entity(9)}, deadline::zero());
  ASSERT_FALSE(zero);
  EXPECT_EQ(zero.error(), std::errc::operation_would_block);
  EXPECT_LT(ms_since(t0), 50.0);

  t0 = clock_type::now();
  auto finite = m->lock({entity(9)}, 100ms);
  const double took = ms_since(t0);
  ASSERT_FALSE(finite);
  EXPECT_EQ(finite.error(), std::errc::timed_out);
  EXPECT_GE(took, 100.0);
  EXPECT_LT(took, 150.0);

  t0 = clock_type::now();
  auto past = m->lock({entity(9)}, deadline(clock_type::now() - 1s));
  ASSERT_FALSE(past);
  EXPECT_EQ(past.error(), std::errc::timed_out);
  EXPECT_LT(ms_since(t0), 50.0);

  std::thread releaser([&] {
    std::this_thread::sleep_for(200ms);
    go.notify();
  });
  t0 = clock_type::now();
  auto forever = m->lock({entity(9)});
  ASSERT_TRUE(forever) << forever.error().message();
  EXPECT_GE(ms_since(t0), 150.0);
  releaser.join();
  EXPECT_EQ(wait_exit(holder), 0);
}

TEST_P(MutexSuite, KilledHolderReleases) {
  signal_pipe ready, go;
  const pid_t holder = hold_in_child({entity(11), entity(12, false)}, ready, go);
  auto m = open();
  EXPECT_FALSE(m->try_lock({entity(11)}));
  ::kill(holder, SIGKILL);
  EXPECT_EQ(wait_exit(holder), 128 + SIGKILL);
  const auto t0 = clock_type::now();
  auto g = m->lock({entity(11), entity(12)}, 5s);
  ASSERT_TRUE(g) << g.error().message();
  EXPECT_LT(ms_since(t0), 2000.0);
}

// Review of issue 44 (second): a child forked by a holder kept its copies of the holder's
// per-thread descriptors, which share their open file descriptions and so the holder's locks:
// with the holder killed, its entities stayed held for as long as the child lived. A forked
// child closes its copies (it holds none of its parent's locks).
TEST_P(MutexSuite, AKilledHoldersForkedChildKeepsNoneOfItsLocks) {
  int life[2];  // the grandchild lives until the test closes its end
  int told[2];  // the grandchild's pid, from the holder
  ASSERT_EQ(::pipe2(life, O_CLOEXEC), 0);
  ASSERT_EQ(::pipe2(told, O_CLOEXEC), 0);
  const pid_t holder = fork_child([&] {
    auto mine = open();
    auto g = mine->lock({entity(31), entity(32, false)});
    if (!g) return 2;
    const pid_t grandchild = ::fork();
    if (grandchild == 0) {
      ::close(life[1]);
      char c = 0;
      while (::read(life[0], &c, 1) < 0 && errno == EINTR) {
      }
      ::_exit(0);
    }
    if (grandchild < 0) return 3;
    if (::write(told[1], &grandchild, sizeof grandchild) != sizeof grandchild) return 4;
    for (;;)
      ::pause();
  });
  ::close(life[0]);
  ::close(told[1]);
  pid_t grandchild = 0;
  ASSERT_EQ(::read(told[0], &grandchild, sizeof grandchild), sizeof grandchild);
  ::close(told[0]);
  auto m = open();
  EXPECT_FALSE(m->try_lock({entity(31)}));
  ::kill(holder, SIGKILL);
  EXPECT_EQ(wait_exit(holder), 128 + SIGKILL);
  EXPECT_EQ(::kill(grandchild, 0), 0) << "the holder's child is still there";
  auto g = m->lock({entity(31), entity(32)}, 10s);
  EXPECT_TRUE(g) << "the dead holder's child kept its locks: " << g.error().message();
  ::close(life[1]);
}

// Processes that open and close the lock in a loop while others hold it: catches a
// first-user/last-user protocol that resets a lock in use.
// Review finding (issue 15 #8): try_lock never looked for a dead holder (atomic_append and
// memory_map answered would-block first), so a caller that only polls waited forever after
// a crash.
TEST_P(MutexSuite, PollingWithTryLockRecoversFromAKilledHolder) {
  auto m = open();
  signal_pipe holding;
  const pid_t holder = fork_child([&] {
    auto mine = open();
    auto g = mine->lock({entity(1)});
    if (!g) return 2;
    holding.notify();
    for (;;)
      ::pause();
  });
  ASSERT_EQ(holding.wait(), '!');
  ASSERT_FALSE(m->try_lock({entity(1)}));
  ::kill(holder, SIGKILL);
  EXPECT_EQ(wait_exit(holder), 128 + SIGKILL);
  const auto t0 = clock_type::now();
  bool got = false;
  while (!got && clock_type::now() - t0 < 10s) {
    got = static_cast<bool>(m->try_lock({entity(1)}));
    if (!got) std::this_thread::sleep_for(1ms);
  }
  EXPECT_TRUE(got) << "polling never recovered the dead holder's entity";
}

// Adversarial review of issue 15 (third): a guard taken before fork() is copied into the
// child, and a child that unlocked it (unwinding the scope it was forked in) let go of the
// parent's lock: memory_map cleared the parent's slot in the shared map, and the kernel
// locks released the open file description the two processes share. The parent still held
// it, and a third process got in beside it. A forked child holds none of its parent's
// locks, so it has none to unlock: its copy of the guard does nothing.
TEST_P(MutexSuite, AChildUnlockingItsParentsGuardLeavesTheParentHolding) {
  auto m = open();
  auto g = m->lock({entity(21), entity(22, false)});
  ASSERT_TRUE(g);
  const pid_t child = fork_child([&] {
    if (!g->unlock()) return 2;  // the copy of the parent's guard
    return 0;
  });
  ASSERT_EQ(wait_exit(child), 0);
  const pid_t third = fork_child([&] {
    auto other = open();
    auto e = other->try_lock({entity(21)});
    auto s = other->try_lock({entity(22)});
    return e || s ? 3 : 0;
  });
  EXPECT_EQ(wait_exit(third), 0) << "a third process got an entity the parent still holds";
  ASSERT_TRUE(g->unlock());
  EXPECT_TRUE(m->try_lock({entity(21), entity(22)})) << "the parent's unlock frees them";
}

TEST_P(MutexSuite, OpenCloseChurnKeepsExclusion) {
  constexpr int churners = 8;
  constexpr int rounds = 40;
  std::vector<pid_t> pids;
  for (int p = 0; p < churners; ++p) {
    pids.push_back(fork_child([&] {
      auto f = counter_file();
      for (int i = 0; i < rounds; ++i) {
        auto m = open();
        auto g = m->lock({entity(1)}, 30s);
        if (!g) return 2;
        increment(f, 0);
      }
      return 0;
    }));
  }
  {
    auto m = open();
    auto f = counter_file();
    for (int i = 0; i < rounds; ++i) {
      auto g = m->lock({entity(1)}, 30s);
      ASSERT_TRUE(g) << g.error().message();
      increment(f, 0);
    }
  }
  for (pid_t pid : pids)
    EXPECT_EQ(wait_exit(pid), 0);
  EXPECT_EQ(read_counter(counter_file(), 0), std::uint64_t{(churners + 1) * rounds});
}

TEST_P(MutexSuite, ThreadsSharingOneInstanceCountExactly) {
  constexpr int threads = 8;
  constexpr int increments = 150;
  auto m = open();
  auto f = counter_file();
  std::atomic<int> failures{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < increments; ++i) {
        auto g = m->lock({entity(1)}, 30s);
        if (!g) {
          ++failures;
          return;
        }
        increment(f, 0);
      }
    });
  }
  for (auto& t : ts)
    t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(read_counter(f, 0), std::uint64_t{threads * increments});
}

TEST_P(MutexSuite, ThreadsWithTheirOwnInstancesCountExactly) {
  constexpr int threads = 8;
  constexpr int increments = 100;
  auto f = counter_file();
  std::atomic<int> failures{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      auto m = open();
      std::mt19937 rng(static_cast<unsigned>(t));
      for (int i = 0; i < increments; ++i) {
        std::vector<entity> set = {entity(1), entity(2 + rng() % 3)};
        if (rng() % 2 == 0) std::swap(set[0], set[1]);
        auto g = m->lock(set, 30s);
        if (!g) {
          ++failures;
          return;
        }
        increment(f, 0);
      }
    });
  }
  for (auto& t : ts)
    t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(read_counter(f, 0), std::uint64_t{threads * increments});
}

TEST_P(MutexSuite, ThreadsSeeEachOthersLocks) {
  auto m = open();
  auto g = m->lock({entity(20)});
  ASSERT_TRUE(g);
  std::error_code seen;
  std::thread other([&] {
    auto r = m->try_lock({entity(20)});
    seen = r ? std::error_code{} : r.error().code();
  });
  other.join();
  EXPECT_EQ(seen, std::errc::operation_would_block);
  auto second = open();
  std::thread third([&] {
    auto r = second->lock({entity(20)}, 50ms);
    seen = r ? std::error_code{} : r.error().code();
  });
  third.join();
  EXPECT_EQ(seen, std::errc::timed_out);
}

// Review finding (issue 15 #5): threads of one instance opened the lock file by path, so
// after it was removed and made again (a clean-up script, another user) a new thread locked
// the new file: a second holder inside one instance. It must fail instead (ESTALE).
TEST_P(MutexSuite, ThreadsOfOneInstanceNeverLockAReplacedFile) {
  auto m = open();
  auto g = m->lock({entity(1)});
  ASSERT_TRUE(g);
  std::filesystem::remove_all(lock_path());
  if (uses_directory(algo())) {
    std::filesystem::create_directory(lock_path());
  } else {
    ASSERT_TRUE(io::file_handle::open(lock_path().c_str(),
                                      io::open_flags::read_write | io::open_flags::create));
  }
  std::thread([&] {
    auto h = m->try_lock({entity(1)});
    EXPECT_FALSE(h) << "a second holder in one instance";
    if (!h && h.error() != std::errc::operation_would_block) {
      EXPECT_EQ(h.error().code().value(), ESTALE) << h.error().message();
    }
  }).join();
}

// Review finding (issue 15 #12): lock files were opened through symlinks, so a link planted
// at a lock path made keel lock, and memory_map and atomic_append write a header into, the
// file it pointed to. Opening must refuse it and leave the target alone.
TEST_P(MutexSuite, ASymlinkAtTheLockPathIsRefused) {
  const std::string target = dir_.file("victim");
  if (uses_directory(algo())) {
    std::filesystem::create_directory(target);
  } else {
    ASSERT_TRUE(
        io::file_handle::open(target.c_str(), io::open_flags::read_write | io::open_flags::create));
  }
  std::filesystem::create_symlink(target, lock_path());
  auto m = open_mutex(algo(), lock_path());
  EXPECT_FALSE(m) << "opened through a symlink";
  if (uses_directory(algo())) {
    EXPECT_TRUE(std::filesystem::is_empty(target)) << "files made in the link's target";
  } else {
    EXPECT_EQ(std::filesystem::file_size(target), 0u) << "the link's target was written";
  }
  std::filesystem::remove(lock_path());
}

TEST_P(MutexSuite, RelockingIsADeadlockNotAWait) {
  auto m = open();
  auto g = m->lock({entity(30), entity(31)});
  ASSERT_TRUE(g);
  const auto t0 = clock_type::now();
  auto again = m->lock({entity(31)});  // an infinite deadline: must not hang
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error(), std::errc::resource_deadlock_would_occur);
  auto via_other = open()->lock({entity(30)});
  ASSERT_FALSE(via_other);
  EXPECT_EQ(via_other.error(), std::errc::resource_deadlock_would_occur);
  EXPECT_LT(ms_since(t0), 100.0);
  ASSERT_TRUE(g->unlock());
  EXPECT_TRUE(m->lock({entity(31)}));
}

TEST_P(MutexSuite, SetsAreCanonical) {
  auto m = open();
  auto empty = m->lock(std::span<const entity>{});
  ASSERT_TRUE(empty);
  EXPECT_TRUE(empty->entities().empty());
  std::vector<entity> many;
  for (int i = 40; i > 20; --i)
    many.push_back(entity(static_cast<std::uint64_t>(i), i % 2 == 0));
  many.push_back(entity(25, true));  // a duplicate: held once, exclusive
  many.push_back(entity(25, false));
  auto g = m->lock(many);
  ASSERT_TRUE(g) << g.error().message();
  ASSERT_EQ(g->entities().size(), 20u);
  for (std::size_t i = 0; i + 1 < g->entities().size(); ++i) {
    EXPECT_LT(g->entities()[i].value, g->entities()[i + 1].value);
  }
  EXPECT_TRUE(g->entities()[4].is_exclusive());  // entity 25
  g->release();
  EXPECT_FALSE(g->owns_lock());
}

TEST_P(MutexSuite, LargeSetsAreAllOrNothing) {
  std::vector<entity> big;
  for (std::uint64_t v = 1000; v < 1100; ++v)
    big.push_back(entity(v, v % 3 != 0));
  signal_pipe ready, go;
  const pid_t holder = hold_in_child(big, ready, go);
  auto m = open();
  EXPECT_FALSE(m->try_lock({entity(1050)}));
  EXPECT_FALSE(m->try_lock({entity(500, true), entity(1099, true)}));
  // Nothing stays held after a failed try (values chosen not to share a sysv slot with big).
  EXPECT_TRUE(m->try_lock({entity(500, true), entity(600, true)}));
  go.notify();
  EXPECT_EQ(wait_exit(holder), 0);
  auto g = m->lock(big, 5s);
  ASSERT_TRUE(g) << g.error().message();
  EXPECT_EQ(g->entities().size(), 100u);
}

TEST_P(MutexSuite, GuardMoves) {
  auto m = open();
  entities_guard kept;
  {
    auto g = m->lock({entity(50)});
    ASSERT_TRUE(g);
    kept = std::move(*g);
  }
  EXPECT_TRUE(kept.owns_lock());
  EXPECT_EQ(kept.mutex(), m.get());
  std::thread([&] { EXPECT_FALSE(open()->try_lock({entity(50)})); }).join();
  ASSERT_TRUE(kept.unlock());
  std::thread([&] { EXPECT_TRUE(open()->try_lock({entity(50)})); }).join();
}

INSTANTIATE_TEST_SUITE_P(Every, MutexSuite, ::testing::ValuesIn(algorithm_names()),
                         [](const auto& param_info) { return std::string(param_info.param); });

TEST(Entity, HashesNamesInto63Bits) {
  const entity a = entity::from_string("alpha");
  const entity b = entity::from_string("beta", false);
  EXPECT_NE(a.value, b.value);
  EXPECT_TRUE(a.is_exclusive());
  EXPECT_FALSE(b.is_exclusive());
  EXPECT_EQ(entity::from_string("alpha").value, a.value);
  EXPECT_EQ(entity(~std::uint64_t{0}).value, entity::max_value);
  EXPECT_EQ(a.shared(), entity(a.value, false));
}

TEST(Algorithms, UnknownNameIsAnError) {
  temp_dir dir;
  auto m = open_mutex("nonesuch", dir.file("x"));
  ASSERT_FALSE(m);
  EXPECT_EQ(m.error(), std::errc::invalid_argument);
  EXPECT_FALSE(open_mutex("byte_ranges", dir.file("missing/dir/lock")));
}

// Review finding (issue 15 #12): a lock directory someone else made was used as it was,
// though its owner can plant and replace entries in it at will.
TEST(LockDirectories, ALockDirectoryOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a directory to another user";
  for (const std::string_view algo : {"lock_files", "flock"}) {
    ASSERT_TRUE(uses_directory(algo));
    temp_dir dir;
    const std::string path = dir.file("locks");
    std::filesystem::create_directory(path);
    ASSERT_EQ(::chown(path.c_str(), 65534, 65534), 0);
    auto m = open_mutex(algo, path);
    ASSERT_FALSE(m) << algo << " used a directory another user owns";
    EXPECT_EQ(m.error().code(), std::errc::operation_not_permitted) << m.error().message();
  }
}

// Review finding (issue 15 #11): flock kept one descriptor per entity per thread for good,
// so a thread that locked many entities ran out of descriptors (EMFILE).
TEST(FlockFiles, DescriptorsDoNotGrowWithTheEntitiesLocked) {
  const auto open_fds = [] {
    std::size_t n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd"))
      ++n;
    return n;
  };
  std::error_code ec;
  if (!std::filesystem::exists("/proc/self/fd", ec)) GTEST_SKIP() << "no /proc/self/fd here";
  temp_dir dir;
  auto m = open_mutex("flock", dir.file("locks"));
  ASSERT_TRUE(m);
  ASSERT_TRUE((*m)->lock({entity(1)}));  // the thread's state exists
  const std::size_t before = open_fds();
  for (std::uint64_t v = 100; v < 3100; ++v)
    ASSERT_TRUE((*m)->lock({entity(v)}));
  EXPECT_LT(open_fds(), before + 100) << "a descriptor kept per entity ever locked";
}

}  // namespace
}  // namespace keel::lock
