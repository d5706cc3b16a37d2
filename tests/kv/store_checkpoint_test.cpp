// Checkpoints: after a reboot (the index, a cache of one boot, is gone) the next open loads
// the last checkpoint and replays only the log written since; what it rebuilds is exactly
// what the store held, counters included. A checkpoint that does not check out is passed
// over (the whole log is replayed), never trusted.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "keel/kv/store.hpp"
#include "kv/store_impl.hpp"
#include "kv_support.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;
using test::wait_exit;
using test_support::manual_compaction;
using test_support::open_ok;
using test_support::small;

std::string value_of(int i, int round) {
  return std::to_string(i) + "/" + std::to_string(round) + std::string(900 + i % 200, 'c');
}

// What a reboot does to a store: its index goes (it is rebuilt by the next open).
void reboot(const std::string& path) {
  std::filesystem::remove(path + "/index");
}

// Every key and value the store holds, through a scan.
std::map<std::string, std::string> contents(store& s) {
  std::map<std::string, std::string> out;
  std::string cursor;
  for (;;) {
    auto page = s.scan(cursor, 500);
    if (!page) {
      ADD_FAILURE() << page.error().message();
      return out;
    }
    for (auto& it : page->items)
      out.emplace(std::move(it.key), std::move(it.value));
    if (page->done) return out;
    cursor = page->cursor;
  }
}

std::string file_bytes(const std::string& path) {
  std::string out(std::filesystem::file_size(path), '\0');
  std::ifstream in(path, std::ios::binary);
  in.read(out.data(), static_cast<std::streamsize>(out.size()));
  EXPECT_EQ(in.gcount(), static_cast<std::streamsize>(out.size())) << path;
  return out;
}

std::uint64_t log_bytes(const std::string& path) {
  std::uint64_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(path + "/seg")) {
    // The spare and the deletes' room hold no log.
    if (e.path().filename() != "spare" && e.path().filename() != "deletes") n += e.file_size();
  }
  return n;
}

// Fills `keys` keys (about 1 KiB each) over three rounds, erasing every fifth key in the last:
// the model of what the store holds.
std::map<std::string, std::string> fill(store& s, int keys) {
  std::map<std::string, std::string> model;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < keys; ++i) {
      const std::string k = "key" + std::to_string(i);
      if (round == 2 && i % 5 == 0) {
        EXPECT_TRUE(s.erase(k));
        model.erase(k);
        continue;
      }
      EXPECT_TRUE(s.put(k, value_of(i, round)));
      model[k] = value_of(i, round);
    }
  }
  return model;
}

TEST(KvCheckpoint, ARebuildReplaysOnlyTheLogWrittenSinceTheCheckpoint) {
  temp_dir d;
  const std::string path = d.file("s");
  std::map<std::string, std::string> model;
  store_stats before;
  {
    auto s = open_ok(path, manual_compaction());
    ASSERT_TRUE(s);
    model = fill(*s, 2000);  // about 6 MiB of log in 1 MiB segments
    ASSERT_TRUE(s->checkpoint());
    // A little more after it: updates, erases and new keys, the tail replay must apply.
    for (int i = 0; i < 100; ++i) {
      const std::string k = "key" + std::to_string(i * 7);
      if (i % 4 == 0) {
        if (model.erase(k) == 1) {
          ASSERT_TRUE(s->erase(k));
        }
      } else {
        ASSERT_TRUE(s->put(k, value_of(i, 9)));
        model[k] = value_of(i, 9);
      }
      ASSERT_TRUE(s->put("new" + std::to_string(i), value_of(i, 10)));
      model["new" + std::to_string(i)] = value_of(i, 10);
    }
    auto st = s->stats();
    ASSERT_TRUE(st);
    before = *st;
    EXPECT_GT(before.checkpoint_seq, 0u);
    EXPECT_LT(before.unchecked_bytes, std::uint64_t{1} << 20);
  }
  const std::uint64_t log = log_bytes(path);
  ASSERT_GT(log, std::uint64_t{5} << 20);

  reboot(path);
  {
    auto s = open_ok(path, manual_compaction());
    ASSERT_TRUE(s);
    auto st = s->stats();
    ASSERT_TRUE(st);
    EXPECT_LE(st->replayed_bytes, std::uint64_t{2} << 20) << "of " << log << " bytes of log";
    EXPECT_GT(st->replayed_bytes, 0u);
    EXPECT_EQ(contents(*s), model);
    EXPECT_EQ(st->records, model.size());
    EXPECT_EQ(st->live_bytes, before.live_bytes);
    EXPECT_NEAR(static_cast<double>(st->dead_bytes), static_cast<double>(before.dead_bytes),
                double{1 << 20});  // an estimate (see store_stats)
    EXPECT_EQ(st->visible_seq, before.visible_seq);
    ASSERT_TRUE(s->verify());
    // And the store goes on: new commits after the loaded copy.
    ASSERT_TRUE(s->put("after", "reboot"));
    model["after"] = "reboot";
  }
  // Without the checkpoint, the whole log is replayed, to the same store.
  reboot(path);
  std::filesystem::remove(path + "/checkpoint");
  auto s = open_ok(path, manual_compaction());
  ASSERT_TRUE(s);
  auto st = s->stats();
  ASSERT_TRUE(st);
  EXPECT_GE(st->replayed_bytes, log);
  EXPECT_EQ(contents(*s), model);
  EXPECT_EQ(st->records, model.size());
}

TEST(KvCheckpoint, CommitsHaveThemWrittenAsTheLogGrows) {
  temp_dir d;
  const std::string path = d.file("s");
  options o = small();
  o.checkpoint_bytes = std::uint64_t{256} << 10;
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  std::set<std::uint64_t> seen;
  const auto caught_up = [&] {
    // Written by a thread of this process: wait (a while) for it to catch up.
    for (int tries = 0; tries < 2000; ++tries) {
      auto st = s->stats();
      if (!st) {
        ADD_FAILURE() << st.error().message();
        return;
      }
      EXPECT_EQ(st->checkpoint_errno, 0);
      seen.insert(st->checkpoint_seq);
      if (st->unchecked_bytes < o.checkpoint_bytes) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ADD_FAILURE() << "the log since the last checkpoint stays past the interval";
  };
  for (int i = 0; i < 3000; ++i) {
    ASSERT_TRUE(s->put("k" + std::to_string(i), value_of(i, 0)));
    if (i % 300 == 299) caught_up();
  }
  seen.erase(0);
  EXPECT_GE(seen.size(), 8u);  // about 3 MiB of log, a checkpoint every 256 KiB at least
  EXPECT_TRUE(std::filesystem::exists(path + "/checkpoint"));
}

// Damaged checkpoints of every kind: the open passes them over and replays the whole log.
TEST(KvCheckpoint, OneThatDoesNotCheckOutIsPassedOver) {
  temp_dir d;
  const std::string path = d.file("s");
  std::map<std::string, std::string> model;
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    model = fill(*s, 600);
    ASSERT_TRUE(s->checkpoint());
  }
  const std::string cp = path + "/checkpoint";
  const auto size = std::filesystem::file_size(cp);
  const std::string good = file_bytes(cp);
  ASSERT_EQ(good.size(), size);
  // Another store's checkpoint, made the same way.
  std::string foreign;
  {
    const std::string other = d.file("other");
    auto s = open_ok(other);
    ASSERT_TRUE(s);
    (void)fill(*s, 600);
    ASSERT_TRUE(s->checkpoint());
    foreign = file_bytes(other + "/checkpoint");
  }
  struct damage {
    const char* what;
    std::string bytes;
  };
  std::vector<damage> cases;
  for (const std::size_t at :
       {std::size_t{0}, std::size_t{44}, std::size_t{4096 + 100}, size / 2, size - 9, size - 1}) {
    std::string b = good;
    b[at] = static_cast<char>(b[at] ^ 0x20);
    cases.push_back({"a flipped byte", b});
  }
  cases.push_back({"cut short", good.substr(0, size - 4096)});
  cases.push_back({"empty", ""});
  cases.push_back({"grown", good + std::string(4096, '\0')});
  cases.push_back({"another store's", foreign});
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    {
      std::ofstream out(cp, std::ios::binary | std::ios::trunc);
      out << c.bytes;
    }
    reboot(path);
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    auto st = s->stats();
    ASSERT_TRUE(st);
    EXPECT_GE(st->replayed_bytes, log_bytes(path) - (std::uint64_t{1} << 20));
    EXPECT_EQ(contents(*s), model);
    EXPECT_EQ(st->records, model.size());
  }
}

// Checkpoints copied while writer processes commit are exact as of their seq: the writers are
// killed (SIGKILL, mid-commit) just after one, and a reboot rebuilds from it and the log
// since to what the store held before the reboot, counters included.
TEST(KvCheckpoint, CopiesTakenDuringCommitsAreExact) {
  temp_dir d;
  const std::string path = d.file("s");
  { ASSERT_TRUE(open_ok(path)); }
  for (int pass = 0; pass < 4; ++pass) {
    SCOPED_TRACE("pass " + std::to_string(pass));
    std::vector<pid_t> writers;
    for (int w = 0; w < 3; ++w) {
      writers.push_back(fork_child([&] {
        // No compaction in the background: these writers outrun it, and the checkpoints
        // asked for here would wait for ever longer runs.
        auto s = store::open(path, manual_compaction());
        if (!s) return 1;
        for (int round = 0;; ++round) {
          auto t = (*s)->begin();
          if (!t) return 2;
          // Overlapping keys, several per commit, some erased.
          for (int j = 0; j < 3; ++j) {
            const int i = (round * 7 + j * 13 + w + pass) % 300;
            const std::string k = "k" + std::to_string(i);
            if ((round + j) % 5 == 0) {
              if (!t->erase(k)) return 3;
            } else if (!t->put(k, value_of(i, round))) {
              return 4;
            }
          }
          // And a new key each time: pages split (and the directory doubles) while
          // checkpoints copy them.
          if (!t->put("n" + std::to_string(pass) + "." + std::to_string(w) + "." +
                          std::to_string(round),
                      "x")) {
            return 6;
          }
          auto c = t->commit();
          if (!c && c.error() != errc::conflict) return 5;
        }
      }));
    }
    {
      // Nor here. (Open defect: with this opener's background compaction racing the
      // commits and the kills, the rebuild below counted one record fewer than it held.)
      auto s = open_ok(path, manual_compaction());
      ASSERT_TRUE(s);
      // Twenty checkpoints at least, and until one holds commits the writers made since the
      // pass began (on a busy machine they may not have made any by the twentieth: the
      // reboot then replays the whole log, rightly). A writer that stops has failed.
      auto before = s->stats();
      ASSERT_TRUE(before);
      bool writers_going = true;
      for (int i = 0; writers_going; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        auto c = s->checkpoint();
        ASSERT_TRUE(c) << c.error().message();
        auto st = s->stats();
        ASSERT_TRUE(st);
        if (i >= 19 && st->checkpoint_seq >= before->visible_seq + 50) break;
        for (const pid_t p : writers) {
          int status = 0;
          if (::waitpid(p, &status, WNOHANG) == p) {
            ADD_FAILURE() << "a writer stopped: status " << status;
            writers_going = false;
          }
        }
      }
      for (const pid_t p : writers)
        ::kill(p, SIGKILL);
      if (!writers_going) return;
    }
    for (const pid_t p : writers)
      EXPECT_EQ(wait_exit(p), 128 + SIGKILL);

    std::map<std::string, std::string> held;
    {
      auto s = open_ok(path, manual_compaction());  // alone: settles what the writers left
      ASSERT_TRUE(s);
      held = contents(*s);
    }
    reboot(path);
    auto s = open_ok(path, manual_compaction());
    ASSERT_TRUE(s);
    auto st = s->stats();
    ASSERT_TRUE(st);
    EXPECT_LT(st->replayed_bytes, log_bytes(path));
    EXPECT_EQ(contents(*s), held);
    EXPECT_EQ(st->records, held.size());
    ASSERT_TRUE(s->verify());
  }
}

// A compaction removes segments the last checkpoint may name: it deletes that checkpoint
// first and writes a new one after. A reboot then replays little and loses nothing.
TEST(KvCheckpoint, CompactionLeavesACheckpointOfTheCopies) {
  temp_dir d;
  const std::string path = d.file("s");
  std::map<std::string, std::string> model;
  {
    auto s = open_ok(path, manual_compaction());
    ASSERT_TRUE(s);
    model = fill(*s, 1500);
    ASSERT_TRUE(s->checkpoint());
    auto c = s->compact();
    ASSERT_TRUE(c) << c.error().message();
    ASSERT_GT(c->segments_removed, 0u);
    auto st = s->stats();
    ASSERT_TRUE(st);
    EXPECT_EQ(st->checkpoint_errno, 0);
    EXPECT_LT(st->unchecked_bytes, std::uint64_t{1} << 20);
  }
  reboot(path);
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  auto st = s->stats();
  ASSERT_TRUE(st);
  EXPECT_LT(st->replayed_bytes, std::uint64_t{2} << 20);
  EXPECT_EQ(contents(*s), model);
  EXPECT_EQ(st->records, model.size());
  ASSERT_TRUE(s->verify());
}

// A writer killed holding its slot in flight (reserved, or made visible but not yet idle)
// does not hold the replay start back: checkpoints after it still bound the replay.
class KvCheckpointDeadWriter : public ::testing::TestWithParam<commit_step> {};

TEST_P(KvCheckpointDeadWriter, DoesNotPinTheReplayStart) {
  temp_dir d;
  const std::string path = d.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("before", "x"));
  const pid_t victim = fork_child([&] {
    auto mine = store::open(path, small());
    if (!mine) return 2;
    test_support::die_at(GetParam());
    (void)(*mine)->put("victim", "v");
    return 4;
  });
  ASSERT_EQ(wait_exit(victim), 128 + SIGKILL);
  for (int i = 0; i < 2000; ++i)
    ASSERT_TRUE(s->put("k" + std::to_string(i), value_of(i, 0)));
  ASSERT_TRUE(s->checkpoint());
  auto st = s->stats();
  ASSERT_TRUE(st);
  EXPECT_LT(st->unchecked_bytes, std::uint64_t{64} << 10) << "of " << log_bytes(path);
}

INSTANTIATE_TEST_SUITE_P(KilledAt, KvCheckpointDeadWriter,
                         ::testing::Values(commit_step::reserved, commit_step::visible),
                         [](const auto& p) {
                           return p.param == commit_step::reserved ? std::string("Reserved")
                                                                   : std::string("Visible");
                         });

TEST(KvCheckpoint, AReadOnlyStoreRefusesToWriteOne) {
  temp_dir d;
  const std::string path = d.file("s");
  { ASSERT_TRUE(open_ok(path)); }
  options o = small();
  o.read_only = true;
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  auto c = s->checkpoint();
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error(), errc::read_only);
  EXPECT_FALSE(std::filesystem::exists(path + "/checkpoint"));
}

// The log bytes since the checkpoint count the segments there are, not segment numbers: a
// store whose numbers jump (compactions removing segments hand out new numbers for good) read
// gigabytes of replay where the log held a megabyte, past 4 096 numbers (found by review:
// 5.6 GB against under 3 MB, between a compaction and the next checkpoint).
TEST(KvCheckpoint, TheLogSinceTheCheckpointCountsSegmentsThereNotNumbers) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path, manual_compaction());
    ASSERT_TRUE(s);
    for (int i = 0; i < 100; ++i)
      ASSERT_TRUE(s->put("k" + std::to_string(i), std::string(1024, 'v')));
  }
  // Numbers below 10 000 handed out (as if compactions had come and gone), and the index
  // rebuilt from the log, which numbers new segments from there.
  ASSERT_GT(test_support::rewrite_manifest_slots(
                path,
                [](disk::manifest m, const store_dir& d) {
                  m.numbered_below = 10'000;
                  const auto bytes = disk::encode_manifest(d.params.id, m, d.params.salt);
                  return std::vector<std::byte>(bytes.begin(), bytes.end());
                }),
            0);
  std::filesystem::remove(path + "/index");
  auto s = open_ok(path, manual_compaction());
  ASSERT_TRUE(s);
  for (int i = 100; i < 1500; ++i)
    ASSERT_TRUE(s->put("k" + std::to_string(i), std::string(1024, 'v')));
  auto st = s->stats();
  ASSERT_TRUE(st);
  ASSERT_GE(st->segments, 2u);
  std::uint64_t log = 0;
  for (const auto& e : std::filesystem::directory_iterator(path + "/seg"))
    log += e.file_size();
  EXPECT_LE(st->unchecked_bytes, log) << "segments " << st->segments;
}

}  // namespace
}  // namespace keel::kv
