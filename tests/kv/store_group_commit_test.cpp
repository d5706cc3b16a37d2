// Group commit: `sync` commits that wait while a sync runs share the next one, and a sync
// leader that dies mid-sync holds nobody up.

#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "keel/io/filesystem.hpp"
#include "keel/kv/store.hpp"
#include "kv/kv_support.hpp"
#include "kv/store_impl.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;
using test::wait_exit;
using test_support::open_ok;
using test_support::small;

// Counts data syncs (of a file, or of a map: how segments are synced); once armed, holds the
// first one until released.
class gated_fs final : public io::filesystem_wrapper {
 public:
  gated_fs() noexcept : io::filesystem_wrapper(io::os()) {}

  result<void> sync(const io::file_handle& file, io::sync_kind kind) noexcept override {
    if (kind == io::sync_kind::data) gate();
    return io::filesystem_wrapper::sync(file, kind);
  }
  result<void> sync_map(void* address, std::size_t length, bool wait) noexcept override {
    if (wait) gate();
    return io::filesystem_wrapper::sync_map(address, length, wait);
  }
  void arm() {
    std::lock_guard l(m_);
    armed_ = true;
  }
  void wait_held() {
    std::unique_lock l(m_);
    cv_.wait(l, [&] { return held_; });
  }
  void release() {
    std::lock_guard l(m_);
    held_ = false;
    cv_.notify_all();
  }

  std::atomic<int> syncs{0};

 private:
  void gate() {
    syncs.fetch_add(1);
    std::unique_lock l(m_);
    if (armed_) {
      armed_ = false;
      held_ = true;
      cv_.notify_all();
      cv_.wait(l, [&] { return !held_; });
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  bool armed_ = false;
  bool held_ = false;
};

std::atomic<int> waiting{0};

// Seven commits that come while a sync is under way are all covered by one more sync, not
// one each, and none returns before it.
TEST(KvGroupCommit, CommitsThatWaitDuringASyncShareTheNextOne) {
  temp_dir dir;
  gated_fs fs;
  options o = small();
  o.durable = durability::sync;
  o.fs = &fs;
  auto s = open_ok(dir.file("s"), o);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("first", "0"));  // the segment exists and is clean
  waiting = 0;
  commit_hook = [](commit_step at) noexcept {
    if (at == commit_step::sync_waiting) waiting.fetch_add(1);
  };
  fs.arm();
  std::thread leader([&] { EXPECT_TRUE(s->put("leader", "1")); });
  fs.wait_held();
  const int before = fs.syncs.load();
  constexpr int followers = 7;
  std::atomic<int> done{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < followers; ++i) {
    ts.emplace_back([&, i] {
      EXPECT_TRUE(s->put("k" + std::to_string(i), "v"));
      done.fetch_add(1);
    });
  }
  // Every follower's commit is visible and waits for a sync that starts after its own.
  while (waiting.load() < 1 + followers)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(done.load(), 0) << "a sync commit returned before any sync covered it";
  for (int i = 0; i < followers; ++i)
    EXPECT_TRUE(s->get("k" + std::to_string(i)));
  fs.release();
  leader.join();
  for (auto& t : ts)
    t.join();
  commit_hook = nullptr;
  EXPECT_EQ(done.load(), followers);
  EXPECT_EQ(fs.syncs.load() - before, 1) << "the followers did not share one sync";
}

// A leader killed after it counted its sync as started and took the dirty bits, and before
// it synced anything: the lock it held is freed with it, and the next `sync` commit, in
// another process, syncs every segment itself and returns.
TEST(KvGroupCommit, ALeaderKilledMidSyncHoldsNobodyUp) {
  temp_dir dir;
  const std::string path = dir.file("s");
  options o = small();
  o.durable = durability::sync;
  // Long, so that a put that waited it out stands out from one slowed by a busy machine (half
  // of it is the bound below).
  o.lock_timeout = std::chrono::seconds(120);
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("a", "0"));
  const pid_t victim = fork_child([&] {
    auto mine = store::open(path, o);
    if (!mine) return 2;
    commit_hook = [](commit_step at) noexcept {
      if (at == commit_step::syncing) ::raise(SIGKILL);
    };
    (void)(*mine)->put("b", "1");
    return 3;  // not killed
  });
  ASSERT_EQ(wait_exit(victim), 128 + SIGKILL);
  EXPECT_EQ(*s->get("b"), "1") << "the victim's commit was visible before its sync";
  const auto start = std::chrono::steady_clock::now();
  auto r = s->put("c", "2");
  EXPECT_TRUE(r) << r.error().message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, o.lock_timeout / 2);
  // Another process's sync commits go on as well.
  const pid_t next = fork_child([&] {
    auto mine = store::open(path, o);
    if (!mine) return 2;
    for (int i = 0; i < 10; ++i)
      if (!(*mine)->put("d" + std::to_string(i), "x")) return 3;
    return 0;
  });
  EXPECT_EQ(wait_exit(next), 0);
}

}  // namespace
}  // namespace keel::kv
