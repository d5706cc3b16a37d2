// Resources running out beside the paths the store walks: a process out of file descriptors
// is that process's error, never the store's state; a store of many segments needs no
// descriptor per segment. Only a failed fdatasync turns a store read-only.

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <filesystem>
#include <string>

#include "keel/io/fault_filesystem.hpp"
#include "kv/kv_support.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;
using test_support::open_ok;
using test_support::small;

const std::error_code emfile(EMFILE, std::system_category());

// Another process, out of descriptors, leads a group sync or writes a checkpoint and cannot
// map a segment it must sync. Its own call fails with EMFILE; the store stays writable for
// everyone (it once stored the EMFILE as a failed sync: every process was refused), and the
// segment it could not sync is synced by the next leader.
TEST(KvExhaustion, AProcessOutOfDescriptorsTurnsNoStoreReadOnly) {
  temp_dir dir;
  const std::string path = dir.file("s");
  options o = small();
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  // Two segments of commits nobody synced yet.
  for (int k = 0; k < 1500; ++k)
    ASSERT_TRUE(s->put("k" + std::to_string(k), std::string(1000, 'v')));
  const std::string first = "/seg/" + segment_name(1);
  const pid_t other = fork_child([&] {
    io::fault_filesystem fs;
    options mine = small();
    mine.fs = &fs;
    auto m = store::open(path, mine);
    if (!m) return 2;
    // It may map the active segment, not the first one, which is dirty.
    fs.inject({.on = io::fs_op::open,
               .repeat = io::fault_filesystem::fault::repeat::forever,
               .error = EMFILE,
               .path_contains = first});
    auto t = (*m)->begin();
    if (!t || !t->put("from the other", "x")) return 3;
    auto led = t->commit(durability::sync);
    if (led || led.error() != emfile) return 4;
    auto cp = (*m)->checkpoint();
    if (cp || cp.error() != emfile) return 5;
    return 0;
  });
  EXPECT_EQ(test::wait_exit(other), 0)
      << "3: no put, 4: the sync it led did not fail with EMFILE, 5: nor the checkpoint";
  auto t = s->begin();
  ASSERT_TRUE(t);
  ASSERT_TRUE(t->put("after", "y"));
  auto r = t->commit(durability::sync);
  ASSERT_TRUE(r) << "the store turned read-only: " << r.error().message();
  ASSERT_TRUE(s->checkpoint());
  EXPECT_EQ(*s->get("from the other"), "x");
}

// A store of more segments than the process may hold descriptors: reads across all of it,
// writes, and a rebuild after a reboot work under a small RLIMIT_NOFILE. (Its manifest grows
// past its first page on the way.)
TEST(KvExhaustion, AStoreOfManySegmentsNeedsNoDescriptorPerSegment) {
  temp_dir dir;
  const std::string path = dir.file("s");
  // About 280 segments of 1 MiB: more than a page of the manifest lists, too.
  constexpr int keys = 4700;
  const auto value = [](int k) {
    std::string v = "value " + std::to_string(k) + ":";
    v.resize(60'000, static_cast<char>('a' + k % 26));
    return v;
  };
  const pid_t child = fork_child([&] {
    const rlimit few{64, 64};
    if (::setrlimit(RLIMIT_NOFILE, &few) != 0) return test::cannot_set_up;
    {
      auto s = store::open(path, small());
      if (!s) return 2;
      for (int k = 0; k < keys; ++k) {
        if (!(*s)->put("k" + std::to_string(k), value(k))) return 3;
      }
    }
    for (const bool reboot : {false, true}) {
      if (reboot) std::filesystem::remove(path + "/index");
      auto s = store::open(path, small());
      if (!s) return reboot ? 4 : 5;
      for (int k = 0; k < keys; ++k) {
        auto v = (*s)->get("k" + std::to_string(k));
        if (!v || *v != value(k)) return 6;
      }
      std::size_t seen = 0;
      std::string cursor;
      for (;;) {
        auto page = (*s)->scan(cursor, 100, true);
        if (!page) return 7;
        seen += page->items.size();
        if (page->done) break;
        cursor = page->cursor;
      }
      if (seen != keys + (reboot ? 1u : 0u)) return 8;  // and "more", put below
      if (!(*s)->checkpoint() || !(*s)->put("more", "m")) return 9;
    }
    return 0;
  });
  const int code = test::wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot lower RLIMIT_NOFILE here";
  EXPECT_EQ(code, 0) << "2/3: filling, 4: rebuild, 5: reopen, 6: get, 7/8: scan, 9: write";
  std::size_t segments = 0;
  for (const auto& e : std::filesystem::directory_iterator(path + "/seg"))
    segments += e.path().filename().string().size() == 16 ? 1 : 0;
  EXPECT_GT(segments, 260u) << "more segments than the 64 descriptors it may hold";
}

}  // namespace
}  // namespace keel::kv

namespace keel::kv {
namespace {

// A quota the volume's free room does not show (EDQUOT on every new file of seg/, or ENOSPC
// from a filesystem whose statfs says there is room): erase-only commits that run out of the
// tail's room fail with that error, after a compaction or two, instead of compacting again
// for ever. (They retried while each compaction freed something, or while statfs showed
// room, and their deadline was never read outside btrfs: a torture writer, seed 1016 of
// `keel-bench torture --mode io-errors --workload kv`, spun until it was killed.) In a child
// with a watchdog: a retry loop without end would otherwise hang the suite.
TEST(KvExhaustion, EraseOnlyCommitsFailWhereAQuotaTheVolumeDoesNotShowRunsOut) {
  for (const int quota : {EDQUOT, ENOSPC}) {
    SCOPED_TRACE(quota);
    temp_dir dir;
    const std::string path = dir.file("s");
    const pid_t child = fork_child([&]() -> int {
      ::alarm(300);  // a watchdog for a hang, never the test's clock
      io::fault_filesystem fs;
      options o = test_support::manual_compaction();
      o.fs = &fs;
      o.lock_timeout = std::chrono::hours(1);  // no deadline comes to the rescue
      auto s = store::open(path, o);
      if (!s) return 2;
      for (int k = 0; k < 2000; ++k) {
        if (!(*s)->put("k" + std::to_string(k), std::string(1000, 'v'))) return 3;
      }
      fs.inject({.on = io::fs_ops::all(),
                 .repeat = io::fault_filesystem::fault::repeat::forever,
                 .error = quota,
                 .path_contains = "/seg/"});
      // Erases of keys never put, each a transaction of its own, until one finds no room: the
      // tail's segment fills with their records, no segment (nor a room file) can be made or
      // renamed, and compaction finds no victim (every put is live).
      for (int k = 0; k < 200000; ++k) {
        auto t = (*s)->begin();
        if (!t) return 4;
        if (!t->erase("gone" + std::to_string(k))) return 5;
        auto c = t->commit();
        if (c) continue;
        return c.error() == std::error_code(quota, std::system_category()) ? 0 : 6;
      }
      return 7;  // every erase went in: the test did not reach what it tests
    });
    EXPECT_EQ(test::wait_exit(child), 0);
  }
}

}  // namespace
}  // namespace keel::kv
