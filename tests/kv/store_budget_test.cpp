// options::max_bytes: a commit that would take the store's files past the budget fails with
// budget_reached before it is visible, and leaves no trace; deletes and compaction still
// work when the budget is reached (puts leave them a segment, and compaction the spare);
// every opener, in any process, is held to its own cap.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <utility>

#include "keel/kv/store.hpp"
#include "kv/kv_support.hpp"
#include "kv/small_volume.hpp"
#include "kv/store_impl.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test_support::open_ok;
using test_support::small;

constexpr std::uint64_t mib = std::uint64_t{1} << 20;

// Compacting only when asked or short of room: these tests count what each compaction did.
options budgeted(std::uint64_t bytes) {
  options o = test_support::manual_compaction();
  o.max_bytes = bytes;
  return o;
}

std::string key_of(int i) {
  return "key-" + std::to_string(i);
}

// Puts `value` (1 KiB by default) under key_of(0), key_of(1), ... until one fails: how many
// succeeded. The failure must be budget_reached.
int fill(store& s, int at_most, const std::string& value = std::string(1024, 'v')) {
  for (int i = 0; i < at_most; ++i) {
    auto r = s.put(key_of(i), value);
    if (!r) {
      EXPECT_EQ(r.error(), errc::budget_reached) << r.error().message();
      return i;
    }
  }
  return at_most;
}

TEST(KvBudget, ABudgetBelowThreeSegmentsAndTheIndexIsRefused) {
  keel::test::temp_dir dir;
  auto s = store::open(dir.file("s"), budgeted(3 * mib));
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), std::errc::invalid_argument);
  // Nothing was left half made that a later open without a budget would trip on.
  EXPECT_TRUE(open_ok(dir.file("s")));
}

TEST(KvBudget, PutsStopAtTheBudgetAndTheFailedOneLeavesNoTrace) {
  keel::test::temp_dir dir;
  const std::uint64_t budget = 8 * mib;
  auto s = open_ok(dir.file("s"), budgeted(budget));
  ASSERT_TRUE(s);
  const int n = fill(*s, 100'000);
  ASSERT_LT(n, 100'000) << "the budget never stopped a put";
  // The files are within the budget, and used most of it (all but the spare, the segment
  // kept for deletes, and the end of the last one).
  auto st = s->stats();
  ASSERT_TRUE(st);
  EXPECT_LE(st->segment_bytes + st->index_bytes, budget);
  EXPECT_GT(n, 3500) << "stopped far before the budget";
  // Every put that returned is there; the refused one is not.
  for (int i = 0; i < n; ++i)
    ASSERT_TRUE(s->get(key_of(i))) << i;
  auto missing = s->get(key_of(n));
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error(), errc::not_found);
  // Still refused, and a transaction of several puts fails whole.
  auto t = s->begin();
  ASSERT_TRUE(t);
  ASSERT_TRUE(t->put(key_of(0), "changed"));
  ASSERT_TRUE(t->put(std::string(600, 'x'), std::string(100'000, 'y')));
  auto c = t->commit();
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error(), errc::budget_reached);
  EXPECT_EQ(*s->get(key_of(0)), std::string(1024, 'v'));
  // Reopened (all state from the files), the same.
  s.reset();
  s = open_ok(dir.file("s"), budgeted(budget));
  ASSERT_TRUE(s);
  EXPECT_TRUE(s->get(key_of(n - 1)));
  EXPECT_FALSE(s->get(key_of(n)));
}

TEST(KvBudget, DeletesAndCompactionWorkAtTheBudgetAndMakeRoomAgain) {
  keel::test::temp_dir dir;
  auto s = open_ok(dir.file("s"), budgeted(8 * mib));
  ASSERT_TRUE(s);
  const int n = fill(*s, 100'000);
  ASSERT_LT(n, 100'000);
  // Full: erasing needs no room the budget does not keep. Erase nearly everything.
  for (int i = 0; i < n - 10; ++i)
    ASSERT_TRUE(s->erase(key_of(i))) << i;
  auto c = s->compact();
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_GT(c->segments_removed, 0u);
  // Room again: as many puts as before fit, give or take a segment's worth.
  const int again = fill(*s, 100'000);
  EXPECT_GT(again, n / 2) << "compaction did not give the room back";
  for (int i = n - 10; i < n; ++i)
    EXPECT_TRUE(s->get(key_of(i))) << "a survivor of the deletes was lost: " << i;
}

// Reached is reached for every key: the index's pages count against the budget, and a put
// that made the last segment with the budget's last bytes left none for the pages its keys
// split into (see KvFullVolume.OnceAPutFindsTheVolumeFullFreshKeysFindItFullToo; here the
// index's pages allocated ahead had always held them). Over a segment's width of budgets,
// with segments of 1 MiB and 2 MiB.
TEST(KvBudget, OnceAPutFindsTheBudgetReachedFreshKeysFindItReachedToo) {
  for (const std::uint64_t segment : {mib, 2 * mib}) {
    for (std::uint64_t budget = 10 * mib; budget < 10 * mib + segment; budget += 64 * 1024) {
      keel::test::temp_dir dir;
      options o = budgeted(budget);
      o.segment_size = segment;
      auto s = open_ok(dir.file("s"), o);
      ASSERT_TRUE(s);
      const int n = fill(*s, 100'000);
      ASSERT_GT(n, 1000);
      for (int i = 1; i <= 20; ++i) {
        auto r = s->put(key_of(n + i), std::string(1024, 'v'));
        ASSERT_FALSE(r) << "segments of " << segment << ", a budget of " << budget << ": after "
                        << n << " puts, put " << i << " of a fresh key went in";
        ASSERT_EQ(r.error(), errc::budget_reached) << r.error().message();
      }
    }
  }
}

TEST(KvBudget, TheSmallestBudgetOpenAcceptsTakesAPut) {
  keel::test::temp_dir dir;
  // Four 1 MiB segments (of a fixed size: see the next test), a new index (384 pages), the
  // pages a segment of 1 KiB values' keys may split into (978 keys, a page for every 63: 16)
  // and the small files (8 pages): one less page is refused.
  const std::uint64_t least = 4 * mib + (384 + 16 + 8) * 4096;
  auto refused = store::open(dir.file("s"), budgeted(least - 4096));
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error(), std::errc::invalid_argument);
  auto s = open_ok(dir.file("s"), budgeted(least));
  ASSERT_TRUE(s);
  EXPECT_TRUE(s->put("k", "v"));
}

// A store whose segments grow (the segment size left to it) is judged by the index it makes
// (193 pages), not by a fixed store's (384): a budget of 2 MiB, which holds a one-key store of
// 1.5 MiB, was refused with invalid_argument.
TEST(KvBudget, AStoreWhoseSegmentsGrowOpensUnderTwoMiB) {
  keel::test::temp_dir dir;
  options o = budgeted(0);
  o.segment_size = 0;
  // Three 256 KiB segments, a new index (193 pages), a segment's keys' pages (4) and the small
  // files (8): one less page is refused.
  const std::uint64_t least = 3 * 256 * 1024 + (193 + 4 + 8) * 4096;
  o.max_bytes = least - 4096;
  auto refused = store::open(dir.file("s"), o);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error(), std::errc::invalid_argument);
  o.max_bytes = least;
  auto s = open_ok(dir.file("s"), o);
  ASSERT_TRUE(s);
  EXPECT_TRUE(s->put("k", "v"));
  EXPECT_LE(test_support::allocated_under(dir.file("s")), least);
}

// Under the least budget, a new store's first value of 100 KB (a blob, under a segment) goes
// in: the first log segment holds it. Given a segment of its own, because no log segment was
// there to hold it, it was refused, and so was every one after (found by review).
TEST(KvBudget, ANewStoreUnderTheLeastBudgetTakesABlobFirst) {
  for (const std::size_t size : {70'000, 100'000}) {
    SCOPED_TRACE(size);
    keel::test::temp_dir dir;
    options o = budgeted(0);
    o.segment_size = 0;
    o.max_bytes = 3 * 256 * 1024 + (193 + 4 + 8) * 4096;
    auto s = open_ok(dir.file("s"), o);
    ASSERT_TRUE(s);
    auto r = s->put("first", std::string(size, 'b'));
    ASSERT_TRUE(r) << r.error().message();
    EXPECT_EQ(s->get("first").value_or("?"), std::string(size, 'b'));
    EXPECT_LE(test_support::allocated_under(dir.file("s")), o.max_bytes);
  }
}

// Commits of three 70 KB blobs under a 2.8 MB budget: as many as when every blob went in the
// log (4). Each blob given a segment of its own, judged alone, made the commit's charge more
// than was left: one commit went in, and every one after was refused (found by review).
TEST(KvBudget, CommitsOfSeveralBlobsFitAsManyAsInTheLog) {
  keel::test::temp_dir dir;
  options o = budgeted(0);
  o.segment_size = 0;
  o.max_bytes = 2'800'000;
  auto s = open_ok(dir.file("s"), o);
  ASSERT_TRUE(s);
  int committed = 0;
  for (;; ++committed) {
    auto t = s->begin();
    ASSERT_TRUE(t);
    for (int k = 0; k < 3; ++k)
      ASSERT_TRUE(t->put("t" + std::to_string(committed) + "-" + std::to_string(k),
                         std::string(70'000, static_cast<char>('a' + k))));
    auto r = t->commit();
    if (!r) {
      ASSERT_EQ(r.error(), errc::budget_reached) << r.error().message();
      break;
    }
  }
  EXPECT_GE(committed, 4);
  for (int c = 0; c < committed; ++c)
    EXPECT_EQ(s->get("t" + std::to_string(c) + "-2").value_or("?"), std::string(70'000, 'c'));
  EXPECT_LE(test_support::allocated_under(dir.file("s")), o.max_bytes);
}

// Under 2 MiB and under the least budget (segments of 256 KiB), a store erased whole and
// compacted takes as many puts again, but for the erase records compaction cannot forget yet.
// The erases went into the segment made of the deletes' room, which puts left to deletes even
// once compaction had kept a victim as that room again: the first put abandoned its rest, and
// only 220 of 452 fitted under 2 MiB. Then puts went on in it, but the ledger still offered
// none of it: under the least budget, every put after was refused for good (found by review).
TEST(KvBudget, AStoreErasedWholeUnderASmallBudgetTakesAsManyPutsAgain) {
  for (const std::uint64_t budget :
       {std::uint64_t{3 * 256 * 1024 + (193 + 4 + 8) * 4096}, 2 * mib}) {
    SCOPED_TRACE("a budget of " + std::to_string(budget));
    keel::test::temp_dir dir;
    options o = budgeted(budget);
    o.segment_size = 0;
    auto s = open_ok(dir.file("s"), o);
    ASSERT_TRUE(s);
    const int n = fill(*s, 100'000);
    ASSERT_GT(n, 200);
    EXPECT_LE(test_support::allocated_under(dir.file("s")), budget);
    for (int i = 0; i < n; ++i)
      ASSERT_TRUE(s->erase(key_of(i))) << i;
    for (int pass = 0; pass < 8; ++pass) {
      auto c = s->compact();
      ASSERT_TRUE(c) << c.error().message();
      if (c->segments_removed == 0) break;
    }
    EXPECT_GE(fill(*s, 100'000), n * 7 / 8) << "the erased room did not come back";
    EXPECT_LE(test_support::allocated_under(dir.file("s")), budget);
  }
}

// Segments of a fixed size need a fourth under a budget: with three (the tail's, the spare
// and the deletes' room), the log never had a segment below the tail, which is the only kind
// compaction takes. Overwriting three keys filled the tail's segment with dead versions, and
// every put of 1000 bytes after was refused for good, after erases and compactions too
// (compaction removed nothing). Growing segments need no fourth: near the budget a put makes
// a smaller one.
TEST(KvBudget, AStoreOfFixedSegmentsAtItsLeastBudgetComesBackFromFull) {
  keel::test::temp_dir dir;
  const std::uint64_t index = (384 + 16 + 8) * 4096;  // as in the test before
  options o = budgeted(3 * mib + index);
  o.segment_size = mib;
  auto three = store::open(dir.file("three"), o);
  ASSERT_FALSE(three) << "three 1 MiB segments and the index";
  EXPECT_EQ(three.error(), std::errc::invalid_argument);
  o.max_bytes = 4 * mib + index;
  // Values of 100 000 bytes (blobs) were refused for good too: a commit with blobs is refused
  // up front where the room left cannot hold it, and that room left out the segment made and
  // not yet moved into (its maker's commit failed), which the next commit takes. (Values of
  // 300 000 bytes, three to a segment, are still refused here after a few puts: the ledger
  // charges a commit twice its bytes, more than the tail's rest that holds it, and one
  // segment all dead is counted a few hundred bytes short of the segment's worth of dead a
  // put asks for before it compacts.)
  for (const std::size_t size : {std::size_t{1000}, std::size_t{100'000}}) {
    SCOPED_TRACE("values of " + std::to_string(size) + " bytes");
    auto s = open_ok(dir.file("four-" + std::to_string(size)), o);
    ASSERT_TRUE(s);
    const std::string value(size, 'v');
    const int tries = static_cast<int>(30'000'000 / size);
    int refused = 0;
    for (int i = 0; i < tries && refused == 0; ++i) {
      auto r = s->put(key_of(i % 3), value);
      if (!r) {
        ASSERT_EQ(r.error(), errc::budget_reached) << r.error().message();
        ++refused;
      }
    }
    ASSERT_TRUE(s->erase(key_of(1)));
    ASSERT_TRUE(s->erase(key_of(2)));
    ASSERT_TRUE(s->compact());
    const int puts = static_cast<int>(std::max<std::size_t>(60, 3'000'000 / size));
    for (int i = 0; i < puts; ++i) {
      auto r = s->put(key_of(i % 3), value);
      ASSERT_TRUE(r) << "put " << i << " after the compaction: " << r.error().message();
    }
  }
}

TEST(KvBudget, CompactionAtTheBudgetMovesOnlyWhatFitsAndGoesOnPassByPass) {
  keel::test::temp_dir dir;
  auto s = open_ok(dir.file("s"), budgeted(8 * mib));
  ASSERT_TRUE(s);
  const int n = fill(*s, 100'000);
  ASSERT_LT(n, 100'000);
  // Two keys in three erased: every old segment is a third live, and moving all of them at
  // once would need more room than the budget keeps.
  for (int i = 0; i < n; ++i) {
    if (i % 3 == 0) continue;
    ASSERT_TRUE(s->erase(key_of(i))) << i;
  }
  std::uint64_t removed = 0;
  for (int pass = 0; pass < 20; ++pass) {
    auto c = s->compact();
    ASSERT_TRUE(c) << "pass " << pass << ": " << c.error().message();
    if (c->segments_removed == 0) break;
    removed += c->segments_removed;
  }
  EXPECT_GT(removed, 2u);
  // Room again, and nothing kept was lost.
  EXPECT_TRUE(s->put("after", std::string(1024, 'a')));
  for (int i = 0; i < n; i += 3)
    ASSERT_TRUE(s->get(key_of(i))) << i;
}

TEST(KvBudget, TheIndexGrowsWithinTheBudgetToo) {
  keel::test::temp_dir dir;
  const std::uint64_t budget = 24 * mib;
  auto s = open_ok(dir.file("s"), budgeted(budget));
  ASSERT_TRUE(s);
  // Tiny values: the index, not the segments, is what grows.
  const int i = fill(*s, 1'000'000, "v");
  ASSERT_LT(i, 1'000'000);
  auto st = s->stats();
  ASSERT_TRUE(st);
  EXPECT_LE(st->segment_bytes + st->index_bytes, budget)
      << st->segment_bytes << " in segments, " << st->index_bytes << " in the index";
  EXPECT_TRUE(s->get(key_of(i - 1)));
  EXPECT_FALSE(s->get(key_of(i)));
}

TEST(KvBudget, ARefusedBigValueLeavesNoSegmentBehind) {
  keel::test::temp_dir dir;
  // A new index (1.5 MiB), the spare, the segment kept for deletes and 2.5 MiB: room for a
  // 2 MiB value's own segment, but then none for the segment its record goes to.
  auto s = open_ok(dir.file("s"), budgeted(6 * mib));
  ASSERT_TRUE(s);
  auto r = s->put("big", std::string(2 * mib, 'b'));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), errc::budget_reached);
  auto st = s->stats();
  ASSERT_TRUE(st);
  EXPECT_EQ(st->segment_bytes, 0u) << "the refused value's segment was left behind";
  EXPECT_TRUE(s->put("small", std::string(1024, 's')));
  EXPECT_FALSE(s->get("big"));
}

TEST(KvBudget, AnotherProcessIsHeldToItsOwnBudgetToo) {
  keel::test::temp_dir dir;
  auto s = open_ok(dir.file("s"), budgeted(8 * mib));
  ASSERT_TRUE(s);
  const int n = fill(*s, 100'000);
  ASSERT_LT(n, 100'000);
  const pid_t child = keel::test::fork_child([&] {
    auto mine = store::open(dir.file("s"), budgeted(8 * mib));
    if (!mine) return 10;
    auto r = (*mine)->put("from the child", std::string(64 * 1024, 'c'));
    if (r) return 11;
    if (r.error() != errc::budget_reached) return 12;
    // A delete works there too.
    return (*mine)->erase(key_of(0)) ? 0 : 13;
  });
  EXPECT_EQ(keel::test::wait_exit(child), 0);
  EXPECT_FALSE(s->get(key_of(0)));
  EXPECT_FALSE(s->get("from the child"));
}

// The bytes the store's files take on the volume, its directories too.
std::uint64_t bytes_taken(const std::string& path) {
  struct stat st {};
  const std::uint64_t own =
      ::lstat(path.c_str(), &st) == 0 ? static_cast<std::uint64_t>(st.st_blocks) * 512 : 0;
  return own + test_support::allocated_under(path);
}

// Values of every size beside 1 KiB ones, over 40 keys, under a budget of 20 MiB: blobs just
// under and over the size that gets a segment of its own, blobs whose segment would be a log
// segment's size, and values of 70-470 KB. Compaction keeps the largest victim as the spare
// in place when it takes the spare; that spare, smaller than a log segment that stayed, was
// grown to the size it must be with no look at the budget, and the files passed it by 240 KB
// (seed 3, op 196). The store's files are measured after every commit, on a private tmpfs
// (where a file takes exactly its blocks).
TEST(KvBudget, ValuesOfEverySizeComingAndGoingNeverTakeTheFilesPastTheBudget) {
  keel::test::temp_dir dir;
  const std::string mnt = dir.file("mnt");
  std::filesystem::create_directory(mnt);
  const std::uint64_t budget = 20 * mib;
  const pid_t child = keel::test::fork_child([&] {
    if (!keel::test::mount_private_tmpfs(mnt, 64 * mib)) return keel::test::cannot_set_up;
    for (const int seed : {3, 1, 2}) {
      const std::string path = mnt + "/s" + std::to_string(seed);
      options o;
      o.max_bytes = budget;
      auto opened = store::open(path, o);
      if (!opened) return 2;
      store& s = **opened;
      std::mt19937_64 random(seed);
      std::map<std::string, std::string> model;
      for (int op = 0; op < 400; ++op) {
        // The size segments are made at now (as next_segment_size: 256 KiB, doubling while the
        // log holds 16 such, up to 1 MiB here).
        auto stats = s.stats();
        if (!stats) return 3;
        std::uint64_t next = 256 * 1024;
        while (next < mib && next * 2 <= (stats->live_bytes + stats->dead_bytes) / 16)
          next *= 2;
        const std::string key = "k" + std::to_string(random() % 40);
        std::size_t length = 0;
        switch (random() % 4) {
          case 0:
            length = next - 112 + 8 * (random() % 3);
            break;
          case 1:
            length = 2 * next - 120 + 8 * (random() % 3);
            break;
          case 2:
            length = 70'000 + random() % 400'000;
            break;
          default:
            length = 100 + random() % 2000;
        }
        std::string value(length, static_cast<char>('a' + op % 26));
        auto put = s.put(key, value);
        if (put) {
          model[key] = std::move(value);
        } else if (put.error() == errc::budget_reached ||
                   put.error() == std::errc::no_space_on_device) {
          // At the budget: two keys go, which must work.
          for (int j = 0; j < 2 && !model.empty(); ++j) {
            auto it = std::next(model.begin(), static_cast<long>(random() % model.size()));
            if (auto e = s.erase(it->first); !e) {
              std::fprintf(stderr, "seed %d op %d: an erase at the budget failed: %s\n", seed, op,
                           e.error().message().c_str());
              return 4;
            }
            model.erase(it);
          }
        } else {
          std::fprintf(stderr, "seed %d op %d: a put failed: %s\n", seed, op,
                       put.error().message().c_str());
          return 5;
        }
        if (const std::uint64_t taken = bytes_taken(path); taken > budget) {
          std::fprintf(stderr, "seed %d op %d (a value of %zu bytes): the files take %ju bytes\n",
                       seed, op, length, static_cast<std::uintmax_t>(taken));
          return 6;
        }
      }
      for (const auto& [key, value] : model) {
        auto got = s.get(key);
        if (!got || *got != value) return 7;
      }
      if (!s.verify()) return 8;
    }
    return 0;
  });
  const int code = keel::test::wait_exit(child);
  if (code == keel::test::cannot_set_up) GTEST_SKIP() << "cannot mount a private tmpfs here";
  EXPECT_EQ(code, 0);
}

// A checkpoint asked for (store::checkpoint) is held to the budget too: on a store filled to
// it, the copy of the index did not fit, and was written all the same (the files passed a
// budget of 4 816 896 bytes by 65 536, and stayed past it after the next put and a reopen).
// Refused, it says budget_reached, and the store goes on.
TEST(KvBudget, ACheckpointAskedForOnAFullStoreStaysWithinTheBudget) {
  keel::test::temp_dir dir;
  const std::string mnt = dir.file("mnt");
  std::filesystem::create_directory(mnt);
  const std::uint64_t budget = 4'816'896;  // the least open takes for a new store here
  const pid_t child = keel::test::fork_child([&] {
    if (!keel::test::mount_private_tmpfs(mnt, 64 * mib)) return keel::test::cannot_set_up;
    const std::string path = mnt + "/s";
    options o;
    o.max_bytes = budget;
    auto opened = store::open(path, o);
    if (!opened) return 2;
    store& s = **opened;
    int n = 0;
    for (;; ++n) {
      auto r = s.put(key_of(n), std::string(1000, 'v'));
      if (r) continue;
      if (r.error() != errc::budget_reached) return 3;
      break;
    }
    auto c = s.checkpoint();
    if (!c && c.error() != errc::budget_reached) return 4;
    if (const std::uint64_t taken = bytes_taken(path); taken > budget) {
      std::fprintf(stderr, "after %d puts and a checkpoint (%s), the files take %ju bytes\n", n,
                   c ? "written" : c.error().message().c_str(), static_cast<std::uintmax_t>(taken));
      return 5;
    }
    // The store goes on: every key there, an erase and a smaller put go in.
    for (int i = 0; i < n; ++i)
      if (!s.get(key_of(i))) return 6;
    if (!s.erase(key_of(0)) || !s.put(key_of(0), "small")) return 7;
    return bytes_taken(path) > budget ? 8 : 0;
  });
  const int code = keel::test::wait_exit(child);
  if (code == keel::test::cannot_set_up) GTEST_SKIP() << "cannot mount a private tmpfs here";
  EXPECT_EQ(code, 0);
}

// The checkpoint a compaction writes is held to the budget with the other processes' puts: it
// was checked alone, and counted only once written, so another process's puts took the room
// it was checked against meanwhile, and the files stayed past a budget of 4 816 896 bytes by
// 65 536 for good. It is now charged, under the lock the puts' checks hold, before it is
// written. The other process puts while the new checkpoint is in place, before the header
// names it (the hook, in this process).
int checkpoint_to_other[2];
int other_to_checkpoint[2];

TEST(KvBudget, ACheckpointBeingWrittenIsCountedAgainstAnotherProcessesPuts) {
  const std::uint64_t budget = 4'816'896;
  test_support::on_small_volume(64, [&](const std::string& path) {
    options o;
    o.max_bytes = budget;
    o.compact_dead_fraction = 0;
    auto opened = store::open(path, o);
    if (!opened) return 2;
    store& s = **opened;
    // An index of some pages, and dead records for a compaction to remove.
    int n = 0;
    for (; n < 1500; ++n)
      if (!s.put(key_of(n), std::string(1000, 'v'))) break;
    for (int i = 0; i < n; i += 2)
      if (!s.erase(key_of(i))) return 3;
    if (::pipe(checkpoint_to_other) != 0 || ::pipe(other_to_checkpoint) != 0) return 4;
    const pid_t other = ::fork();
    if (other == 0) {
      auto mine = store::open(path, o);
      char c = 0;
      if (!mine || ::read(checkpoint_to_other[0], &c, 1) != 1) ::_exit(10);
      int code = 0;
      for (int k = 0;; ++k) {
        auto r = (*mine)->put("other-" + std::to_string(k), std::string(1000, 'o'));
        if (r) continue;
        if (r.error() != errc::budget_reached) code = 11;
        break;
      }
      if (code == 0 && bytes_taken(path) > budget) {
        std::fprintf(stderr, "the other process's puts took the files to %ju bytes\n",
                     static_cast<std::uintmax_t>(bytes_taken(path)));
        code = 12;
      }
      (void)!::write(other_to_checkpoint[1], "d", 1);
      ::_exit(code);
    }
    checkpoint_written_hook = []() noexcept {
      char c = 0;
      (void)!::write(checkpoint_to_other[1], "g", 1);
      (void)!::read(other_to_checkpoint[0], &c, 1);
      checkpoint_written_hook = nullptr;
    };
    auto c = s.compact();
    const bool waited = checkpoint_written_hook == nullptr;
    checkpoint_written_hook = nullptr;
    if (!waited) (void)!::write(checkpoint_to_other[1], "g", 1);  // no checkpoint written
    const int other_code = keel::test::wait_exit(other);
    if (!c) return 5;
    if (other_code != 0) return other_code;
    if (!waited) return 6;  // the case is not made
    if (const std::uint64_t taken = bytes_taken(path); taken > budget) {
      std::fprintf(stderr, "after the compaction, the files take %ju bytes\n",
                   static_cast<std::uintmax_t>(taken));
      return 7;
    }
    return 0;
  });
}

// A checkpointer killed between naming its copy and renaming it over `checkpoint` left the
// copy, which nothing counted once the next checkpoint (or a put that dropped the one there)
// set the word anew; only an opener alone removed it. Beside another user holding the store,
// the files stayed 159 232 bytes past a budget of 8 000 000 (found by review). The next
// checkpointer, or the checkpoint's removal, now removes such copies first.
TEST(KvBudget, ACheckpointerKilledBeforeItsRenameLeavesNothingPastTheBudget) {
  const std::uint64_t budget = 8'000'000;
  test_support::on_small_volume(64, [&](const std::string& path) {
    options o = budgeted(budget);
    o.segment_size = mib;
    {
      auto made = store::open(path, o);
      if (!made) return 2;
      for (int i = 0; i < 3000; ++i)
        if (!(*made)->put(key_of(i), std::string(300, 'v'))) return 3;
    }
    // A holder, open before the checkpointer starts: no later opener is alone (one alone
    // removes the copy itself; a holder opened late, on a busy machine, was alone after the
    // kill, and the case was not made). Killed if the test ends early, so that nothing waits
    // for it.
    const keel::test::signal_pipe ready, go;
    struct holding {
      pid_t pid = 0;
      ~holding() {
        if (pid > 0) {
          ::kill(pid, SIGKILL);
          (void)keel::test::wait_exit(pid);
        }
      }
    } holder;
    holder.pid = keel::test::fork_child([&] {
      auto s = store::open(path, o);
      if (!s) return 1;
      ready.notify();
      return go.wait() == 'd' ? 0 : 1;
    });
    if (ready.wait() != '!') return 4;
    const pid_t killed = keel::test::fork_child([&] {
      auto s = store::open(path, o);
      if (!s) return 1;
      checkpoint_replace_hook = [](io::replace_step step, void*) noexcept {
        if (step == io::replace_step::rename) ::raise(SIGKILL);
      };
      (void)(*s)->checkpoint();
      return 2;
    });
    if (keel::test::wait_exit(killed) != 128 + SIGKILL) return 5;
    const auto leftovers = [&] {
      int n = 0;
      for (const auto& e : std::filesystem::directory_iterator(path))
        n += e.path().filename().string().starts_with(".checkpoint.keel-tmp.") ? 1 : 0;
      return n;
    };
    if (leftovers() != 1) return 6;  // the case is not made
    auto s = store::open(path, o);
    if (!s) return 7;
    if (!(*s)->checkpoint()) return 8;
    if (leftovers() != 0) return 9;
    for (int i = 0;; ++i) {
      auto r = (*s)->put("more-" + std::to_string(i), std::string(1000, 'm'));
      if (r) continue;
      if (r.error() != errc::budget_reached) return 10;
      break;
    }
    const std::uint64_t taken = bytes_taken(path);
    go.notify('d');
    const pid_t was = std::exchange(holder.pid, 0);
    if (keel::test::wait_exit(was) != 0) return 11;
    if (taken > budget) {
      std::fprintf(stderr, "at the budget, the files take %ju bytes\n",
                   static_cast<std::uintmax_t>(taken));
      return 12;
    }
    return 0;
  });
}

}  // namespace
}  // namespace keel::kv
