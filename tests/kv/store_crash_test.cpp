// Power cuts and failed syncs, on the fault seam's model of what survives (torn writes
// included): every `sync` commit that returned is there afterwards, nothing half-applied is,
// and a failed fdatasync is reported and never papered over.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "keel/io/fault_filesystem.hpp"
#include "keel/kv/store.hpp"
#include "kv/kv_support.hpp"
#include "kv/store_impl.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;
using test::wait_exit;

std::string value_of(int i, int round) {
  return std::to_string(i) + ":" + std::to_string(round) +
         std::string(static_cast<std::size_t>(i % 7) * 100, 'v');
}

// A directory the fault seam tracks (a power cut applies to it), its shadow, and the store in
// it.
struct power_cut_dirs {
  temp_dir base;
  std::string root = base.file("root"), shadow = base.file("shadow"), path = root + "/store";
  power_cut_dirs() { std::filesystem::create_directory(root); }
  // What the power cut left (torn writes included), then a reboot: the index, a cache of one
  // boot, goes and is rebuilt by the next open.
  [[nodiscard]] bool restore_and_reboot(std::uint64_t seed) const {
    forget_lock_map();
    if (!io::fault_filesystem::restore(root, shadow, {.torn = true, .seed = seed})) return false;
    std::filesystem::remove(path + "/index");
    return true;
  }
  // A reboot empties /dev/shm, where the lock file's shared map lives (doc/lock-formats.md,
  // memory_map): without this, each cut whose restored lock file no longer names the map
  // left it there for good.
  void forget_lock_map() const {
    std::ifstream f(path + "/lock", std::ios::binary);
    std::array<char, 256> header{};
    if (!f.read(header.data(), header.size())) return;
    const std::string map(header.data() + 48, ::strnlen(header.data() + 48, 208));
    if (map.starts_with("/dev/shm/keel-mm-")) std::filesystem::remove(map);
  }
};

// A writer commits `sync` transactions (two keys each, so a half-applied one shows) and
// reports each one that returned; the power goes at the nth sync or write of the store's
// files. After the restore (a reboot: the index, a cache of this boot, is rebuilt), every
// reported commit is there, whole. With `checkpoint_bytes`, checkpoints are written all
// along (the power may go during one) and the rebuild starts from the last one that made it.
void power_cut_run(int nth, std::uint64_t checkpoint_bytes) {
  const power_cut_dirs dirs;
  const std::string &root = dirs.root, &shadow = dirs.shadow, &path = dirs.path;
  {
    options o;
    o.segment_size = std::uint64_t{1} << 20;
    ASSERT_TRUE(store::open(path, o));
  }
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t child = fork_child([&] {
    ::close(fds[0]);
    io::fault_filesystem fs(io::os(), static_cast<std::uint64_t>(nth));
    if (!fs.track(root, shadow)) return 1;
    options o;
    o.segment_size = std::uint64_t{1} << 20;
    o.durable = durability::sync;
    o.checkpoint_bytes = checkpoint_bytes;
    o.fs = &fs;
    auto s = store::open(path, o);
    if (!s) return 2;
    // A segment is synced through its map (msync), any other file by fsync.
    fs.inject({.on = io::fs_ops(io::fs_op::sync) | io::fs_op::sync_map,
               .nth = static_cast<std::uint64_t>(nth),
               .crash = true});
    for (int round = 0;; ++round) {
      auto t = (*s)->begin();
      if (!t) return 3;
      const int i = round % 40;
      if (!t->put("a" + std::to_string(i), value_of(i, round)) ||
          !t->put("b" + std::to_string(i), value_of(i, round))) {
        return 4;
      }
      if (!t->commit()) return 5;
      const int ack = round;
      if (::write(fds[1], &ack, sizeof ack) != sizeof ack) return 6;
    }
  });
  ::close(fds[1]);
  std::map<int, int> last;  // key number -> last acknowledged round
  int ack = 0;
  int acks = 0;
  while (::read(fds[0], &ack, sizeof ack) == sizeof ack) {
    last[ack % 40] = ack;
    ++acks;
  }
  ::close(fds[0]);
  ASSERT_EQ(wait_exit(child), 128 + SIGKILL);
  ASSERT_TRUE(dirs.restore_and_reboot(static_cast<std::uint64_t>(nth)));
  auto s = store::open(path);
  ASSERT_TRUE(s) << s.error().message();
  for (int i = 0; i < 40; ++i) {
    auto a = (*s)->get("a" + std::to_string(i));
    auto b = (*s)->get("b" + std::to_string(i));
    if (!a) {
      ASSERT_EQ(a.error(), errc::not_found) << a.error().message();
      EXPECT_FALSE(last.contains(i)) << "acknowledged and lost: key " << i;
      EXPECT_FALSE(b) << "half a commit: key " << i;
      continue;
    }
    ASSERT_TRUE(b) << "half a commit: key " << i;
    EXPECT_EQ(*a, *b) << "half a commit: key " << i;
    if (last.contains(i)) {
      const int seen = std::stoi(a->substr(a->find(':') + 1));
      EXPECT_GE(seen, last[i]) << "an acknowledged commit of key " << i << " was lost";
      EXPECT_EQ(*a, value_of(i, seen));
    }
  }
  auto v = (*s)->verify();
  EXPECT_TRUE(v) << v.error().message();
  if (checkpoint_bytes != 0) {
    // Rebuilt from a checkpoint: its counters agree with what is there.
    auto st = (*s)->stats();
    ASSERT_TRUE(st);
    std::uint64_t records = 0;
    for (int i = 0; i < 40; ++i) {
      records += (*s)->get("a" + std::to_string(i)) ? 2 : 0;
    }
    EXPECT_EQ(st->records, records);
    if (nth >= 20) {
      EXPECT_GT(st->checkpoint_seq, 0u) << "rebuilt without a checkpoint";
    }
  }
  ::testing::Test::RecordProperty("acknowledged", acks);
}

class KvStorePowerCut : public ::testing::TestWithParam<int> {};

TEST_P(KvStorePowerCut, EveryAcknowledgedSyncCommitSurvivesWhole) {
  power_cut_run(GetParam(), 0);
}

INSTANTIATE_TEST_SUITE_P(AtTheNthSync, KvStorePowerCut, ::testing::Values(1, 2, 3, 5, 8, 13, 30));

class KvStorePowerCutWithCheckpoints : public ::testing::TestWithParam<int> {};

TEST_P(KvStorePowerCutWithCheckpoints, EveryAcknowledgedSyncCommitSurvivesWhole) {
  power_cut_run(GetParam(), std::uint64_t{16} << 10);
}

INSTANTIATE_TEST_SUITE_P(AtTheNthSync, KvStorePowerCutWithCheckpoints,
                         ::testing::Values(1, 2, 3, 4, 5, 7, 9, 12, 20, 40, 80));

// A compaction loses power at its nth sync of a file or of a directory: after the restore
// (torn writes included) and a rebuild, every value is the one it had.
struct compact_cut {
  io::fs_op on;
  int nth;
};

void PrintTo(const compact_cut& c, std::ostream* os) {
  *os << (c.on == io::fs_op::sync ? "file sync " : "directory sync ") << c.nth;
}

class KvCompactPowerCut : public ::testing::TestWithParam<compact_cut> {};

TEST_P(KvCompactPowerCut, EveryValueSurvives) {
  const compact_cut cut = GetParam();
  const power_cut_dirs dirs;
  const std::string &root = dirs.root, &shadow = dirs.shadow, &path = dirs.path;
  options o;
  o.segment_size = std::uint64_t{1} << 20;
  constexpr int keys = 1200;
  std::map<int, int> want;
  {
    o.durable = durability::sync;
    auto s = store::open(path, o);
    ASSERT_TRUE(s) << s.error().message();
    for (int round = 0; round < 3; ++round) {
      for (int i = 0; i < keys; ++i) {
        if (round == 2 && i % 3 == 0) continue;  // live records left in older segments
        auto t = (*s)->begin();
        ASSERT_TRUE(t);
        ASSERT_TRUE(t->put("k" + std::to_string(i), value_of(i, round)));
        ASSERT_TRUE(t->commit(round == 2 && i == keys - 1 ? durability::sync : durability::none));
        want[i] = round;
      }
    }
  }
  const pid_t child = fork_child([&] {
    io::fault_filesystem fs(io::os(), static_cast<std::uint64_t>(cut.nth));
    if (!fs.track(root, shadow)) return 1;
    options mine = o;
    mine.fs = &fs;
    auto s = store::open(path, mine);
    if (!s) return 2;
    const io::fs_ops on = cut.on == io::fs_op::sync
                              ? io::fs_ops(io::fs_op::sync) | io::fs_op::sync_map
                              : io::fs_ops(cut.on);
    fs.inject({.on = on, .nth = static_cast<std::uint64_t>(cut.nth), .crash = true});
    auto c = (*s)->compact();
    if (!c) return 3;
    return c->segments_removed > 0 ? 0 : 4;
  });
  const int code = wait_exit(child);
  ASSERT_TRUE(code == 128 + SIGKILL || code == 0) << "exit " << code;
  ASSERT_TRUE(dirs.restore_and_reboot(static_cast<std::uint64_t>(cut.nth)));
  auto s = store::open(path);
  ASSERT_TRUE(s) << s.error().message();
  int bad = 0;
  for (const auto& [i, round] : want) {
    auto v = (*s)->get("k" + std::to_string(i));
    if ((!v || *v != value_of(i, round)) && bad++ < 5) {
      ADD_FAILURE() << "k" << i << ": " << (v ? v->substr(0, 12) : v.error().message());
    }
  }
  auto v = (*s)->verify();
  EXPECT_TRUE(v) << v.error().message();
}

INSTANTIATE_TEST_SUITE_P(
    AtTheNthSync, KvCompactPowerCut,
    ::testing::Values(compact_cut{io::fs_op::sync, 1}, compact_cut{io::fs_op::sync, 2},
                      compact_cut{io::fs_op::sync, 3}, compact_cut{io::fs_op::sync, 5},
                      compact_cut{io::fs_op::sync_directory, 1},
                      compact_cut{io::fs_op::sync_directory, 2},
                      compact_cut{io::fs_op::sync_directory, 3},
                      // Past the copies: a victim kept as the spare or
                      // the next segment (renamed, zeroed, renamed).
                      compact_cut{io::fs_op::sync, 4}, compact_cut{io::fs_op::sync, 6},
                      compact_cut{io::fs_op::sync, 7}, compact_cut{io::fs_op::sync_directory, 4},
                      compact_cut{io::fs_op::sync_directory, 5},
                      compact_cut{io::fs_op::sync, 1000}),
    [](const auto& p) {
      return std::string(p.param.on == io::fs_op::sync ? "File" : "Dir") +
             std::to_string(p.param.nth);
    });

// A sync leader killed after it took the dirty bits and before it synced anything: the next
// sync commit syncs every segment, not only the one it wrote in, so the commits before it
// that lay in an older segment survive a power cut too.
TEST(KvStoreSync, ALeaderKilledAfterTakingTheDirtyBitsLeavesNothingUnsynced) {
  const power_cut_dirs dirs;
  options o;
  o.segment_size = std::uint64_t{1} << 20;
  ASSERT_TRUE(store::open(dirs.path, o));
  constexpr int keys = 1500;  // 1.5 MiB of unsynced commits: into a second segment
  // In a child: the store, through a filesystem that tracks what a power cut keeps.
  const auto open_tracked = [&](io::fault_filesystem& fs) -> result<std::unique_ptr<store>> {
    if (auto t = fs.track(dirs.root, dirs.shadow); !t) return std::unexpected(t.error());
    options mine = o;
    mine.fs = &fs;
    return store::open(dirs.path, mine);
  };
  const pid_t victim = fork_child([&] {
    io::fault_filesystem fs;
    auto s = open_tracked(fs);
    if (!s) return 2;
    for (int i = 0; i < keys; ++i)
      if (!(*s)->put("a" + std::to_string(i), value_of(i, 1) + std::string(1000, 'a'))) return 3;
    commit_hook = [](commit_step at) noexcept {
      if (at == commit_step::syncing) ::raise(SIGKILL);
    };
    auto t = (*s)->begin();
    if (!t || !t->put("b", "1")) return 4;
    (void)t->commit(durability::sync);
    return 5;  // not killed
  });
  ASSERT_EQ(wait_exit(victim), 128 + SIGKILL);
  const pid_t next = fork_child([&] {
    io::fault_filesystem fs;
    auto s = open_tracked(fs);
    if (!s) return 2;
    auto t = (*s)->begin();
    if (!t || !t->put("c", "1") || !t->commit(durability::sync)) return 3;
    fs.crash_now();  // the power goes as soon as the sync commit returned
  });
  ASSERT_EQ(wait_exit(next), 128 + SIGKILL);
  ASSERT_TRUE(dirs.restore_and_reboot(7));
  auto s = store::open(dirs.path, o);
  ASSERT_TRUE(s) << s.error().message();
  EXPECT_EQ(*(*s)->get("c"), "1");
  int lost = 0;
  for (int i = 0; i < keys; ++i)
    lost += (*s)->get("a" + std::to_string(i)) ? 0 : 1;
  EXPECT_EQ(lost, 0) << "commits before an acknowledged sync commit were lost";
}

TEST(KvStoreSync, AFailedFdatasyncIsReportedAndTheStoreTurnsReadOnly) {
  temp_dir dir;
  const std::string path = dir.file("s");
  io::fault_filesystem fs;
  options o;
  o.segment_size = std::uint64_t{1} << 20;
  o.durable = durability::sync;
  o.fs = &fs;
  auto s = store::open(path, o);
  ASSERT_TRUE(s) << s.error().message();
  ASSERT_TRUE((*s)->put("a", "1"));
  fs.inject({.on = io::fs_ops(io::fs_op::sync) | io::fs_op::sync_map, .nth = 1, .error = EIO});
  auto r = (*s)->put("b", "2");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), std::errc::io_error) << r.error().message();
  auto after = (*s)->put("c", "3");
  ASSERT_FALSE(after) << "never retried, never forgotten";
  EXPECT_EQ(after.error(), errc::sync_failed) << after.error().message();
  EXPECT_NE(after.error().message().find("/seg/0000000000000001"), std::string::npos)
      << "names the file whose sync failed: " << after.error().message();
  EXPECT_EQ(*(*s)->get("a"), "1");
}

// A writer (or a compactor, its copies) killed after writing records and before its block's
// header leaves bytes past the last block a rebuild finds. The rebuild put the tail on that
// zero header: every block written over the bytes after it could not be sealed (its seq word
// was not zero), and each put there failed with timed_out (31 in a row after a compactor was
// killed mid-copy, found by review). The rebuild now spans them as a block keel left on
// purpose and puts the tail past them; a rebuild after a clean close (which records them as
// durable) steps over that block.
TEST(KvRebuild, BytesAKilledWriterLeftPastTheLastBlockAreSteppedOverAndPutsGoOn) {
  temp_dir dir;
  const std::string path = dir.file("s");
  options o = test_support::manual_compaction();
  {
    auto s = store::open(path, o);
    ASSERT_TRUE(s) << s.error().message();
    for (int i = 0; i < 100; ++i)
      ASSERT_TRUE((*s)->put("k" + std::to_string(i), value_of(i, 0)));
  }
  // The tail's segment: the highest-numbered one. Its blocks end at its last non-zero byte.
  std::string tail_segment;
  for (const auto& e : std::filesystem::directory_iterator(path + "/seg")) {
    const std::string name = e.path().filename().string();
    if (name != "spare" && name != "deletes" && name > tail_segment) tail_segment = name;
  }
  ASSERT_FALSE(tail_segment.empty());
  {
    std::fstream f(path + "/seg/" + tail_segment, std::ios::in | std::ios::out | std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::size_t end = bytes.size();
    while (end > 0 && bytes[end - 1] == 0)
      --end;
    end = (end + 7) / 8 * 8;
    // A block's header never written (48 zero bytes), its records written after it.
    const std::size_t records_at = end + sizeof(disk::block_header);
    ASSERT_LT(records_at + 3000, bytes.size());
    f.seekp(static_cast<std::streamoff>(records_at));
    const std::string records(3000, 'R');
    f.write(records.data(), static_cast<std::streamsize>(records.size()));
    ASSERT_TRUE(f.flush());
  }
  for (int round = 1; round <= 3; ++round) {
    SCOPED_TRACE("rebuild " + std::to_string(round));
    std::filesystem::remove(path + "/index");
    std::filesystem::remove(path + "/checkpoint");
    auto s = store::open(path, o);
    ASSERT_TRUE(s) << s.error().message();
    for (int i = 0; i < 100; ++i) {
      auto v = (*s)->get("k" + std::to_string(i));
      ASSERT_TRUE(v) << v.error().message();
      EXPECT_EQ(*v, value_of(i, i < 50 || round == 1 ? 0 : round - 1));
    }
    for (int i = 50; i < 100; ++i) {
      auto r = (*s)->put("k" + std::to_string(i), value_of(i, round));
      ASSERT_TRUE(r) << "put " << i << ": " << r.error().message();
    }
    verify_report report;
    auto checked = (*s)->verify(&report);
    EXPECT_TRUE(checked) << checked.error().message();
    EXPECT_TRUE(report.damaged.empty()) << report.damaged.size() << " damaged";
  }
}

}  // namespace
}  // namespace keel::kv
