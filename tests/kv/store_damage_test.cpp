// Damage and failures beside the crash paths: a flipped bit, a file damaged by hand, a read
// that fails for another reason than the bytes (EMFILE). Recovery rolls back nothing it
// cannot prove a power cut took, changes nothing on disk when it cannot read, and a read of
// damage is `corrupt`, never an older value (doc/kv-format.md, "Recovery").

#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "keel/io/fault_filesystem.hpp"
#include "kv/kv_support.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;
using test_support::open_ok;
using test_support::small;

std::string read_file(const std::string& file) {
  return test::slurp(file);
}

void write_file(const std::string& file, const std::string& bytes) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The store's segment files, in number order.
std::vector<std::string> segment_files(const std::string& path) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(path + "/seg")) {
    if (e.path().filename().string().size() == 16) out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Every segment's bytes, to tell whether something wrote to them.
std::map<std::string, std::string> segment_bytes(const std::string& path) {
  std::map<std::string, std::string> out;
  for (const auto& f : segment_files(path))
    out[f] = read_file(f);
  return out;
}

struct place {
  std::string file;
  std::size_t offset = std::string::npos;
};

// The last place `needle` is found in the segments (the newest version that holds it).
place find_last(const std::string& path, const std::string& needle) {
  place p;
  for (const auto& f : segment_files(path)) {
    const std::string bytes = read_file(f);
    const std::size_t at = bytes.rfind(needle);
    if (at != std::string::npos) p = {f, at};
  }
  return p;
}

void flip_bit(const place& p, std::size_t plus = 0) {
  std::string bytes = read_file(p.file);
  bytes[p.offset + plus] = static_cast<char>(bytes[p.offset + plus] ^ 0x10);
  write_file(p.file, bytes);
}

std::string big_value(char fill) {
  std::string v((std::size_t{3} << 20) / 2, fill);  // a segment of its own (1 MiB segments)
  std::memcpy(v.data() + 100'000, "<blob-marker>", 13);
  return v;
}

options sync_small() {
  options o = small();
  o.durable = durability::sync;
  return o;
}

// A writer killed while it wrote its commit block, before it sealed it, leaves the block
// unfinished: its commit never happened. After a clean close (which records the blocks below
// the tail as durable) and a reboot, the rebuild must take it for what it is, never for
// damage. (The store was once refused as corrupt there.) The states a kill leaves: the block
// whole but for its seq word; its records written and no header yet; half its records.
// A store holding a = "old a", then a writer killed (SIGKILL) at `step` of committing
// `commit(store&)`: whether it died so.
template <class Commit>
bool a_writer_died_at(const std::string& path, commit_step step, Commit commit) {
  {
    auto s = open_ok(path);
    if (!s || !s->put("a", "old a")) return false;
  }
  const pid_t victim = fork_child([&] {
    auto mine = store::open(path, small());
    if (!mine) return 2;
    test_support::die_at(step);
    commit(**mine);
    return 4;
  });
  const int status = test::wait_status(victim);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
}

// A sector of the newest value marked "<c-marker>" zeroed, and the index removed (as a
// reboot would have it rebuilt). Whether the marker was found.
bool zero_a_sector_of_the_newest_c(const std::string& path) {
  const place c = find_last(path, "<c-marker>");
  if (c.offset == std::string::npos) return false;
  std::string bytes = read_file(c.file);
  std::memset(bytes.data() + (c.offset + 1024) / 512 * 512, 0, 512);
  write_file(c.file, bytes);
  std::filesystem::remove(path + "/index");
  return true;
}

class KvDeadWriterBlock : public ::testing::TestWithParam<int> {};

TEST_P(KvDeadWriterBlock, IsAHoleNotDamageAfterACleanCloseAndAReboot) {
  temp_dir dir;
  const std::string path = dir.file("s");
  ASSERT_TRUE(a_writer_died_at(path, commit_step::written, [](store& mine) {
    auto t = mine.begin();
    if (t && t->put("a", "new a <dead-marker>" + std::string(600, 'n')) && t->put("b", "b")) {
      (void)t->commit();
    }
  }));
  // Its block back to a state the kill could have left it in.
  const place marker = find_last(path, "<dead-marker>");
  ASSERT_NE(marker.offset, std::string::npos);
  std::string bytes = read_file(marker.file);
  const std::size_t block = bytes.rfind("VBK1", marker.offset);
  ASSERT_NE(block, std::string::npos);
  ASSERT_EQ(block % 8, 0u);
  switch (GetParam()) {
    case 0:
      std::memset(bytes.data() + block + offsetof(disk::block_header, seq), 0, 8);
      break;
    case 1:
      std::memset(bytes.data() + block, 0, sizeof(disk::block_header));
      break;
    default:
      std::memset(bytes.data() + block, 0, sizeof(disk::block_header));
      std::memset(bytes.data() + marker.offset + 300, 0, 300);
      break;
  }
  write_file(marker.file, bytes);
  {
    auto s = open_ok(path);  // alone: the dead writer's commit is a hole
    ASSERT_TRUE(s);
    EXPECT_EQ(s->get("a").value_or("?"), "old a");
    EXPECT_EQ(s->get("b").error(), errc::not_found);
    ASSERT_TRUE(s->put("c", "c <c-marker>" + std::string(3000, 'c')));
  }  // the last to close: below the tail is durable now
  for (int boot = 0; boot < 2; ++boot) {
    std::filesystem::remove(path + "/index");
    auto s = store::open(path, small());
    ASSERT_TRUE(s) << "boot " << boot << ": " << s.error().message();
    EXPECT_EQ((*s)->get("a").value_or("?"), "old a");
    EXPECT_EQ((*s)->get("b").error(), errc::not_found);
    EXPECT_EQ((*s)->get("c").value_or("?"), "c <c-marker>" + std::string(3000, 'c'));
    verify_report found;
    EXPECT_TRUE((*s)->verify(&found)) << (found.damaged.empty() ? "" : found.damaged[0].what);
  }
  // The close recorded the space past the buried block as durable too: zeros in "c" now are
  // damage, not a power cut's.
  ASSERT_TRUE(zero_a_sector_of_the_newest_c(path));
  auto s = store::open(path, small());
  if (!s) {
    EXPECT_EQ(s.error(), errc::corrupt) << s.error().message();
    return;
  }
  auto got = (*s)->get("c");
  ASSERT_FALSE(got) << "a damaged commit taken for a torn one";
  EXPECT_EQ(got.error(), errc::corrupt);
}

// A writer killed after it wrote a blob's value and before its header (a blob is written
// value first), or a commit block's records and not its header, leaves bytes nothing
// explains and no slot records. The last user to close, alone, buries them as a block keel
// left on purpose, and records what follows as durable. (The close's durable mark once
// stopped there for good: a commit block zeroed, or a sync commit damaged, sessions later
// was then taken for space or for a torn block, and an older value served.)
TEST(KvDeadWriterBlob, IsBuriedAtTheCloseAndLaterDamageIsStillFound) {
  temp_dir dir;
  const std::string path = dir.file("s");
  // Killed once its blob is written and its block not.
  ASSERT_TRUE(a_writer_died_at(path, commit_step::locked, [](store& mine) {
    (void)mine.put("big", "<dead-blob>" + std::string(200'000, 'z'));
  }));
  const place blob = find_last(path, "<dead-blob>");
  ASSERT_NE(blob.offset, std::string::npos);
  {
    // Its header not written yet.
    std::string bytes = read_file(blob.file);
    ASSERT_GE(blob.offset, sizeof(disk::block_header));
    std::memset(bytes.data() + blob.offset - sizeof(disk::block_header), 0,
                sizeof(disk::block_header));
    write_file(blob.file, bytes);
  }
  for (int session = 0; session < 3; ++session) {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("c" + std::to_string(session), "c <c-marker>" + std::string(3000, 'c')));
  }
  // A sector of the newest "c" zeroed: damage (the closes recorded it durable), never a
  // commit a power cut tore.
  ASSERT_TRUE(zero_a_sector_of_the_newest_c(path));
  auto s = store::open(path, small());
  if (!s) {
    EXPECT_EQ(s.error(), errc::corrupt) << s.error().message();
    return;
  }
  EXPECT_EQ((*s)->get("a").value_or("?"), "old a");
  auto got = (*s)->get("c2");
  ASSERT_FALSE(got) << "a damaged commit taken for a torn one";
  EXPECT_EQ(got.error(), errc::corrupt);
}

INSTANTIATE_TEST_SUITE_P(States, KvDeadWriterBlock, ::testing::Values(0, 1, 2));

// A bit flipped in a value kept in its own segment, after its `sync` commit returned: the
// rebuild a reboot causes keeps the commit (its other key has its new value) and reads of the
// damaged value are `corrupt`; nothing on disk is changed, so repairing the bit brings the
// value back. (It once voided the commit on disk and served both old values.)
TEST(KvDamage, ADamagedBlobOfASyncCommitReadsCorruptAndTheCommitStays) {
  temp_dir dir;
  const std::string path = dir.file("s");
  const std::string big = big_value('B');
  {
    auto s = open_ok(path, sync_small());
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("a", "old a"));
    ASSERT_TRUE(s->put("b", "old b"));
    auto t = s->begin();
    ASSERT_TRUE(t);
    ASSERT_TRUE(t->put("a", big));
    ASSERT_TRUE(t->put("b", "new b"));
    ASSERT_TRUE(t->commit());
  }
  const place blob = find_last(path, "<blob-marker>");
  ASSERT_NE(blob.offset, std::string::npos);
  flip_bit(blob, 3);
  const auto damaged = segment_bytes(path);
  std::filesystem::remove(path + "/index");  // a reboot: the index is rebuilt
  {
    auto s = store::open(path, sync_small());
    ASSERT_TRUE(s) << s.error().message();
    auto a = (*s)->get("a");
    ASSERT_FALSE(a) << "served a value of the damaged key: " << a->substr(0, 8);
    EXPECT_EQ(a.error(), errc::corrupt) << a.error().message();
    std::string into = "kept";
    EXPECT_EQ((*s)->get("a", into).error(), errc::corrupt);
    EXPECT_EQ(into, "kept") << "a damaged value was copied out";
    auto b = (*s)->get("b");
    ASSERT_TRUE(b) << b.error().message();
    EXPECT_EQ(*b, "new b") << "the commit was rolled back";
  }
  EXPECT_TRUE(segment_bytes(path) == damaged) << "recovery wrote to the segments";
  flip_bit(blob, 3);  // repaired
  std::filesystem::remove(path + "/index");
  auto s = open_ok(path, sync_small());
  ASSERT_TRUE(s);
  auto a = s->get("a");
  ASSERT_TRUE(a) << a.error().message();
  EXPECT_EQ(*a, big);
  EXPECT_EQ(*s->get("b"), "new b");
}

// A bit flipped in the newest version of a key, then a rebuild: the key is never served its
// older version. The rebuild may refuse the store (corrupt, naming the segment) or read the
// key as corrupt; it never rolls the key back.
TEST(KvDamage, ADamagedNewestValueIsNeverServedOlderAfterARebuild) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path, sync_small());
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("a", "old a"));
    ASSERT_TRUE(s->put("a", "new a <newest-marker>" + std::string(1000, 'n')));
    ASSERT_TRUE(s->put("b", "b"));
  }
  flip_bit(find_last(path, "<newest-marker>"), 5);
  const auto damaged = segment_bytes(path);
  std::filesystem::remove(path + "/index");
  auto s = store::open(path, sync_small());
  if (!s) {
    EXPECT_EQ(s.error(), errc::corrupt) << s.error().message();
    EXPECT_NE(s.error().message().find("/seg/"), std::string::npos) << s.error().message();
  } else {
    auto a = (*s)->get("a");
    ASSERT_FALSE(a) << "served: " << a->substr(0, 8);
    EXPECT_EQ(a.error(), errc::corrupt) << a.error().message();
  }
  EXPECT_TRUE(segment_bytes(path) == damaged) << "recovery wrote to the segments";
}

// A bit flipped in an old version that a newer one superseded stops nothing: the rebuild
// serves the newest version.
TEST(KvDamage, ADamagedSupersededVersionDoesNotStopARebuild) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path, sync_small());
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("a", "first <old-marker>" + std::string(1000, 'o')));
    ASSERT_TRUE(s->put("a", "second"));
  }
  flip_bit(find_last(path, "<old-marker>"), 5);
  std::filesystem::remove(path + "/index");
  auto s = open_ok(path, sync_small());
  ASSERT_TRUE(s);
  auto a = s->get("a");
  ASSERT_TRUE(a) << a.error().message();
  EXPECT_EQ(*a, "second");
}

// The rebuild in a process out of file descriptors: it fails with that error and changes
// nothing on disk; the next open with descriptors to spare has every commit. (It once took
// the unreadable blob for one a power cut took and voided the `sync` commit on disk.)
TEST(KvDamage, ARebuildShortOfDescriptorsFailsAndDestroysNothing) {
  temp_dir dir;
  const std::string path = dir.file("s");
  const std::string big = big_value('E');
  {
    auto s = open_ok(path, sync_small());
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("b", "old b"));
    auto t = s->begin();
    ASSERT_TRUE(t);
    ASSERT_TRUE(t->put("a", big));
    ASSERT_TRUE(t->put("b", "new b"));
    ASSERT_TRUE(t->commit());
  }
  const place blob = find_last(path, "<blob-marker>");
  ASSERT_NE(blob.offset, std::string::npos);
  const std::string blob_segment = std::filesystem::path(blob.file).filename().string();
  const auto before = segment_bytes(path);
  std::filesystem::remove(path + "/index");
  {
    io::fault_filesystem fs;
    fs.inject({.on = io::fs_op::open,
               .repeat = io::fault_filesystem::fault::repeat::forever,
               .error = EMFILE,
               .path_contains = blob_segment});
    options o = sync_small();
    o.fs = &fs;
    auto s = store::open(path, o);
    if (s) {
      // Opened without reading the blob: reading it is the error, never another value.
      auto a = (*s)->get("a");
      ASSERT_FALSE(a);
      EXPECT_EQ(a.error(), std::error_code(EMFILE, std::system_category())) << a.error().message();
      auto b = (*s)->get("b");
      ASSERT_TRUE(b) << b.error().message();
      EXPECT_EQ(*b, "new b");
    } else {
      EXPECT_EQ(s.error(), std::error_code(EMFILE, std::system_category())) << s.error().message();
    }
  }
  EXPECT_TRUE(segment_bytes(path) == before) << "recovery wrote to the segments";
  std::filesystem::remove(path + "/index");
  auto s = open_ok(path, sync_small());
  ASSERT_TRUE(s);
  auto a = s->get("a");
  ASSERT_TRUE(a) << a.error().message();
  EXPECT_EQ(*a, big);
  EXPECT_EQ(*s->get("b"), "new b");
}

// A power cut tore the last commit (its header's sector written, a later one not): the
// first opener after the reboot opens read-only. It rebuilds the index without writing a
// byte of the segments (it once cleared bytes in its read-only map: SIGSEGV), and reads the
// commit before. A writable open then goes on past the torn block, and a later rebuild
// finds what it wrote.
TEST(KvDamage, AReadOnlyFirstOpenerAfterAPowerCutWritesNothing) {
  temp_dir dir;
  const std::string path = dir.file("s");
  // The writer is gone without closing (the power went): nothing says its last commit is
  // durable.
  const pid_t writer = fork_child([&] {
    auto s = store::open(path, sync_small());
    if (!s || !(*s)->put("a", "old a")) return 2;
    auto t = (*s)->begin();
    if (!t || !t->put("a", "torn <torn-marker>" + std::string(3000, 't'))) return 3;
    if (!t->commit(durability::none)) return 4;
    ::raise(SIGKILL);
    return 5;
  });
  ASSERT_EQ(test::wait_exit(writer), 128 + SIGKILL);
  const place torn = find_last(path, "<torn-marker>");
  ASSERT_NE(torn.offset, std::string::npos);
  {
    std::string bytes = read_file(torn.file);
    const std::size_t sector = (torn.offset + 1024) / 512 * 512;
    std::memset(bytes.data() + sector, 0, 512);  // that sector never reached the disk
    write_file(torn.file, bytes);
  }
  const auto cut = segment_bytes(path);
  std::filesystem::remove(path + "/index");
  const pid_t reader = fork_child([&] {
    options o = small();
    o.read_only = true;
    auto s = store::open(path, o);
    if (!s) return 2;
    auto a = (*s)->get("a");
    if (!a) return 3;
    return *a == "old a" ? 0 : 4;
  });
  EXPECT_EQ(test::wait_exit(reader), 0) << "2: no open, 3: no read, 4: another value";
  EXPECT_TRUE(segment_bytes(path) == cut) << "a read-only open wrote to the segments";
  {
    auto s = open_ok(path, sync_small());
    ASSERT_TRUE(s);
    EXPECT_EQ(*s->get("a"), "old a");
    ASSERT_TRUE(s->put("c", "after the cut"));
  }
  std::filesystem::remove(path + "/index");
  auto s = open_ok(path, sync_small());
  ASSERT_TRUE(s);
  EXPECT_EQ(*s->get("a"), "old a");
  auto c = s->get("c");
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(*c, "after the cut");
}

// A segment compaction would empty holds a commit of two keys, one of them damaged: the
// damaged record cannot be copied, so the segment stays, with both keys; the other key is
// moved or kept and reads its value. Once the damaged key is written anew, compaction takes
// the segment. (It once moved nothing, removed the segment, and lost both keys for good.)
TEST(KvDamage, ACompactionNeverRemovesASegmentHoldingALiveRecordItCouldNotCopy) {
  temp_dir dir;
  const std::string path = dir.file("s");
  const auto filler = [](int k, int round) {
    return "f" + std::to_string(k) + ":" + std::to_string(round) + std::string(1000, 'f');
  };
  {
    auto s = open_ok(path, test_support::manual_compaction());
    ASSERT_TRUE(s);
    auto t = s->begin();
    ASSERT_TRUE(t);
    ASSERT_TRUE(t->put("a", "value of a <damaged-marker>" + std::string(500, 'a')));
    ASSERT_TRUE(t->put("b", "value of b"));
    ASSERT_TRUE(t->commit());
    // The rest of the first segment, then all of it again: a, b are its only live records.
    for (int round = 0; round < 2; ++round) {
      for (int k = 0; k < 1500; ++k)
        ASSERT_TRUE(s->put("f" + std::to_string(k), filler(k, round)));
    }
  }
  const place a = find_last(path, "<damaged-marker>");
  ASSERT_NE(a.offset, std::string::npos);
  const std::string first_segment = a.file;
  flip_bit(a, 2);
  auto s = open_ok(path, test_support::manual_compaction());
  ASSERT_TRUE(s);
  auto c = s->compact();
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_GT(c->segments_removed, 0u) << "the other dead segments go";
  EXPECT_TRUE(std::filesystem::exists(first_segment)) << "removed with a live record in it";
  auto b = s->get("b");
  ASSERT_TRUE(b) << b.error().message();
  EXPECT_EQ(*b, "value of b");
  auto got = s->get("a");
  ASSERT_FALSE(got);
  EXPECT_EQ(got.error(), errc::corrupt) << got.error().message();
  for (int k = 0; k < 1500; k += 100) {
    auto f = s->get("f" + std::to_string(k));
    ASSERT_TRUE(f) << f.error().message();
    EXPECT_EQ(*f, filler(k, 1));
  }
  // Written anew, the damaged record is dead: compaction may take its segment now.
  ASSERT_TRUE(s->put("a", "a again"));
  auto again = s->compact();
  ASSERT_TRUE(again) << again.error().message();
  EXPECT_FALSE(std::filesystem::exists(first_segment));
  EXPECT_EQ(*s->get("a"), "a again");
  EXPECT_EQ(*s->get("b"), "value of b");
  s.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path, test_support::manual_compaction());
  ASSERT_TRUE(rebuilt);
  EXPECT_EQ(*rebuilt->get("a"), "a again");
  EXPECT_EQ(*rebuilt->get("b"), "value of b");
}

// A writer died with its two-key commit whole and unpublished; a process out of file
// descriptors then meets the commit's entries. It cannot read the block, so it settles
// nothing: its call fails with EMFILE, and everyone sees the whole commit. (It once took the
// unreadable block for an incomplete one and rolled one key back: half the commit showed.)
TEST(KvDamage, AProcessShortOfDescriptorsNeverSettlesADeadWritersCommitHalfWay) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("a", "old a"));
  ASSERT_TRUE(s->put("b", "old b"));
  const pid_t victim = fork_child([&] {
    auto mine = store::open(path, small());
    if (!mine) return 2;
    test_support::die_at(commit_step::written);
    auto t = (*mine)->begin();
    if (!t || !t->put("a", "new a") || !t->put("b", "new b")) return 3;
    (void)t->commit();
    return 4;
  });
  const int status = test::wait_status(victim);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  ASSERT_TRUE(s->put("unrelated", "u"));  // settles the dead commit's seq, not its entries
  const pid_t short_of_fds = fork_child([&] {
    io::fault_filesystem fs;
    options o = small();
    o.fs = &fs;
    auto mine = store::open(path, o);
    if (!mine) return 2;
    fs.inject({.on = io::fs_op::open,
               .repeat = io::fault_filesystem::fault::repeat::forever,
               .error = EMFILE,
               .path_contains = "/seg/"});
    for (const char* key : {"a", "b"}) {
      auto put = (*mine)->put(key, "from the process short of descriptors");
      if (put) return 5;
      if (put.error() != std::error_code(EMFILE, std::system_category())) return 6;
      auto got = (*mine)->get(key);
      if (got && *got != "new a" && *got != "new b") return 7;
    }
    return 0;
  });
  EXPECT_EQ(test::wait_exit(short_of_fds), 0)
      << "5: a put went in, 6: another error, 7: an old value was read";
  EXPECT_EQ(*s->get("a"), "new a") << "half the commit";
  EXPECT_EQ(*s->get("b"), "new b");
}

// verify lists every damage, each with its file and offset: an old version's record, the
// newest version's record and a value kept as a blob. (It once said "ok, every checksum
// matches" over a damaged old version.)
TEST(KvDamage, VerifyListsEveryDamageOldVersionsIncluded) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("a", "first <first-marker>" + std::string(100, '1')));
    ASSERT_TRUE(s->put("a", "second <second-marker>" + std::string(100, '2')));
    ASSERT_TRUE(s->put("c", big_value('C')));
    verify_report clean;
    auto ok = s->verify(&clean);
    ASSERT_TRUE(ok) << ok.error().message();
    EXPECT_EQ(clean.commits, 3u);
    EXPECT_TRUE(clean.damaged.empty());
  }
  const place first = find_last(path, "<first-marker>");
  const place second = find_last(path, "<second-marker>");
  const place blob = find_last(path, "<blob-marker>");
  for (const place& p : {first, second, blob})
    flip_bit(p, 3);
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  verify_report report;
  auto v = s->verify(&report);
  ASSERT_FALSE(v);
  EXPECT_EQ(v.error(), errc::corrupt);
  ASSERT_EQ(report.damaged.size(), 3u);
  // Records are named at their start, before the value; a blob at its block's start.
  const std::size_t names[] = {first.offset, second.offset, blob.offset};
  for (std::size_t i = 0; i < 3; ++i) {
    const damage& d = report.damaged[i];
    EXPECT_EQ(d.file, i < 2 ? first.file : blob.file) << d.what;
    EXPECT_LT(d.offset, names[i]) << d.what;
    EXPECT_GT(d.offset + (i < 2 ? 2000 : 200'000), names[i]) << d.what;
  }
  EXPECT_NE(report.damaged[0].what.find("\"a\""), std::string::npos) << report.damaged[0].what;
  EXPECT_NE(report.damaged[2].what.find("\"c\""), std::string::npos) << report.damaged[2].what;
}

// A key whose newest record is damaged is repaired by writing it anew, or by erasing it.
// (Both once failed with `corrupt`: a commit read the old record's checksum.)
TEST(KvDamage, ADamagedKeyCanBeOverwrittenOrErased) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("a", "a <a-marker>" + std::string(100, 'a')));
    ASSERT_TRUE(s->put("b", "b <b-marker>" + std::string(100, 'b')));
    ASSERT_TRUE(s->put("c", big_value('C')));
  }
  for (const char* m : {"<a-marker>", "<b-marker>", "<blob-marker>"})
    flip_bit(find_last(path, m), 3);
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  for (const char* k : {"a", "b", "c"}) {
    auto v = s->get(k);
    ASSERT_FALSE(v) << k;
    EXPECT_EQ(v.error(), errc::corrupt) << v.error().message();
  }
  auto put = s->put("a", "repaired");
  ASSERT_TRUE(put) << put.error().message();
  EXPECT_EQ(*s->get("a"), "repaired");
  for (const char* k : {"b", "c"}) {
    auto erased = s->erase(k);
    ASSERT_TRUE(erased) << k << ": " << erased.error().message();
    EXPECT_EQ(s->get(k).error(), errc::not_found);
  }
  s.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path);
  ASSERT_TRUE(rebuilt);
  EXPECT_EQ(*rebuilt->get("a"), "repaired");
  EXPECT_EQ(rebuilt->get("b").error(), errc::not_found);
  EXPECT_EQ(rebuilt->get("c").error(), errc::not_found);
}

// A segment deleted by hand (or lost): the store knows which segments it has, so the next
// open names the missing file as corrupt, after a reboot and without one. (After a reboot,
// an overwritten value and an erased key once came back, and verify said ok.) So does a
// manifest deleted by hand, once the store has segments.
TEST(KvDamage, ASegmentDeletedByHandIsCorruptNamingIt) {
  for (const bool reboot : {false, true}) {
    temp_dir dir;
    const std::string path = dir.file("s");
    {
      auto s = open_ok(path);
      ASSERT_TRUE(s);
      ASSERT_TRUE(s->put("a", "old a"));
      ASSERT_TRUE(s->put("b", "b"));
      for (int k = 0; k < 1200; ++k)  // the next segment
        ASSERT_TRUE(s->put("f" + std::to_string(k), std::string(1000, 'f')));
      ASSERT_TRUE(s->put("a", "new a <newest-a>"));
      ASSERT_TRUE(s->erase("b"));
    }
    const place newest = find_last(path, "<newest-a>");
    ASSERT_NE(newest.file, segment_files(path).front());
    std::filesystem::remove(newest.file);
    if (reboot) std::filesystem::remove(path + "/index");
    auto s = store::open(path, small());
    ASSERT_FALSE(s) << "opened with a segment missing (reboot " << reboot << ")";
    EXPECT_EQ(s.error(), errc::corrupt) << s.error().message();
    EXPECT_EQ(s.error().path(), newest.file) << s.error().message();
  }
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("a", "a"));
  }
  std::filesystem::remove(path + "/manifest");
  std::filesystem::remove(path + "/index");
  auto s = store::open(path, small());
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), errc::corrupt) << s.error().message();
  EXPECT_EQ(s.error().path(), path + "/manifest");
}

// The manifest zeroed while the store is closed (both slots blank: no segment listed), or
// its newest slot only (after a writer killed as it wrote, the older one lists fewer
// segments): the segments it no longer lists
// hold live records, so the manifest lost them. Every opener refuses the store naming the
// manifest, the read-only one too. (A read-only first opener once took every segment for a
// leftover and served an empty store, or an older one. With the index kept, a writable
// opener took the segments for leftovers whose records were superseded, since each entry
// held the very version in them, and removed them all.)
TEST(KvDamage, AZeroedManifestIsCorruptForEveryOpener) {
  for (const bool whole : {true, false}) {
    temp_dir dir;
    const std::string path = dir.file("s");
    // Killed rather than closed: the manifest's last change then lists a segment (a close
    // writes one that lists what the slot before did).
    const pid_t writer = fork_child([&] {
      auto s = store::open(path, small());
      if (!s) return 2;
      for (int k = 0; k < 50; ++k) {  // 5 segments
        if (!(*s)->put("k" + std::to_string(k), std::string(100'000, 'a'))) return 3;
      }
      ::raise(SIGKILL);
      return 4;
    });
    ASSERT_EQ(test::wait_exit(writer), 128 + SIGKILL);
    std::string m = read_file(path + "/manifest");
    ASSERT_EQ(m.size() % 2, 0u);
    const std::size_t slot = m.size() / 2;
    std::uint64_t generation[2] = {};
    std::memcpy(&generation[0], m.data() + 40, 8);
    std::memcpy(&generation[1], m.data() + slot + 40, 8);
    if (whole) {
      m.assign(m.size(), '\0');
    } else {
      const std::size_t newest = generation[1] > generation[0] ? slot : 0;
      std::memset(m.data() + newest, 0, slot);
    }
    write_file(path + "/manifest", m);
    const std::vector<std::string> segments = segment_files(path);
    for (const bool reboot : {false, true}) {
      for (const bool read_only : {true, false}) {
        if (reboot) std::filesystem::remove(path + "/index");
        options o = small();
        o.read_only = read_only;
        auto s = store::open(path, o);
        ASSERT_FALSE(s) << (whole ? "whole" : "newest slot") << (read_only ? ", read-only" : "")
                        << (reboot ? ", index rebuilt" : ", index kept") << ": opened";
        EXPECT_EQ(s.error(), errc::corrupt) << s.error().message();
        EXPECT_EQ(s.error().path(), path + "/manifest") << s.error().message();
        EXPECT_EQ(segment_files(path), segments) << "a segment holding live records was removed";
      }
    }
  }
}

// A zeroed manifest, the index gone: the store is refused before any segment it no longer
// lists is removed, so salvage still finds every value. (A segment holding only a live
// blob passed for a leftover and was removed before the next one was refused.)
TEST(KvDamage, ARefusedStoreKeepsEverySegment) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("big", big_value('b')));  // a segment of its own
    for (int k = 0; k < 50; ++k)
      ASSERT_TRUE(s->put("k" + std::to_string(k), std::string(3000, 'k')));
  }
  const std::vector<std::string> segments = segment_files(path);
  write_file(path + "/manifest", std::string(read_file(path + "/manifest").size(), '\0'));
  std::filesystem::remove(path + "/index");
  auto s = store::open(path, small());
  ASSERT_FALSE(s) << "opened";
  EXPECT_EQ(s.error(), errc::corrupt) << s.error().message();
  EXPECT_EQ(segment_files(path), segments) << "a segment was removed";
  auto salvaged = store::salvage(path, dir.file("copy"), small());
  ASSERT_TRUE(salvaged) << salvaged.error().message();
  EXPECT_EQ(salvaged->keys, 51u);
  auto copy = open_ok(dir.file("copy"));
  ASSERT_TRUE(copy);
  EXPECT_EQ(copy->get("big").value_or("?"), big_value('b'));
}

// The index cut short by hand (to its fixed pages) while the store is closed: the next open
// rebuilds it from the log (it is a cache of it). (It once died of SIGBUS after 20 s.)
TEST(KvDamage, AnIndexCutShortIsRebuilt) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    for (int k = 0; k < 3000; ++k)
      ASSERT_TRUE(s->put("k" + std::to_string(k), "v" + std::to_string(k)));
  }
  std::filesystem::resize_file(path + "/index", std::uintmax_t{128} * 4096);
  const pid_t reader = fork_child([&] {
    auto s = store::open(path, small());
    if (!s) return 2;
    for (int k = 0; k < 3000; ++k) {
      auto v = (*s)->get("k" + std::to_string(k));
      if (!v || *v != "v" + std::to_string(k)) return 3;
    }
    return 0;
  });
  EXPECT_EQ(test::wait_exit(reader), 0) << "2: no open, 3: a value lost; 135: SIGBUS";
}

// A range of zeros in the newest commit of a store its last user closed: the close recorded
// that every block was on stable storage, so the zeros are damage, never a commit a power cut
// tore: the key is never rolled back to its older version.
TEST(KvDamage, ZerosInACleanlyClosedStoreAreDamageNotAPowerCut) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("a", "old a"));
    ASSERT_TRUE(s->put("a", "new a <zeroed-marker>" + std::string(3000, 'n')));
  }
  const place newest = find_last(path, "<zeroed-marker>");
  ASSERT_NE(newest.offset, std::string::npos);
  {
    std::string bytes = read_file(newest.file);
    const std::size_t sector = (newest.offset + 1024) / 512 * 512;
    std::memset(bytes.data() + sector, 0, 512);
    write_file(newest.file, bytes);
  }
  std::filesystem::remove(path + "/index");
  auto s = store::open(path, small());
  if (!s) {
    EXPECT_EQ(s.error(), errc::corrupt) << s.error().message();
    return;
  }
  auto a = (*s)->get("a");
  ASSERT_FALSE(a) << "rolled back to: " << *a;
  EXPECT_EQ(a.error(), errc::corrupt) << a.error().message();
}

// One bit flipped in the index of a closed store (the index outlives its users): the next
// opener, alone, finds the page no longer adds up and rebuilds the index from the log.
// (A present key once read as not found.) Each word of the key's entry in turn.
TEST(KvDamage, AFlippedBitInTheIndexIsRebuiltNeverAWrongAnswer) {
  for (int word = 1; word < 4; ++word) {  // lo, location, seq (hi: the probe misses anyway)
    temp_dir dir;
    const std::string path = dir.file("s");
    {
      auto s = open_ok(path);
      ASSERT_TRUE(s);
      for (int k = 0; k < 1000; ++k)
        ASSERT_TRUE(s->put("k" + std::to_string(k), "v" + std::to_string(k)));
    }
    const std::string key = "k500";
    auto params = disk::parse_store_file(as_bytes(std::string_view(read_file(path + "/keel-kv"))));
    ASSERT_TRUE(params);
    const disk::key_hash h = disk::hash_key(as_bytes(key), params->salt);
    std::string index = read_file(path + "/index");
    std::string hi(8, '\0');
    std::memcpy(hi.data(), &h.hi, 8);
    std::size_t at = index.find(hi);
    while (at != std::string::npos && at % 32 != 0)  // an entry's first word
      at = index.find(hi, at + 1);
    ASSERT_NE(at, std::string::npos);
    index[at + 8 * static_cast<std::size_t>(word) + 1] ^= 0x20;
    write_file(path + "/index", index);
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    for (int k = 0; k < 1000; ++k) {
      auto v = s->get("k" + std::to_string(k));
      ASSERT_TRUE(v) << "word " << word << ": k" << k << ": " << v.error().message();
      EXPECT_EQ(*v, "v" + std::to_string(k));
    }
  }
}

// Puts `copy` back as the index of the closed store at `path`, as by hand: written beside it,
// then renamed over it.
void put_back_index(const std::string& path, const std::string& copy) {
  write_file(path + "/index.copy", copy);
  std::filesystem::rename(path + "/index.copy", path + "/index");
}

// verify finds nothing damaged in `s`.
void expect_no_damage(store& s) {
  verify_report report;
  auto checked = s.verify(&report);
  ASSERT_TRUE(checked) << checked.error().message();
  EXPECT_TRUE(report.damaged.empty()) << report.damaged.front().what;
}

// A copy of the index taken while the store was open, put back by hand after it closed (an
// index restored from a backup of its own): the log has since moved into a new segment, past
// the copy's tail, and its tail's segment shows nothing written after that tail. The next
// opener, alone, finds a block in a segment beyond the tail's and rebuilds the index from the
// log rather than serve the copy's older view. (Every commit after the copy was lost, and
// verify said ok.)
TEST(KvDamage, AStaleCopyOfTheIndexPutBackIsRebuiltNeverAnOlderView) {
  temp_dir dir;
  const std::string path = dir.file("s");
  const std::string value(std::size_t{60} << 10, 'v');  // a 1 MiB segment holds about 16
  std::string stale;
  int keys = 0;
  {
    auto s = open_ok(path, test_support::manual_compaction());
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("k0", value));
    auto first = s->stats();
    ASSERT_TRUE(first) << first.error().message();
    // The copy taken before the put that moves the log into the next segment.
    for (keys = 1;; ++keys) {
      ASSERT_LT(keys, 100) << "the log never left its first segment";
      stale = read_file(path + "/index");
      ASSERT_TRUE(s->put("k" + std::to_string(keys), value));
      auto now = s->stats();
      ASSERT_TRUE(now) << now.error().message();
      if (now->segments > first->segments) break;
    }
    for (int more = 0; more < 3; ++more)
      ASSERT_TRUE(s->put("k" + std::to_string(++keys), value));
    ++keys;
  }
  put_back_index(path, stale);
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  for (int k = 0; k < keys; ++k) {
    auto v = s->get("k" + std::to_string(k));
    ASSERT_TRUE(v) << "k" << k << " of " << keys << ": " << v.error().message();
    EXPECT_EQ(*v, value) << "k" << k;
  }
  verify_report report;
  auto checked = s->verify(&report);
  ASSERT_TRUE(checked) << checked.error().message();
  EXPECT_EQ(*checked, static_cast<std::uint64_t>(keys));
  EXPECT_TRUE(report.damaged.empty()) << report.damaged.front().what;
}

// Where a writer stands still at `held_at` (in the thread that set `holds_here`) until
// released: a commit in flight for as long as a test needs it.
std::atomic<int> held_stage{0};  // 1: standing at the step, 2: released
commit_step held_at = commit_step::reserved;
thread_local bool holds_here = false;
void hold_at_step(commit_step at) noexcept {
  if (!holds_here || at != held_at) return;
  holds_here = false;
  held_stage.store(1);
  held_stage.notify_all();
  for (int v = held_stage.load(); v != 2; v = held_stage.load())
    held_stage.wait(v);
}

// The same, with a commit in flight when the copy was taken: its space reserved in the
// segment the log then left, no seq taken yet. It writes its block after the copy, with a
// seq the copy never handed out, in a segment below the copy's tail's, and is acknowledged.
// The next opener finds it from the slot the copy holds and rebuilds. (The commit read as its
// older value, and verify said ok.)
TEST(KvDamage, AStaleCopyTakenWhileACommitWasInFlightIsRebuilt) {
  for (const commit_step step : {commit_step::reserved, commit_step::marked}) {
    SCOPED_TRACE(name_of(step));
    temp_dir dir;
    const std::string path = dir.file("s");
    const std::string value(std::size_t{60} << 10, 'v');
    const std::string newer(std::size_t{60} << 10, 'n');
    std::string stale;
    std::vector<std::string> keys;
    {
      auto s = open_ok(path, test_support::manual_compaction());
      ASSERT_TRUE(s);
      ASSERT_TRUE(s->put("k", "old"));
      // Other keys on pages of their own: the writer held still holds the lock of k's.
      auto params =
          disk::parse_store_file(as_bytes(std::string_view(read_file(path + "/keel-kv"))));
      ASSERT_TRUE(params);
      const auto page = [&](const std::string& key) {
        return disk::hash_key(as_bytes(key), params->salt).hi >> (64 - index::initial_depth);
      };
      held_at = step;
      held_stage.store(0);
      commit_hook = hold_at_step;
      bool acknowledged = false;
      std::thread writer([&] {
        holds_here = true;
        acknowledged = s->put("k", newer).has_value();
      });
      for (int v = held_stage.load(); v != 1; v = held_stage.load())
        held_stage.wait(v);
      auto first = s->stats();
      ASSERT_TRUE(first) << first.error().message();
      for (int k = 0;; ++k) {
        ASSERT_LT(k, 200) << "the log never left the held commit's segment";
        const std::string key = "b" + std::to_string(k);
        if (page(key) == page("k")) continue;
        ASSERT_TRUE(s->put(key, value));
        keys.push_back(key);
        auto now = s->stats();
        ASSERT_TRUE(now) << now.error().message();
        if (now->segments > first->segments) break;
      }
      stale = read_file(path + "/index");
      held_stage.store(2);
      held_stage.notify_all();
      writer.join();
      commit_hook = nullptr;
      ASSERT_TRUE(acknowledged);
    }
    put_back_index(path, stale);
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    auto k = s->get("k");
    ASSERT_TRUE(k) << k.error().message();
    EXPECT_EQ(k->substr(0, 3), "nnn") << "the acknowledged commit was lost";
    for (const std::string& key : keys) {
      auto v = s->get(key);
      ASSERT_TRUE(v) << key << ": " << v.error().message();
      EXPECT_EQ(*v, value) << key;
    }
    expect_no_damage(*s);
  }
}

// Where compaction's copy of the index is taken: the index as it stands each time a
// relocation block is written, before its entries name the copies (the last one kept).
std::string relocating_index_path;
std::string relocating_index;
void copy_index_while_relocating() noexcept {
  relocating_index = read_file(relocating_index_path);
}

// The same, with the copy taken while compaction moved records: the last relocation block
// written, its entries still naming the originals in the victim, which compaction then
// removed. Nothing is written after, and no commit is in flight: the copy's segment table
// still names the victim, which the manifest no longer lists, and the next opener rebuilds.
// (A moved key read as the victim's file not found, with the store otherwise trusted.)
TEST(KvDamage, AStaleCopyTakenWhileCompactionMovedRecordsIsRebuilt) {
  temp_dir dir;
  const std::string path = dir.file("s");
  const auto value = [](int k, int round) {
    return std::string(2000, static_cast<char>('a' + round)) + std::to_string(k);
  };
  {
    auto s = open_ok(path, test_support::manual_compaction());
    ASSERT_TRUE(s);
    for (int round = 0; round < 3; ++round) {
      for (int k = 0; k < 400; ++k) {
        if (round > 0 && k % 8 == 0) continue;  // left live in the oldest segment
        ASSERT_TRUE(s->put("k" + std::to_string(k), value(k, round)));
      }
    }
    relocating_index_path = path + "/index";
    relocating_index.clear();
    relocation_written_hook = copy_index_while_relocating;
    auto done = s->compact();
    relocation_written_hook = nullptr;
    ASSERT_TRUE(done) << done.error().message();
    ASSERT_GT(done->segments_removed, 0u);
    ASSERT_FALSE(relocating_index.empty()) << "no record was moved";
  }
  put_back_index(path, relocating_index);
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  for (int k = 0; k < 400; ++k) {
    auto v = s->get("k" + std::to_string(k));
    ASSERT_TRUE(v) << "k" << k << ": " << v.error().message();
    EXPECT_EQ(*v, value(k, k % 8 == 0 ? 0 : 2)) << "k" << k;
  }
  expect_no_damage(*s);
}

// Where a writer's index is copied as its commit begins (its block goes at the copy's tail),
// and where it then stands still with its seq recorded and nothing written, until released.
std::string index_at_commit_path;
std::string index_at_commit;
void copy_at_lock_then_hold(commit_step at) noexcept {
  if (!holds_here) return;
  if (at == commit_step::locked) index_at_commit = read_file(index_at_commit_path);
  if (at == commit_step::recorded) hold_at_step(at);
}

// The same, with the copy's tail exactly where a writer that was then stopped (not killed)
// had its block: another writer, past its lock_timeout, abandons that block (its seq word
// only), and more commits follow it in the segment. The bytes at the copy's tail are no
// block's header, but they are not the zeros nothing-written leaves either: the next opener
// rebuilds. (Every commit after the copy was lost, and verify said ok.)
TEST(KvDamage, AStaleCopyWhoseTailHoldsAnAbandonedBlockIsRebuilt) {
  temp_dir dir;
  const std::string path = dir.file("s");
  options o = test_support::manual_compaction();
  o.lock_timeout = std::chrono::milliseconds(300);
  std::vector<std::string> keys;
  {
    auto s = open_ok(path, o);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("first", "1"));
    index_at_commit_path = path + "/index";
    index_at_commit.clear();
    held_at = commit_step::recorded;
    held_stage.store(0);
    commit_hook = copy_at_lock_then_hold;
    bool acknowledged = true;
    std::thread stopped([&] {
      holds_here = true;
      acknowledged = s->put("stopped", "never").has_value();
    });
    for (int v = held_stage.load(); v != 1; v = held_stage.load())
      held_stage.wait(v);
    // Keys on pages of their own: the stopped writer holds the lock of its key's. (Past its
    // lock_timeout, the first of these abandons the stopped writer's block.)
    auto params = disk::parse_store_file(as_bytes(std::string_view(read_file(path + "/keel-kv"))));
    const auto page = [&](const std::string& key) {
      return disk::hash_key(as_bytes(key), params->salt).hi >> (64 - index::initial_depth);
    };
    std::string failed;
    for (int k = 0; params && keys.size() < 20 && failed.empty(); ++k) {
      const std::string key = "after" + std::to_string(k);
      if (page(key) == page("stopped")) continue;
      auto put = s->put(key, "v" + std::to_string(k));
      if (!put) failed = key + ": " + put.error().message();
      keys.push_back(key);
    }
    held_stage.store(2);
    held_stage.notify_all();
    stopped.join();
    commit_hook = nullptr;
    ASSERT_TRUE(params);
    ASSERT_TRUE(failed.empty()) << failed;
    EXPECT_FALSE(acknowledged) << "the stopped writer's block was not abandoned";
    ASSERT_FALSE(index_at_commit.empty());
  }
  put_back_index(path, index_at_commit);
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  for (const std::string& key : keys) {
    auto v = s->get(key);
    ASSERT_TRUE(v) << key << ": " << v.error().message();
    EXPECT_EQ(*v, "v" + key.substr(5));
  }
  expect_no_damage(*s);
}

// A bit flipped in the header of a closed store's newest commit block: its bytes are no
// longer a block, but they lie where the last close recorded every block as written whole,
// so the rebuild finds them for what they are (damage, the store refused naming it) rather
// than space nobody wrote, which would serve the older version.
TEST(KvDamage, ADamagedBlockHeaderIsNeverTakenForEmptySpace) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("a", "old a"));
    ASSERT_TRUE(s->put("a", "<header-marker>"));
  }
  place newest = find_last(path, "<header-marker>");
  ASSERT_NE(newest.offset, std::string::npos);
  // The key ("a") is after the record's 48-byte header, which follows the block's.
  newest.offset -= 1 + 48 + 48;
  flip_bit(newest, 12);  // the block's seq
  std::filesystem::remove(path + "/index");
  auto s = store::open(path, small());
  if (!s) {
    EXPECT_EQ(s.error(), errc::corrupt) << s.error().message();
    EXPECT_EQ(s.error().path(), newest.file);
    return;
  }
  auto a = (*s)->get("a");
  ASSERT_FALSE(a) << "served: " << *a;
}

// A whole commit block zeroed in a store its last user closed: no byte of it is left to
// find, but the close counted the blocks below what it recorded as durable, segment by
// segment, in the manifest: a rebuild that finds one fewer refuses the store naming the
// segment and where the block was, and `verify` lists it. (The rebuild once took the zeros
// for space nobody wrote, served the older value, and verify said ok.) The newest block of
// the segment; one with blocks after it; one after a checkpoint (the rebuild replays that
// segment from the middle).
class KvZeroedBlock : public ::testing::TestWithParam<int> {};

TEST_P(KvZeroedBlock, IsDamageNeverAnOlderValue) {
  const int where = GetParam();
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    for (int k = 0; k < 20; ++k)
      ASSERT_TRUE(s->put("k" + std::to_string(k), "v" + std::to_string(k)));
    ASSERT_TRUE(s->put("a", "old a"));
    if (where == 2) {
      ASSERT_TRUE(s->checkpoint());
    }
    ASSERT_TRUE(s->put("a", "<zeroed-block> new a"));
    if (where == 1) {
      for (int k = 0; k < 20; ++k)
        ASSERT_TRUE(s->put("k" + std::to_string(k), "w" + std::to_string(k)));
    }
  }
  const place marker = find_last(path, "<zeroed-block>");
  ASSERT_NE(marker.offset, std::string::npos);
  const std::size_t block = marker.offset - 1 - 48 - 48;  // key "a", record and block headers
  {
    std::string bytes = read_file(marker.file);
    std::uint64_t length = 0;
    std::memcpy(&length, bytes.data() + block + 16, 8);
    ASSERT_GT(length, 48u);
    ASSERT_LT(length, 4096u);
    std::memset(bytes.data() + block, 0, length);
    write_file(marker.file, bytes);
  }
  {
    // The index still names the record: reading it is corrupt; verify lists the block.
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    auto a = s->get("a");
    ASSERT_FALSE(a) << "served: " << *a;
    EXPECT_EQ(a.error(), errc::corrupt) << a.error().message();
    verify_report report;
    auto v = s->verify(&report);
    ASSERT_FALSE(v) << "verify said ok";
    EXPECT_EQ(v.error(), errc::corrupt) << v.error().message();
    bool named = false;
    for (const damage& d : report.damaged)
      named |= d.file == marker.file && d.offset == block;
    EXPECT_TRUE(named) << report.damaged.size() << " places, the first: "
                       << (report.damaged.empty() ? ""
                                                  : report.damaged[0].file + " " +
                                                        std::to_string(report.damaged[0].offset) +
                                                        " " + report.damaged[0].what);
  }
  std::filesystem::remove(path + "/index");  // as a reboot would have it rebuilt
  auto s = store::open(path, small());
  if (!s) {
    EXPECT_EQ(s.error(), errc::corrupt) << s.error().message();
    EXPECT_EQ(s.error().path(), marker.file) << s.error().message();
    EXPECT_TRUE(s.error().has_offset() && s.error().offset() == block) << s.error().message();
    return;
  }
  auto a = (*s)->get("a");
  ASSERT_FALSE(a) << "rolled back to: " << *a;
}

INSTANTIATE_TEST_SUITE_P(Where, KvZeroedBlock, ::testing::Values(0, 1, 2));

// The header of a `sync` commit's block damaged after every user was killed (no close
// recorded it as durable), the index kept: the index still names its records, so `verify`
// lists the block, the value stays served, and the next close neither buries the block as
// a dead writer's nor records it as durable. (verify said ok; a close could bury it, and the
// next rebuild then served the older value.) Without the index, such a block cannot be
// told from one a power cut tore (doc/kv-format.md, "What a rebuild cannot tell").
class KvDamagedUnclosedHeader : public ::testing::TestWithParam<bool> {};

TEST_P(KvDamagedUnclosedHeader, IsListedByVerifyAndNeverBuried) {
  const bool zeroed = GetParam();  // the whole header, else one bit of its seq
  temp_dir dir;
  const std::string path = dir.file("s");
  const std::string newest = "<unclosed-marker> new a";
  const pid_t writer = fork_child([&] {
    auto s = store::open(path, sync_small());
    if (!s || !(*s)->put("a", "old a") || !(*s)->put("a", newest)) return 2;
    for (int k = 0; k < 20; ++k) {
      if (!(*s)->put("k" + std::to_string(k), "v")) return 3;
    }
    ::raise(SIGKILL);
    return 4;
  });
  ASSERT_EQ(test::wait_exit(writer), 128 + SIGKILL);
  const place marker = find_last(path, "<unclosed-marker>");
  ASSERT_NE(marker.offset, std::string::npos);
  const std::size_t block = marker.offset - 1 - 48 - 48;  // key "a", record and block headers
  {
    std::string bytes = read_file(marker.file);
    ASSERT_EQ(bytes.compare(block, 4, "VBK1"), 0);
    if (zeroed) {
      std::memset(bytes.data() + block, 0, sizeof(disk::block_header));
    } else {
      bytes[block + offsetof(disk::block_header, seq)] ^= 0x01;
    }
    write_file(marker.file, bytes);
  }
  for (int session = 0; session < 2; ++session) {
    auto s = open_ok(path, sync_small());  // the first: alone after the kill
    ASSERT_TRUE(s);
    EXPECT_EQ(s->get("a").value_or("?"), newest) << "session " << session;
    verify_report report;
    auto v = s->verify(&report);
    ASSERT_FALSE(v) << "session " << session << ": verify said ok";
    EXPECT_EQ(v.error(), errc::corrupt) << v.error().message();
    bool named = false;
    for (const damage& d : report.damaged)
      named |= d.file == marker.file && d.offset == marker.offset - 1 - 48;
    EXPECT_TRUE(named) << "session " << session << ": the record's block is not listed";
  }  // each session's close: the block stays as it is
  std::string bytes = read_file(marker.file);
  if (zeroed) {
    EXPECT_EQ(bytes.substr(block, sizeof(disk::block_header)),
              std::string(sizeof(disk::block_header), '\0'))
        << "buried";
  }
}

INSTANTIATE_TEST_SUITE_P(ZeroedOrFlipped, KvDamagedUnclosedHeader, ::testing::Bool());

// verify while another process commits: a commit published after the walk passed its
// place is no damage. (Each verify but a few listed "a record an index entry names lies in
// no block that checks out" for such commits.)
TEST(KvVerify, FindsNoDamageWhileAnotherProcessCommits) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("first", "1"));
  const test::signal_pipe writing;
  const pid_t writer = fork_child([&] {
    auto mine = store::open(path, small());
    if (!mine) return 2;
    for (int k = 0; k < 100'000; ++k) {  // a few dozen segments, overwritten
      if (!(*mine)->put("k" + std::to_string(k % 2000), std::string(200, 'w'))) return 3;
      if (k == 100) writing.notify();
    }
    return 0;
  });
  test::killed_on_failure guard{writer};
  ASSERT_TRUE(writing.ready_within(std::chrono::minutes(2))) << "the writer never wrote";
  int rounds = 0;
  int status = 0;
  for (; ::waitpid(writer, &status, WNOHANG) == 0; ++rounds) {
    verify_report report;
    auto v = s->verify(&report);
    if (!v && v.error() == std::errc::timed_out) continue;
    ASSERT_TRUE(v) << "round " << rounds << ": " << v.error().message() << ": "
                   << (report.damaged.empty() ? "" : report.damaged[0].what);
  }
  guard.pid = 0;  // reaped
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "writer status " << status;
  EXPECT_GT(rounds, 0);
  std::printf("%d verifies while the writer committed\n", rounds);
  EXPECT_TRUE(s->verify());
  EXPECT_EQ(s->get("k1999").value_or("?"), std::string(200, 'w'));
}

// salvage: a store damaged so that it will not open (its manifest gone) and with the newest
// version of one key damaged: every other key's newest value is copied into a new store, the
// damaged key's older version is, and both are listed.
TEST(KvDamage, SalvageCopiesWhatCanBeReadAndListsTheRest) {
  temp_dir dir;
  const std::string path = dir.file("s");
  const std::string big = big_value('S');
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    for (int k = 0; k < 500; ++k)
      ASSERT_TRUE(s->put("k" + std::to_string(k), "first " + std::to_string(k)));
    for (int k = 0; k < 500; k += 2)
      ASSERT_TRUE(s->put("k" + std::to_string(k), "second " + std::to_string(k)));
    ASSERT_TRUE(s->erase("k7"));
    ASSERT_TRUE(s->put("blob", big));
    ASSERT_TRUE(s->put("k4", "newest <salvage-marker> of k4"));
  }
  flip_bit(find_last(path, "<salvage-marker>"), 3);
  std::filesystem::remove(path + "/manifest");
  ASSERT_FALSE(store::open(path, small())) << "the store should refuse to open";
  const std::string to = dir.file("salvaged");
  auto r = store::salvage(path, to, small());
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_EQ(r->keys, 500u);  // 500 less k7, plus blob
  EXPECT_EQ(r->erased, 1u);
  ASSERT_EQ(r->unreadable.size(), 1u);
  EXPECT_NE(r->unreadable[0].what.find("\"k4\""), std::string::npos) << r->unreadable[0].what;
  ASSERT_EQ(r->older.size(), 1u);
  EXPECT_EQ(r->older[0].key, "k4");
  auto s = open_ok(to);
  ASSERT_TRUE(s);
  for (int k = 0; k < 500; ++k) {
    const std::string key = "k" + std::to_string(k);
    auto v = s->get(key);
    if (k == 7) {
      EXPECT_EQ(v.error(), errc::not_found);
      continue;
    }
    ASSERT_TRUE(v) << key << ": " << v.error().message();
    EXPECT_EQ(*v, (k % 2 == 0 ? "second " : "first ") + std::to_string(k)) << "k4: older copied";
  }
  EXPECT_EQ(*s->get("blob"), big);
  EXPECT_TRUE(s->verify());
  // A second salvage into the same place is refused: it holds a store now.
  EXPECT_FALSE(store::salvage(path, to, small()));
}

// A segment cut short by hand: salvage copies what the rest holds, and lists the segment as
// unreadable past its end (it exited 0 listing nothing while 197 keys were lost).
TEST(KvDamage, SalvageListsASegmentCutShort) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path, small());
    ASSERT_TRUE(s);
    for (int i = 0; i < 1000; ++i)
      ASSERT_TRUE(s->put("k" + std::to_string(i), std::string(700, 'v')));
  }
  const std::string seg = segment_files(path).front();
  const auto size = std::filesystem::file_size(seg);
  std::filesystem::resize_file(seg, 100000);
  auto r = store::salvage(path, dir.file("copy"), small());
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_LT(r->keys, 1000u);
  EXPECT_GT(r->keys, 0u);
  ASSERT_EQ(r->unreadable.size(), 1u);
  EXPECT_EQ(r->unreadable[0].file, seg);
  EXPECT_EQ(r->unreadable[0].offset, 100000u);
  EXPECT_NE(r->unreadable[0].what.find("cut short: 100000 of its " + std::to_string(size)),
            std::string::npos)
      << r->unreadable[0].what;
  // The store itself says where the file ends (it said offset 48, its header's end).
  auto s = store::open(path, small());
  const auto refused = [&]() -> std::optional<error> {
    if (!s) return s.error();
    if (auto v = (*s)->verify(); !v) return v.error();
    return std::nullopt;
  }();
  ASSERT_TRUE(refused.has_value()) << "a segment cut short went unnoticed";
  EXPECT_EQ(*refused, errc::corrupt) << refused->message();
  EXPECT_EQ(refused->path(), seg);
  EXPECT_EQ(refused->offset(), 100000u);
}

// Salvage into a store of the smallest segments (1 MiB) copies values that together are
// many times a segment, and values of every size. (Its commits once batched 16 MiB and
// failed with too_large.)
TEST(KvDamage, SalvageIntoSmallSegmentsCopiesEverything) {
  temp_dir dir;
  const std::string path = dir.file("s");
  std::map<std::string, std::string> want;
  {
    auto s = open_ok(path, small());
    ASSERT_TRUE(s);
    for (int i = 0; i < 300; ++i) {
      const std::string k = "k" + std::to_string(i);
      want[k] = std::string(i % 3 == 0 ? 60000 : 8000, static_cast<char>('a' + i % 26));
      ASSERT_TRUE(s->put(k, want[k]));
    }
  }
  const std::string to = dir.file("copy");
  auto r = store::salvage(path, to, small());
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_EQ(r->keys, want.size());
  EXPECT_TRUE(r->unreadable.empty());
  auto copy = open_ok(to, small());
  ASSERT_TRUE(copy);
  for (const auto& [k, v] : want)
    EXPECT_EQ(copy->get(k).value_or("?"), v) << k;
}

}  // namespace
}  // namespace keel::kv
