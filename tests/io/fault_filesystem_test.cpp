// The fault filesystem: its rules fail exactly what they say, a failed fsync loses the unsynced
// writes as Linux does, and a power cut keeps what was made durable and nothing else.

#include "keel/io/fault_filesystem.hpp"

#include <signal.h>
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "keel/io/file_handle.hpp"
#include "keel/io/mapped_file.hpp"
#include "support/process.hpp"

namespace keel::io {
namespace {

using keel::test::temp_dir;
using fault = fault_filesystem::fault;

constexpr open_flags create_rw = open_flags::read_write | open_flags::create;

std::vector<std::byte> text(std::string_view s) {
  std::vector<std::byte> v(s.size());
  std::memcpy(v.data(), s.data(), s.size());
  return v;
}

std::string content_of(const std::string& path) {
  auto f = file_handle::open(path.c_str(), open_flags::read);
  if (!f) return "<missing>";
  std::string s(static_cast<std::size_t>(f->size().value()), '\0');
  (void)f->read_at(0, std::as_writable_bytes(std::span(s)));
  return s;
}

bool exists(const std::string& path) {
  return std::filesystem::exists(path);
}

// A tracked root and its shadow, side by side in one temporary directory.
struct model_dirs {
  temp_dir base;
  std::string root = base.file("root");
  std::string shadow = base.file("shadow");
  model_dirs() { std::filesystem::create_directory(root); }
  [[nodiscard]] std::string file(const std::string& name) const { return root + "/" + name; }
};

TEST(FaultFilesystem, FailsTheNthOperationOnce) {
  temp_dir dir;
  fault_filesystem fs;
  auto f = file_handle::open(fs, dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  fs.inject({.on = fs_op::write, .nth = 3, .error = EIO});
  EXPECT_TRUE(f->write_at(0, text("1")));
  EXPECT_TRUE(f->write_at(1, text("2")));
  auto third = f->write_at(2, text("3"));
  ASSERT_FALSE(third);
  EXPECT_EQ(third.error(), std::errc::io_error);
  EXPECT_EQ(third.error().path(), dir.file("a"));
  EXPECT_EQ(third.error().offset(), 2u);
  EXPECT_TRUE(f->write_at(3, text("4")));
  EXPECT_EQ(fs.count(fs_op::write), 4u);
  EXPECT_EQ(fs.injected(), 1u);
  EXPECT_EQ(content_of(dir.file("a")), std::string("12\0"
                                                   "4",
                                                   4));
}

TEST(FaultFilesystem, FailsForeverFromTheNth) {
  temp_dir dir;
  fault_filesystem fs;
  fs.inject({.on = fs_ops(fs_op::write) | fs_op::sync,
             .nth = 2,
             .repeat = fault::repeat::forever,
             .error = ENOSPC});
  auto f = file_handle::open(fs, dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  EXPECT_TRUE(f->write_at(0, text("x")));
  EXPECT_EQ(f->sync_data().error(), std::errc::no_space_on_device);
  for (int i = 0; i < 5; ++i)
    EXPECT_EQ(f->write_at(0, text("y")).error(), std::errc::no_space_on_device);
  fs.clear_faults();
  EXPECT_TRUE(f->write_at(0, text("z")));
}

TEST(FaultFilesystem, RandomFaultsFollowTheSeed) {
  temp_dir dir;
  const auto run = [&](std::uint64_t seed) {
    fault_filesystem fs(os(), seed);
    fs.inject({.on = fs_op::write, .repeat = fault::repeat::randomly, .probability = 0.5});
    auto f = file_handle::open(fs, dir.file("a").c_str(), create_rw);
    std::string pattern;
    for (int i = 0; i < 200; ++i)
      pattern += f->write_at(0, text("x")) ? '.' : 'X';
    return pattern;
  };
  const std::string a = run(7);
  EXPECT_EQ(a, run(7));
  EXPECT_NE(a, run(8));
  const auto failures = std::count(a.begin(), a.end(), 'X');
  EXPECT_GT(failures, 60);
  EXPECT_LT(failures, 140);
}

TEST(FaultFilesystem, PartialWritesLeaveAPrefixAndTheError) {
  temp_dir dir;
  fault_filesystem fs(os(), 3);
  auto f = file_handle::open(fs, dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  fs.inject({.on = fs_op::write, .error = ENOSPC, .partial = true});
  const std::string full(4096, 'k');
  auto w = f->write_at(0, text(full));
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error(), std::errc::no_space_on_device);
  const std::string left = content_of(dir.file("a"));
  EXPECT_LT(left.size(), full.size());
  EXPECT_EQ(left, full.substr(0, left.size()));
}

TEST(FaultFilesystem, ShortTransfersWithoutErrorAreContinuedAbove) {
  temp_dir dir;
  fault_filesystem fs;
  auto f = file_handle::open(fs, dir.file("a").c_str(), create_rw);
  ASSERT_TRUE(f);
  fs.inject({.on = fs_ops(fs_op::write) | fs_op::read,
             .repeat = fault::repeat::forever,
             .error = 0,
             .partial = true});
  const std::string full(1000, 'q');
  ASSERT_TRUE(f->write_at(0, text(full)));
  std::string back(1000, '\0');
  EXPECT_EQ(f->read_at(0, std::as_writable_bytes(std::span(back))).value(), 1000u);
  EXPECT_EQ(back, full);
  EXPECT_GT(fs.count(fs_op::write), 1u);
}

TEST(FaultFilesystem, PathFilterPicksTheFile) {
  temp_dir dir;
  fault_filesystem fs;
  fs.inject({.on = fs_op::write, .repeat = fault::repeat::forever, .path_contains = "/b"});
  auto a = file_handle::open(fs, dir.file("a").c_str(), create_rw);
  auto b = file_handle::open(fs, dir.file("b").c_str(), create_rw);
  ASSERT_TRUE(a && b);
  EXPECT_TRUE(a->write_at(0, text("fine")));
  EXPECT_FALSE(b->write_at(0, text("not")));
}

TEST(FaultFilesystem, AFailedSyncLosesTheUnsyncedWritesAsLinuxDoes) {
  model_dirs m;
  fault_filesystem fs;
  ASSERT_TRUE(fs.track(m.root, m.shadow));
  auto f = file_handle::open(fs, m.file("log").c_str(), create_rw);
  ASSERT_TRUE(f);
  ASSERT_TRUE(f->write_at(0, text("durable.")));
  ASSERT_TRUE(f->sync_data());
  ASSERT_TRUE(f->write_at(8, text("lost")));
  fs.inject({.on = fs_op::sync, .error = EIO});
  auto s = f->sync_data();
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), std::errc::io_error);
  EXPECT_EQ(content_of(m.file("log")), "durable.");
  EXPECT_TRUE(f->sync_data());  // the error was reported once; the next sync succeeds
}

TEST(FaultFilesystem, PowerLossKeepsOnlyWhatWasSynced) {
  model_dirs m;
  std::filesystem::create_directory(m.file("old"));
  {
    auto pre = file_handle::open(m.file("old/pre").c_str(), create_rw);
    ASSERT_TRUE(pre->write_at(0, text("before tracking")));
  }
  {
    fault_filesystem fs;
    ASSERT_TRUE(fs.track(m.root, m.shadow));
    auto dir = file_handle::open_directory(fs, m.root.c_str());
    ASSERT_TRUE(dir);
    // Synced file, synced name: survives.
    auto kept = file_handle::open_at(*dir, "kept", create_rw);
    ASSERT_TRUE(kept->write_at(0, text("synced")));
    ASSERT_TRUE(kept->sync_data());
    ASSERT_TRUE(dir->sync_all());
    // Later, unsynced writes to it: lost.
    ASSERT_TRUE(kept->write_at(0, text("SYNCED and then some")));
    // A removal not made durable: the file comes back, as it was durably.
    ASSERT_TRUE(fs.unlink(nullptr, m.file("old/pre").c_str(), false));
    // A synced name whose content never was: there, empty.
    auto empty = file_handle::open_at(*dir, "empty", create_rw);
    ASSERT_TRUE(empty->write_at(0, text("never synced")));
    ASSERT_TRUE(fs.make_directory(&*dir, "newdir", 0755));
    ASSERT_TRUE(dir->sync_all());
    auto in_new = file_handle::open(fs, m.file("newdir/child").c_str(), create_rw);
    ASSERT_TRUE(in_new->sync_all());  // its directory never synced: the name is lost
    // A name whose directory was never synced since: gone, however synced its content.
    auto gone = file_handle::open_at(*dir, "gone", create_rw);
    ASSERT_TRUE(gone->write_at(0, text("x")));
    ASSERT_TRUE(gone->sync_all());
  }
  auto report = fault_filesystem::restore(m.root, m.shadow, {});
  ASSERT_TRUE(report) << report.error();
  EXPECT_EQ(content_of(m.file("kept")), "synced");
  EXPECT_FALSE(exists(m.file("gone")));
  EXPECT_EQ(content_of(m.file("old/pre")), "before tracking");
  EXPECT_TRUE(exists(m.file("empty")));
  EXPECT_EQ(content_of(m.file("empty")), "");
  EXPECT_TRUE(std::filesystem::is_directory(m.file("newdir")));
  EXPECT_FALSE(exists(m.file("newdir/child")));
  EXPECT_GE(report->reverted, 2u);
}

TEST(FaultFilesystem, RenamesAndHardLinksFollowTheirDirectorysSync) {
  model_dirs m;
  fault_filesystem fs;
  ASSERT_TRUE(fs.track(m.root, m.shadow));
  auto dir = file_handle::open_directory(fs, m.root.c_str());
  ASSERT_TRUE(dir);
  ASSERT_TRUE(atomic_replace(m.file("config").c_str(), text("v1"), {.fs = &fs}));
  auto t = make_temp_file(*dir, ".t.");
  ASSERT_TRUE(t);
  ASSERT_TRUE(t->file.write_at(0, text("owner")));
  ASSERT_TRUE(t->file.sync_data());
  ASSERT_TRUE(t->link_as(*dir, "lock-a"));
  ASSERT_TRUE(t->link_as(*dir, "lock-b"));
  ASSERT_TRUE(t->remove_name(*dir));
  ASSERT_TRUE(dir->sync_all());
  // Not made durable: a second replace whose directory sync is skipped by a crash... here
  // simply a rename without a directory sync.
  auto f = file_handle::open_at(*dir, "config.new", create_rw);
  ASSERT_TRUE(f->write_at(0, text("v2")));
  ASSERT_TRUE(f->sync_data());
  ASSERT_TRUE(fs.rename(&*dir, "config.new", &*dir, "config", rename_mode::replace));
  EXPECT_EQ(content_of(m.file("config")), "v2");
  ASSERT_TRUE(fault_filesystem::restore(m.root, m.shadow, {}));
  EXPECT_EQ(content_of(m.file("config")), "v1");
  EXPECT_FALSE(exists(m.file("config.new")));
  EXPECT_EQ(content_of(m.file("lock-a")), "owner");
  EXPECT_EQ(std::filesystem::hard_link_count(m.file("lock-a")), 2u);
  struct stat a {};
  struct stat b {};
  ASSERT_EQ(::stat(m.file("lock-a").c_str(), &a), 0);
  ASSERT_EQ(::stat(m.file("lock-b").c_str(), &b), 0);
  EXPECT_EQ(a.st_ino, b.st_ino);
}

TEST(FaultFilesystem, MapsAreDurableWhereMsyncCovered) {
  model_dirs m;
  fault_filesystem fs;
  ASSERT_TRUE(fs.track(m.root, m.shadow));
  auto dir = file_handle::open_directory(fs, m.root.c_str());
  auto f = file_handle::open_at(*dir, "table", create_rw);
  ASSERT_TRUE(f);
  ASSERT_TRUE(f->allocate(0, 8192));
  ASSERT_TRUE(f->sync_all());
  ASSERT_TRUE(dir->sync_all());
  auto map = mapped_file::map(*f, map_access::read_write, 8192);
  ASSERT_TRUE(map);
  std::memcpy(map->data(), "page one", 8);
  std::memcpy(map->data() + 4096, "page two", 8);
  ASSERT_TRUE(map->sync(0, 4096));  // only the first page
  std::memcpy(map->data() + 9, "later", 5);
  ASSERT_TRUE(fault_filesystem::restore(m.root, m.shadow, {}));
  const std::string after = content_of(m.file("table"));
  ASSERT_EQ(after.size(), 8192u);
  EXPECT_EQ(after.substr(0, 8), "page one");
  EXPECT_EQ(after.substr(9, 5), std::string(5, '\0'));
  EXPECT_EQ(after.substr(4096, 8), std::string(8, '\0'));
}

TEST(FaultFilesystem, TornWritesKeepSomeUnsyncedSectors) {
  model_dirs m;
  const std::string old_content(64 * 512, 'o');
  const std::string new_content(64 * 512, 'n');
  {
    fault_filesystem fs;
    ASSERT_TRUE(fs.track(m.root, m.shadow));
    auto dir = file_handle::open_directory(fs, m.root.c_str());
    auto f = file_handle::open_at(*dir, "data", create_rw);
    ASSERT_TRUE(f->write_at(0, text(old_content)));
    ASSERT_TRUE(f->sync_data());
    ASSERT_TRUE(dir->sync_all());
    ASSERT_TRUE(f->write_at(0, text(new_content)));
  }
  auto report = fault_filesystem::restore(m.root, m.shadow, {.torn = true, .seed = 11});
  ASSERT_TRUE(report);
  const std::string after = content_of(m.file("data"));
  ASSERT_EQ(after.size(), old_content.size());
  std::size_t kept = 0;
  for (std::size_t s = 0; s < after.size(); s += 512) {
    const std::string sector = after.substr(s, 512);
    ASSERT_TRUE(sector == std::string(512, 'o') || sector == std::string(512, 'n'))
        << "a sector mixes versions at " << s;
    kept += sector[0] == 'n' ? 1 : 0;
  }
  EXPECT_GT(kept, 0u);
  EXPECT_LT(kept, 64u);
  EXPECT_EQ(kept, report->torn_sectors);
}

TEST(FaultFilesystem, ACrashFaultKillsTheProcessAndNoLaterSyncLands) {
  model_dirs m;
  keel::test::signal_pipe synced;
  const pid_t child = keel::test::fork_child([&] {
    fault_filesystem fs;
    if (!fs.track(m.root, m.shadow)) return 1;
    auto dir = file_handle::open_directory(fs, m.root.c_str());
    auto f = file_handle::open_at(*dir, "journal", create_rw);
    if (!f || !f->write_at(0, text("one")) || !f->sync_data() || !dir->sync_all()) return 2;
    fs.inject({.on = fs_op::sync, .crash = true});
    (void)f->write_at(0, text("two"));
    (void)f->sync_data();  // power is lost before this runs
    synced.notify();
    return 3;
  });
  EXPECT_EQ(keel::test::wait_exit(child), 128 + SIGKILL);
  EXPECT_FALSE(synced.ready_within(std::chrono::milliseconds(0)));
  EXPECT_TRUE(exists(m.shadow + "/crashed"));
  // Another user of the model that syncs after the crash dies too.
  const pid_t late = keel::test::fork_child([&] {
    fault_filesystem fs;
    if (!fs.track(m.root, m.shadow)) return 1;
    auto f = file_handle::open(fs, m.file("journal").c_str(), open_flags::read_write);
    if (!f) return 2;
    (void)f->sync_data();
    return 0;
  });
  EXPECT_EQ(keel::test::wait_exit(late), 128 + SIGKILL);
  ASSERT_TRUE(fault_filesystem::restore(m.root, m.shadow, {}));
  EXPECT_EQ(content_of(m.file("journal")), "one");
  EXPECT_FALSE(exists(m.shadow + "/crashed"));
}

TEST(FaultFilesystem, ProcessesShareOneModel) {
  model_dirs m;
  fault_filesystem parent;
  ASSERT_TRUE(parent.track(m.root, m.shadow));
  const pid_t child = keel::test::fork_child([&] {
    fault_filesystem fs;
    if (!fs.track(m.root, m.shadow)) return 1;
    auto dir = file_handle::open_directory(fs, m.root.c_str());
    auto f = file_handle::open_at(*dir, "from-child", create_rw);
    if (!f || !f->write_at(0, text("hello")) || !f->sync_data() || !dir->sync_all()) return 2;
    auto g = file_handle::open_at(*dir, "unsynced", create_rw);
    return g ? 0 : 3;
  });
  ASSERT_EQ(keel::test::wait_exit(child), 0);
  ASSERT_TRUE(fault_filesystem::restore(m.root, m.shadow, {}));
  EXPECT_EQ(content_of(m.file("from-child")), "hello");
  EXPECT_FALSE(exists(m.file("unsynced")));
}

TEST(FaultFilesystem, RestoreRefusesAnUntrackedPair) {
  model_dirs m;
  EXPECT_FALSE(fault_filesystem::restore(m.root, m.shadow, {}));
  fault_filesystem fs;
  ASSERT_TRUE(fs.track(m.root, m.shadow));
  temp_dir other;
  EXPECT_FALSE(fs.track(other.path().string(), m.shadow));  // one shadow, one root
}

}  // namespace
}  // namespace keel::io
