// A writer that is alive but stopped (SIGSTOP, a debugger, a machine too busy to run it)
// at a step of its commit: no other call waits for it much past options::lock_timeout. Its
// commit is then abandoned if it was not yet whole (it fails when the writer goes on, and
// nobody ever sees it), or made visible if its block was whole (the writer publishes it
// when it goes on). Either way everyone agrees, also after a rebuild.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>

#include "kv/format.hpp"
#include "kv/kv_support.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::killed_on_failure;
using test::temp_dir;
using test_support::open_ok;
using test_support::small;

options short_timeout() {
  options o = small();
  o.lock_timeout = std::chrono::milliseconds(300);
  return o;
}

// A stopped writer keeps the locks of its keys' index pages (doc/kv-format.md): the keys
// "a…" lie on one half of the index and the others on the other, so that the unrelated put
// is unrelated whatever the store's seed. (It once shared a page with "a" now and then.)
struct pages_apart {
  pages_apart() noexcept {
    disk::hash_hook = [](std::span<const std::byte> key, std::uint64_t seed) noexcept {
      disk::key_hash h = disk::unhooked_hash_key(key, seed);
      constexpr std::uint64_t top = std::uint64_t{1} << 63;
      h.hi = (!key.empty() && key[0] == std::byte{'a'}) ? (h.hi & ~top) | 1 : h.hi | top;
      return h;
    };
  }
  ~pages_apart() { disk::hash_hook = nullptr; }
  pages_apart(const pages_apart&) = delete;
  pages_apart& operator=(const pages_apart&) = delete;
};

class KvStoreStopped : public ::testing::TestWithParam<commit_step> {};

TEST_P(KvStoreStopped, AStoppedWriterHoldsNobodyPastTheirTimeout) {
  const pages_apart apart;
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path, short_timeout());
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("base", "0"));
  // 0: its commit went in; 1: it failed with timed_out; else what went wrong.
  const pid_t writer = fork_child([&] {
    auto mine = store::open(path, short_timeout());
    if (!mine) return 2;
    static commit_step stop_at;
    stop_at = GetParam();
    commit_hook = [](commit_step now) noexcept {
      if (now == stop_at) ::raise(SIGSTOP);
    };
    auto t = (*mine)->begin();
    if (!t || !t->put("a", "1") || !t->put("a2", "1")) return 3;
    auto r = t->commit();
    commit_hook = nullptr;
    if (r) return 0;
    return r.error() == std::errc::timed_out ? 1 : 4;
  });
  killed_on_failure guard{writer};
  int status = 0;
  ASSERT_EQ(::waitpid(writer, &status, WUNTRACED), writer);
  ASSERT_TRUE(WIFSTOPPED(status)) << "status " << status;
  // An unrelated put: it waits for the stopped commit in front only until its own timeout.
  const auto began = std::chrono::steady_clock::now();
  auto put = s->put("b", "2");
  const auto waited = std::chrono::steady_clock::now() - began;
  ASSERT_TRUE(put) << put.error().message();
  EXPECT_LT(waited, std::chrono::seconds(10)) << "held by a stopped writer";
  EXPECT_EQ(*s->get("b"), "2");
  const auto a_now = s->get("a");
  ASSERT_EQ(::kill(writer, SIGCONT), 0);
  const int code = test::wait_exit(writer);
  guard.pid = 0;
  ASSERT_TRUE(code == 0 || code == 1) << "exit " << code;
  const bool went_in = code == 0;
  // What readers saw while it was stopped is what it did.
  if (went_in) {
    ASSERT_TRUE(a_now) << "its commit went in, yet was not there: " << a_now.error().message();
  } else {
    EXPECT_FALSE(a_now) << "abandoned, yet seen: " << *a_now;
  }
  for (int round = 0; round < 3; ++round) {
    if (round == 1) {
      s.reset();
      s = open_ok(path, short_timeout());
    }
    if (round == 2) {
      s.reset();
      std::filesystem::remove(path + "/index");
      s = open_ok(path, short_timeout());
    }
    ASSERT_TRUE(s);
    for (const char* k : {"a", "a2"}) {
      auto v = s->get(k);
      if (went_in) {
        ASSERT_TRUE(v) << "round " << round << ": " << k << ": " << v.error().message();
        EXPECT_EQ(*v, "1");
      } else {
        ASSERT_FALSE(v) << "round " << round << ": " << k << " is there";
        EXPECT_EQ(v.error(), errc::not_found);
      }
    }
    EXPECT_EQ(*s->get("b"), "2");
    ASSERT_TRUE(s->put("c" + std::to_string(round), "after"));  // writers go on
    EXPECT_EQ(*s->get("c" + std::to_string(round)), "after");
  }
}

// A sync leader stopped while it syncs for everyone: the others' `sync` commits, visible
// already, are not failed with timed_out (their callers would retry commits that went in):
// past their deadline they sync for themselves. (60 of 60 unrelated sync puts once failed
// so, each applied anyway.)
TEST(KvStoreStoppedLeader, SyncCommitsSyncForThemselvesPastTheirTimeout) {
  temp_dir dir;
  const std::string path = dir.file("s");
  options o = short_timeout();
  o.durable = durability::sync;
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  const pid_t leader = fork_child([&] {
    auto mine = store::open(path, o);
    if (!mine) return 2;
    commit_hook = [](commit_step now) noexcept {
      if (now == commit_step::syncing) ::raise(SIGSTOP);
    };
    auto r = (*mine)->put("l", "1");
    commit_hook = nullptr;
    return r ? 0 : 3;
  });
  killed_on_failure guard{leader};
  int status = 0;
  ASSERT_EQ(::waitpid(leader, &status, WUNTRACED), leader);
  ASSERT_TRUE(WIFSTOPPED(status)) << "status " << status;
  for (int i = 0; i < 3; ++i) {
    const std::string k = "k" + std::to_string(i);
    auto put = s->put(k, "v");
    ASSERT_TRUE(put) << k << ": " << put.error().message();
    EXPECT_EQ(s->get(k).value_or("?"), "v");
  }
  ASSERT_EQ(::kill(leader, SIGCONT), 0);
  guard.pid = 0;
  EXPECT_EQ(test::wait_exit(leader), 0);
  EXPECT_EQ(s->get("l").value_or("?"), "1");
}

// A writer stopped after its commit was charged to a delta of the space ledger (with a
// budget, deltas close every few hundred puts): every close after next would wait for that
// delta to go quiet, and every put once the front delta's budget is spent would wait for
// that close. (With max_bytes set, every put timed out while it stayed stopped.) Past its
// deadline the closer evicts it, its cost written off until it goes on; when it does, its
// commit goes in and nothing stays written off.
// A budget: puts are charged to the deltas of the space ledger.
options charged_to_a_ledger() {
  options o = short_timeout();
  o.max_bytes = std::uint64_t{32} << 20;
  return o;
}

// A child that opens `path` and puts `key`, stopped (SIGSTOP) once its put is charged to a
// delta of the ledger; exits 0 when its put goes in once it goes on.
pid_t a_writer_stopped_when_charged(const std::string& path, const options& o,
                                    const std::string& key, const std::string& value) {
  return fork_child([&] {
    auto mine = store::open(path, o);
    if (!mine) return 2;
    commit_hook = [](commit_step now) noexcept {
      if (now == commit_step::charged) ::raise(SIGSTOP);
    };
    auto r = (*mine)->put(key, value);
    commit_hook = nullptr;
    return r ? 0 : 3;
  });
}

// space::ledger_words::written_off, in the index's header.
std::int64_t written_off_in(const std::string& path) {
  const std::string index = test::slurp(path + "/index");
  std::int64_t written_off = -1;
  std::memcpy(&written_off,
              index.data() + header::ledger + offsetof(space::ledger_words, written_off), 8);
  return written_off;
}

// A store whose puts are charged to a ledger, a put made.
class KvLedgerStore : public ::testing::Test {
 protected:
  void SetUp() override {
    s = open_ok(path, o);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("base", "0"));
  }
  temp_dir dir;
  const std::string path = dir.file("s");
  const options o = charged_to_a_ledger();
  std::unique_ptr<store> s;
};

class KvLedgerStopped : public KvLedgerStore, public ::testing::WithParamInterface<bool> {};

TEST_P(KvLedgerStopped, AWriterStoppedInsideADeltaHoldsNoPutPastTheirTimeout) {
  const bool killed = GetParam();  // killed while stopped, rather than let go on
  const pid_t writer = a_writer_stopped_when_charged(path, o, "stopped", std::string(1024, 's'));
  killed_on_failure guard{writer};
  int status = 0;
  ASSERT_EQ(::waitpid(writer, &status, WUNTRACED), writer);
  ASSERT_TRUE(WIFSTOPPED(status)) << "status " << status;
  // Enough to close several deltas (a 1 KiB put is charged about 10 KiB of the ~7 MiB a
  // delta is given).
  const std::string value(1024, 'v');
  for (int i = 0; i < 4000; ++i) {
    auto put = s->put("k" + std::to_string(i), value);
    ASSERT_TRUE(put) << "put " << i << ": " << put.error().message();
  }
  if (killed) {
    guard.pid = 0;
    ASSERT_EQ(::kill(writer, SIGKILL), 0);
    EXPECT_EQ(test::wait_exit(writer), 128 + SIGKILL);
    // Its cost is given back at the next close of a delta.
    for (int i = 4000; i < 8000; ++i) {
      auto put = s->put("k" + std::to_string(i), value);
      ASSERT_TRUE(put) << "put " << i << ": " << put.error().message();
    }
  } else {
    ASSERT_EQ(::kill(writer, SIGCONT), 0);
    guard.pid = 0;
    EXPECT_EQ(test::wait_exit(writer), 0);
    EXPECT_EQ(s->get("stopped").value_or("?"), std::string(1024, 's'));
  }
  EXPECT_EQ(written_off_in(path), 0);  // nothing stays written off
  for (int i = 0; i < 4000; i += 397)
    EXPECT_EQ(s->get("k" + std::to_string(i)).value_or("?"), value);
}

// The writer stopped inside a delta, and the close that waits for that delta to go quiet
// made by a user with a far deadline: a put of a user with a near one, waiting for that
// close, once failed with timed_out until the closer's own deadline (review: a put with a
// 300 ms timeout failed for a minute). Past its own deadline, it evicts the stopped writer
// itself.
using KvLedgerStoppedCloser = KvLedgerStore;

TEST_F(KvLedgerStoppedCloser, AWaiterEvictsTheStoppedWriterPastItsOwnDeadline) {
  const std::string value(1024, 'v');
  const pid_t writer = a_writer_stopped_when_charged(path, o, "w0000", value);
  killed_on_failure guard_writer{writer};
  int status = 0;
  ASSERT_EQ(::waitpid(writer, &status, WUNTRACED), writer);
  ASSERT_TRUE(WIFSTOPPED(status)) << "status " << status;
  // The closer: its second close waits for the delta the writer is stopped in.
  static const test::signal_pipe* closing = nullptr;
  const test::signal_pipe closing_pipe;
  closing = &closing_pipe;
  const pid_t closer = fork_child([&] {
    options far = o;
    far.lock_timeout = std::chrono::minutes(10);
    auto mine = store::open(path, far);
    if (!mine) return 2;
    static int closes = 0;
    ledger_close_hook = [] noexcept {
      if (++closes == 2) closing->notify();
    };
    for (int i = 0; closes < 2; ++i) {
      if (i == 100000) return 4;
      char key[16];
      std::snprintf(key, sizeof key, "c%04d", i % 10000);
      if (!(*mine)->put(key, value)) return 3;
    }
    return 0;
  });
  killed_on_failure guard_closer{closer};
  ASSERT_TRUE(closing_pipe.ready_within(std::chrono::minutes(2))) << "the closer never closed";
  // The front delta is spent (the closer could not charge it): ours cannot either.
  const auto began = std::chrono::steady_clock::now();
  auto put = s->put("p0000", value);
  const auto waited = std::chrono::steady_clock::now() - began;
  ASSERT_TRUE(put) << put.error().message();
  EXPECT_LT(waited, std::chrono::seconds(10)) << "held by the closer's deadline";
  guard_closer.pid = 0;
  EXPECT_EQ(test::wait_exit(closer), 0);
  ASSERT_EQ(::kill(writer, SIGCONT), 0);
  guard_writer.pid = 0;
  EXPECT_EQ(test::wait_exit(writer), 0);
  EXPECT_EQ(s->get("w0000").value_or("?"), value);
  EXPECT_EQ(s->get("p0000").value_or("?"), value);
  EXPECT_EQ(written_off_in(path), 0);
}

INSTANTIATE_TEST_SUITE_P(GoesOnOrIsKilled, KvLedgerStopped, ::testing::Bool(),
                         [](const auto& p) { return p.param ? "killed" : "goes_on"; });

INSTANTIATE_TEST_SUITE_P(AtEachStepAfterItsSeq, KvStoreStopped,
                         ::testing::Values(commit_step::took_seq, commit_step::recorded,
                                           commit_step::written, commit_step::published_one,
                                           commit_step::published),
                         [](const auto& p) { return std::to_string(static_cast<int>(p.param)); });

}  // namespace
}  // namespace keel::kv
