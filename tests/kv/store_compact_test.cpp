// keel::kv compaction: dead segments go, every live value stays (through reopening and a
// rebuild from the segments alone), while others read and write, with a compactor killed at
// any moment, and never under a snapshot that may still need an old version.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "keel/io/fault_filesystem.hpp"
#include "keel/kv/store.hpp"
#include "keel/lock/memory_map.hpp"
#include "kv/kv_support.hpp"
#include "kv/store_dir.hpp"
#include "kv/store_impl.hpp"
#include "lock/memory_map/slot_table.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;

using test_support::manual_compaction;
using test_support::open_ok;
using test_support::small;

struct files {
  std::size_t count = 0;
  std::uintmax_t bytes = 0;
};

files segments_of(const std::string& path) {
  files f;
  for (const auto& e : std::filesystem::directory_iterator(path + "/seg")) {
    // Made ahead, not segments of the log.
    if (e.path().filename() == "spare" || e.path().filename() == "deletes") continue;
    ++f.count;
    f.bytes += e.file_size();
  }
  return f;
}

std::string value_of(int key, int version, std::size_t size = 1000) {
  std::string v = "k" + std::to_string(key) + "v" + std::to_string(version) + ":";
  v.resize(size, static_cast<char>('a' + (key + version) % 26));
  return v;
}

// Every key has the value of `version[key]` (-1: absent).
void expect_values(store& s, const std::vector<int>& version, const char* when,
                   std::size_t size = 1000) {
  int bad = 0;
  for (int k = 0; k < static_cast<int>(version.size()); ++k) {
    auto v = s.get("k" + std::to_string(k));
    const int want = version[static_cast<std::size_t>(k)];
    if (want < 0) {
      if ((v || v.error() != errc::not_found) && bad++ < 5) {
        ADD_FAILURE() << when << ": k" << k << " should be absent";
      }
    } else if ((!v || *v != value_of(k, want, size)) && bad++ < 5) {
      ADD_FAILURE() << when << ": k" << k << ": " << (v ? v->substr(0, 20) : v.error().message());
    }
  }
}

// A writer of its own process opens the store at `path` and puts `key`: it must die, killed at
// step `at` of its commit.
void put_killed_at(const std::string& path, const options& o, commit_step at,
                   const std::string& key, const std::string& value) {
  const pid_t writer = fork_child([&] {
    auto mine = store::open(path, o);
    if (!mine) return 2;
    test_support::die_at(at);
    return (*mine)->put(key, value) ? 3 : 4;
  });
  ASSERT_EQ(test::wait_exit(writer), 128 + SIGKILL) << "not killed at its step";
}

// Compacts `s`, then expects `key` to hold `want`, and the store to verify, there and in a
// rebuild from the segments alone (`s` is closed first).
void compact_then_expect_through_a_rebuild(std::unique_ptr<store> s, const std::string& path,
                                           const options& o, const std::string& key,
                                           const std::string& want) {
  auto c = s->compact();
  ASSERT_TRUE(c) << c.error().message();
  const auto check = [&](store& st, const char* when) {
    auto v = st.get(key);
    ASSERT_TRUE(v) << when << ": " << v.error().message();
    EXPECT_EQ(*v, want) << when;
    auto checked = st.verify();
    EXPECT_TRUE(checked) << when << ": " << checked.error().message();
  };
  check(*s, "compacted");
  s.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path, o);
  ASSERT_TRUE(rebuilt);
  check(*rebuilt, "rebuilt");
}

TEST(KvCompact, RemovesDeadSegmentsAndKeepsEveryValue) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path, manual_compaction());
  ASSERT_TRUE(s);
  constexpr int keys = 2000;
  std::vector<int> version(keys, -1);
  for (int round = 0; round < 3; ++round) {
    for (int k = 0; k < keys; ++k) {
      if (round == 2 && k % 3 == 0) continue;  // a third stay live in older segments
      ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, round)));
      version[static_cast<std::size_t>(k)] = round;
    }
  }
  for (int k = 0; k < keys; k += 7) {
    ASSERT_TRUE(s->erase("k" + std::to_string(k)));
    version[static_cast<std::size_t>(k)] = -1;
  }
  const files before = segments_of(path);
  auto c = s->compact();
  ASSERT_TRUE(c) << c.error().message();
  const files after = segments_of(path);
  EXPECT_GT(c->segments_removed, 0u);
  EXPECT_GT(c->records_moved, 0u);
  EXPECT_LT(after.count, before.count);
  EXPECT_LT(after.bytes, before.bytes * 3 / 4)
      << before.count << " segments before, " << after.count << " after";
  expect_values(*s, version, "compacted");
  // Twice in a row: nothing left to do is no error.
  auto again = s->compact();
  ASSERT_TRUE(again) << again.error().message();
  expect_values(*s, version, "compacted twice");
  // Writes go on, and the next open and a rebuild from the segments alone agree.
  ASSERT_TRUE(s->put("k1", value_of(1, 9)));
  version[1] = 9;
  s.reset();
  auto reopened = open_ok(path);
  ASSERT_TRUE(reopened);
  expect_values(*reopened, version, "reopened");
  auto st = reopened->stats();
  ASSERT_TRUE(st);
  EXPECT_EQ(st->records, static_cast<std::uint64_t>(keys - (keys + 6) / 7));
  reopened.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path);
  ASSERT_TRUE(rebuilt);
  expect_values(*rebuilt, version, "rebuilt");
  auto v = rebuilt->verify();
  EXPECT_TRUE(v) << v.error().message();
}

TEST(KvCompact, MovesBlobsWithTheirRecords) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path, manual_compaction());
  ASSERT_TRUE(s);
  constexpr int keys = 40;
  constexpr std::size_t size = 100 * 1024;  // above the blob threshold
  std::vector<int> version(keys, -1);
  for (int round = 0; round < 3; ++round) {
    for (int k = 0; k < keys; ++k) {
      if (round == 2 && k % 2 == 0) continue;  // half keep an old version: live in old files
      ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, round, size)));
      version[static_cast<std::size_t>(k)] = round;
    }
  }
  const files before = segments_of(path);
  auto c = s->compact();
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_GT(c->segments_removed, 0u);
  EXPECT_GT(c->records_moved, 0u);
  EXPECT_LT(segments_of(path).bytes, before.bytes);
  expect_values(*s, version, "compacted", size);
  s.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path, manual_compaction());
  ASSERT_TRUE(rebuilt);
  expect_values(*rebuilt, version, "rebuilt", size);
}

// A commit whose blob is dead (its key overwritten) and whose other record is live: once the
// blob's segment is compacted away, the commit still counts as whole, at once and after a
// rebuild, so its live record is neither lost nor rolled back.
TEST(KvCompact, ACommitOutlivesItsRemovedDeadBlob) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  const std::string big((std::size_t{3} << 20) / 2, 'B');  // a segment of its own
  {
    auto t = s->begin();
    ASSERT_TRUE(t);
    ASSERT_TRUE(t->put("blob", big));
    ASSERT_TRUE(t->put("small", "kept"));
    ASSERT_TRUE(t->commit());
  }
  ASSERT_TRUE(s->put("blob", "gone"));
  for (int k = 0; k < 1500; ++k)  // moves the tail past the blob's segment
    ASSERT_TRUE(s->put("f" + std::to_string(k), value_of(k, 0)));
  const files before = segments_of(path);
  auto c = s->compact();
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_GE(c->segments_removed, 1u);
  EXPECT_LT(segments_of(path).bytes + big.size() / 2, before.bytes) << "the blob's file went";
  EXPECT_EQ(*s->get("small"), "kept");
  EXPECT_EQ(*s->get("blob"), "gone");
  s.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path);
  ASSERT_TRUE(rebuilt);
  auto v = rebuilt->get("small");
  ASSERT_TRUE(v) << "the commit was dropped: " << v.error().message();
  EXPECT_EQ(*v, "kept");
  EXPECT_EQ(*rebuilt->get("blob"), "gone");
  auto checked = rebuilt->verify();
  EXPECT_TRUE(checked) << checked.error().message();
  // And a second compaction, with the commit's own segment perhaps a victim, keeps it too.
  for (int k = 0; k < 1500; ++k)
    ASSERT_TRUE(rebuilt->put("f" + std::to_string(k), value_of(k, 1)));
  ASSERT_TRUE(rebuilt->compact());
  EXPECT_EQ(*rebuilt->get("small"), "kept");
}

// A blob that fills the rest of a segment, so that its commit's block lands in the next one
// (the tail's, never a candidate), and a writer killed with its entry pending: the blob's
// segment holds no record any settled entry names, but the pending entry needs it either
// way. "written": the dead writer's sealed commit (of the blob) is made visible by the next
// commit; "marked": the dead writer overwrote a committed blob, which its entry goes back to.
class KvCompactPending : public testing::TestWithParam<commit_step> {};

TEST_P(KvCompactPending, KeepsTheBlobOfADeadWritersEntryWhoseBlockIsInTheTailsSegment) {
  temp_dir dir;
  const std::string path = dir.file("s");
  const options o = manual_compaction();
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  // A fresh store's first segment: its header, then this blob's block to the very end.
  const std::string blob(o.segment_size - disk::segment_header_size - sizeof(disk::block_header),
                         'B');
  const commit_step kill_at = GetParam();
  if (kill_at == commit_step::marked) {
    ASSERT_TRUE(s->put("big", blob));
  }
  ASSERT_NO_FATAL_FAILURE(put_killed_at(
      path, o, kill_at, "big", kill_at == commit_step::marked ? std::string("small") : blob));
  ASSERT_EQ(segments_of(path).count, 2u) << "the blob and its block share a segment";
  ASSERT_TRUE(s->put("next", "settles the dead writer's commit"));
  {
    auto v = s->get("big");
    ASSERT_TRUE(v) << v.error().message();
    ASSERT_EQ(*v, blob);
  }
  compact_then_expect_through_a_rebuild(std::move(s), path, o, "big", blob);
}

INSTANTIATE_TEST_SUITE_P(DeadWriters, KvCompactPending,
                         testing::Values(commit_step::written, commit_step::marked),
                         [](const auto& param) {
                           return param.param == commit_step::written ? "Written" : "Marked";
                         });

// A value larger than a segment gets a segment of its own, numbered above the tail's. Those of
// overwritten values, and of a put killed after its value was written, are dead: compaction
// removes them while the tail stays below (it once took only segments below the tail's, and a
// store of large values grew by each one overwritten: "removed 0 segments", 419 MB dead).
TEST(KvCompact, SegmentsOfOverwrittenOrInterruptedLargeValuesAreRemovedBelowOrAboveTheTail) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path, manual_compaction());
  ASSERT_TRUE(s);
  const auto big = [](char c) { return std::string((std::size_t{3} << 20) / 2, c); };
  ASSERT_TRUE(s->put("small", "kept"));
  for (const char c : {'a', 'b', 'c'})
    ASSERT_TRUE(s->put("big", big(c)));
  // A put killed once its value is written, before its commit: its segment holds nothing live.
  ASSERT_NO_FATAL_FAILURE(
      put_killed_at(path, manual_compaction(), commit_step::locked, "other", big('x')));
  ASSERT_TRUE(s->put("big", big('d')));  // the highest segment, live
  const files before = segments_of(path);
  auto c = s->compact();
  ASSERT_TRUE(c) << c.error().message();
  // a, b, c and the killed put's: all but the live d, the highest.
  EXPECT_EQ(c->segments_removed, 4u);
  EXPECT_GE(before.bytes - segments_of(path).bytes, 4 * big('a').size());
  EXPECT_EQ(*s->get("big"), big('d'));
  EXPECT_EQ(*s->get("small"), "kept");
  EXPECT_EQ(s->get("other").error(), errc::not_found);
  verify_report report;
  auto checked = s->verify(&report);
  EXPECT_TRUE(checked) << checked.error().message();
  EXPECT_TRUE(report.damaged.empty()) << report.damaged.size() << " damaged";
  s.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path, manual_compaction());
  ASSERT_TRUE(rebuilt);
  EXPECT_EQ(*rebuilt->get("big"), big('d'));
  EXPECT_EQ(*rebuilt->get("small"), "kept");
  EXPECT_EQ(rebuilt->get("other").error(), errc::not_found);
}

// The highest segment the manifest lists goes too once it is dead (a large value erased or
// overwritten last stayed whole before, and `compact` said "removed 0 segments"), and its number
// is never used again: a rebuild numbers new segments from the manifest's *numbered below*. Here
// it is a dead large value's, above the tail, and seg/ also holds a leftover numbered above it
// (a maker killed after naming its file, before listing it: made here by hand). Before the
// manifest kept it, a rebuild once numbered a new log segment with a removed number, the old
// commit's dead blob location pointed into it, and the next rebuild judged that commit torn: its
// other key was lost.
TEST(KvCompact, TheHighestSegmentTheManifestListsGoesWhenDeadAndItsNumberIsNeverUsedAgain) {
  temp_dir dir;
  const std::string path = dir.file("s");
  const options o = manual_compaction();
  const std::string big((std::size_t{3} << 20) / 2, 'a');  // a segment of its own
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("small", "kept"));
  {
    auto t = s->begin();
    ASSERT_TRUE(t);
    ASSERT_TRUE(t->put("big", big));
    ASSERT_TRUE(t->put("k", "v"));  // in the same commit block as the blob's record
    ASSERT_TRUE(t->commit());
  }
  ASSERT_TRUE(s->put("big", std::string(big.size(), 'b')));
  ASSERT_TRUE(s->put("big", "tiny"));  // both large values dead
  ASSERT_EQ(segments_of(path).count, 3u);
  {
    auto d = open_store_dir(path, {.create_if_missing = false});
    ASSERT_TRUE(d) << d.error().message();
    const disk::segment_params leftover{d->params.id, 4, disk::segment_header_size + big.size()};
    const auto head = disk::encode_segment_header(leftover, d->params.salt);
    std::ofstream f(path + "/seg/0000000000000004", std::ios::binary);
    f.write(reinterpret_cast<const char*>(head.data()), static_cast<std::streamsize>(head.size()));
    f.seekp(static_cast<std::streamoff>(leftover.size) - 1);
    f.put('\0');
    ASSERT_TRUE(f.flush());
  }
  const files before = segments_of(path);
  auto c = s->compact();
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(c->segments_removed, 2u) << "both large values' segments, the highest listed too";
  EXPECT_GE(before.bytes - segments_of(path).bytes, 2 * big.size());
  EXPECT_FALSE(std::filesystem::exists(path + "/seg/0000000000000003"));
  EXPECT_EQ(*s->get("k"), "v");
  s.reset();
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE("rebuild " + std::to_string(round));
    std::filesystem::remove(path + "/index");
    std::filesystem::remove(path + "/checkpoint");
    auto r = open_ok(path, o);
    ASSERT_TRUE(r);
    auto v = r->get("k");
    ASSERT_TRUE(v) << "a committed key lost: " << v.error().message();
    EXPECT_EQ(*v, "v");
    EXPECT_EQ(*r->get("small"), "kept");
    EXPECT_EQ(*r->get("big"), "tiny");
    auto checked = r->verify();
    EXPECT_TRUE(checked) << checked.error().message();
    for (int i = 0; i < 1200; ++i)  // new log segments, numbered by the rebuild
      ASSERT_TRUE(r->put("f" + std::to_string(i), value_of(i, round)));
    EXPECT_FALSE(std::filesystem::exists(path + "/seg/0000000000000002"));
    EXPECT_FALSE(std::filesystem::exists(path + "/seg/0000000000000003"))
        << "a removed segment's number used again";
  }
}

// A store whose manifest is version 2 (no *numbered below*; what keel wrote before): read as
// if every number up to its highest listed was handed out, so the dead highest goes and its
// number is kept by the version 3 slot that change writes.
TEST(KvCompact, AVersionTwoManifestKeepsItsHighestNumberHandedOut) {
  temp_dir dir;
  const std::string path = dir.file("s");
  const options o = manual_compaction();
  const std::string big((std::size_t{3} << 20) / 2, 'a');
  {
    auto s = open_ok(path, o);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("small", "kept"));
    ASSERT_TRUE(s->put("big", big));
    ASSERT_TRUE(s->put("big", "tiny"));
  }
  ASSERT_EQ(segments_of(path).count, 2u);
  // Each slot written as version 2 would have: the header 8 bytes shorter, no numbered below.
  bool all_version_two = true;
  ASSERT_GT(test_support::rewrite_manifest_slots(
                path,
                [&](const disk::manifest& m, const store_dir& d) {
                  auto v3 = disk::encode_manifest(d.params.id, m, d.params.salt);
                  // less numbered below and checksum
                  std::vector<std::byte> v2(v3.begin(), v3.end() - 16);
                  std::copy(v3.begin() + 72, v3.end() - 8, v2.begin() + 64);
                  const base::format_header h = disk::manifest_format_v2.header();
                  std::memcpy(v2.data(), &h, sizeof h);
                  const std::uint64_t sum =
                      disk::checksum(std::span<const std::byte>(v2), d.params.salt);
                  v2.resize(v2.size() + 8);
                  std::memcpy(v2.data() + v2.size() - 8, &sum, 8);
                  all_version_two &=
                      static_cast<bool>(disk::parse_manifest(v2, d.params.id, d.params.salt));
                  return v2;
                }),
            0);
  ASSERT_TRUE(all_version_two) << "not a version 2 slot";
  const auto read_file = [&] {
    std::ifstream f(path + "/manifest", std::ios::binary);
    return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  const std::vector<char> as_version_two = read_file();
  const auto versions = [&] {
    const std::vector<char> file = read_file();
    std::vector<std::uint32_t> v;
    for (std::size_t at = 0; at < file.size(); at += file.size() / 2) {
      base::format_header h{};
      std::memcpy(&h, file.data() + at, sizeof h);
      v.push_back(h.version);
    }
    return v;
  };
  {
    auto s = open_ok(path, o);
    ASSERT_TRUE(s);
    auto c = s->compact();
    ASSERT_TRUE(c) << c.error().message();
    EXPECT_EQ(c->segments_removed, 1u) << "the dead large value's, the highest listed";
    EXPECT_FALSE(std::filesystem::exists(path + "/seg/0000000000000002"));
  }
  // Both slots are version 3 now: keel before it, which would fall back on a version 2 slot
  // and find segment 2 gone (`corrupt`), refuses the store as unsupported instead.
  const std::vector<std::uint32_t> both_three(2, disk::manifest_format.version);
  EXPECT_EQ(versions(), both_three);
  // As a user killed between the change's two writes leaves it: the second slot written (the
  // higher generation) still as version 2 had it. A writable opener alone writes it over.
  {
    std::vector<char> file = read_file();
    ASSERT_EQ(file.size(), as_version_two.size());
    const std::size_t slot = file.size() / 2;
    std::uint64_t generation[2] = {};
    for (std::size_t i = 0; i < 2; ++i)
      std::memcpy(&generation[i], file.data() + i * slot + 40, 8);
    const std::size_t second = generation[0] > generation[1] ? 0 : 1;
    std::copy_n(as_version_two.begin() + static_cast<std::ptrdiff_t>(second * slot), slot,
                file.begin() + static_cast<std::ptrdiff_t>(second * slot));
    std::ofstream f(path + "/manifest", std::ios::binary | std::ios::in);
    f.write(file.data(), static_cast<std::streamsize>(file.size()));
    ASSERT_TRUE(f.flush());
  }
  ASSERT_NE(versions(), both_three);
  {
    auto s = open_ok(path, o);
    ASSERT_TRUE(s);
    EXPECT_EQ(*s->get("small"), "kept");
  }
  EXPECT_EQ(versions(), both_three) << "a version 2 slot left beside a version 3 one";
  std::filesystem::remove(path + "/index");
  std::filesystem::remove(path + "/checkpoint");
  auto r = open_ok(path, o);
  ASSERT_TRUE(r);
  EXPECT_EQ(*r->get("big"), "tiny");
  EXPECT_EQ(*r->get("small"), "kept");
  for (int i = 0; i < 1200; ++i)
    ASSERT_TRUE(r->put("f" + std::to_string(i), value_of(i, 0)));
  EXPECT_FALSE(std::filesystem::exists(path + "/seg/0000000000000002"))
      << "a removed segment's number used again";
}

// A dead writer's entry, pending, and a value of its own segment above the tail: the one it
// wrote (killed once its commit was sealed, made visible by the next commit) or the committed
// one it overwrote (killed once marked, its entry goes back to that one). The segment holds
// no record a settled entry names, and stays.
TEST(KvCompact, ADeadWritersLargeValueAboveTheTailStays) {
  for (const commit_step at : {commit_step::written, commit_step::marked}) {
    SCOPED_TRACE(at == commit_step::written ? "written" : "marked");
    temp_dir dir;
    const std::string path = dir.file("s");
    const options o = manual_compaction();
    const std::string big((std::size_t{3} << 20) / 2, 'a');
    auto s = open_ok(path, o);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("small", "kept"));
    if (at == commit_step::marked) {
      ASSERT_TRUE(s->put("big", big));
    }
    ASSERT_NO_FATAL_FAILURE(
        put_killed_at(path, o, at, "big", at == commit_step::marked ? std::string("tiny") : big));
    ASSERT_TRUE(s->put("later", "settles the dead writer's commit"));
    // Two more segments above, so that the value's is not the highest.
    ASSERT_TRUE(s->put("other", std::string(big.size(), 'o')));
    ASSERT_TRUE(s->put("other", std::string(big.size(), 'p')));
    compact_then_expect_through_a_rebuild(std::move(s), path, o, "big", big);
  }
}

// A dead writer's pending entry whose previous record is damaged past its head (a padding
// byte): the walk reads what it reads of a settled entry's record, its head, and compaction
// goes on. Read whole, it failed every compaction ("corrupt") until the key was written again:
// on a full volume every put that asked for room.
TEST(KvCompact, APendingEntrysRecordDamagedPastItsHeadStopsNoCompaction) {
  temp_dir dir;
  const std::string path = dir.file("s");
  const options o = manual_compaction();
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("v", "hello"));  // key and value 6 bytes: 2 of padding
  for (int i = 0; i < 14; ++i)        // the tail past segment 1, most of it dead
    ASSERT_TRUE(s->put("f" + std::to_string(i % 2), std::string(100 << 10, 'f')));
  {
    const std::string seg = path + "/seg/0000000000000001";
    const std::string bytes = test::slurp(seg);
    const std::size_t at = bytes.find("vhello");
    ASSERT_NE(at, std::string::npos);
    ASSERT_EQ(bytes.substr(at + 6, 2), std::string(2, '\0'));
    std::fstream out(seg, std::ios::binary | std::ios::in | std::ios::out);
    out.seekp(static_cast<std::streamoff>(at + 7));
    out.put('Z');
    ASSERT_TRUE(out.flush());
  }
  ASSERT_NO_FATAL_FAILURE(put_killed_at(path, o, commit_step::marked, "v", "new"));
  for (int i = 0; i < 2; ++i) {
    auto c = s->compact();
    ASSERT_TRUE(c) << "compaction " << i << ": " << c.error().message();
    ASSERT_TRUE(s->put("x" + std::to_string(i), "y"));
  }
  EXPECT_EQ(*s->get("f0"), std::string(100 << 10, 'f'));
}

TEST(KvCompact, NeverRemovesWhatAnOlderSnapshotMayRead) {
  temp_dir dir;
  const std::string path = dir.file("s");
  options o = small();
  o.lock_timeout = std::chrono::milliseconds(200);
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  for (int k = 0; k < 1500; ++k)
    ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, 0)));
  auto old = s->begin();  // sees version 0 of everything
  ASSERT_TRUE(old);
  for (int k = 0; k < 1500; ++k)
    ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, 1)));
  // From another thread (this one holds a transaction): it must wait for `old`, and gives up.
  result<compact_stats> c = errc_error(std::errc::invalid_argument);
  std::thread([&] { c = s->compact(); }).join();
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error(), std::errc::timed_out);
  for (int k = 0; k < 1500; k += 50) {
    auto v = old->get("k" + std::to_string(k));
    ASSERT_TRUE(v) << v.error().message();
    EXPECT_EQ(*v, value_of(k, 0));
  }
  old->abort();
  auto done = s->compact();
  ASSERT_TRUE(done) << done.error().message();
  EXPECT_GT(done->segments_removed, 0u);
  std::vector<int> version(1500, 1);
  expect_values(*s, version, "compacted");
}

// A transaction that begins while the records move may have read an entry before it named
// the copy: the originals stay until it ends.
TEST(KvCompact, WaitsForSnapshotsTakenWhileRecordsMoved) {
  temp_dir dir;
  const std::string path = dir.file("s");
  options o = manual_compaction();
  o.lock_timeout = std::chrono::milliseconds(300);
  static std::unique_ptr<store> s;
  s = open_ok(path, o);
  ASSERT_TRUE(s);
  for (int round = 0; round < 3; ++round) {
    for (int k = 0; k < 1500; ++k) {
      if (round == 2 && k % 3 == 0) continue;
      ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, round)));
    }
  }
  static std::optional<transaction> during;
  compact_moved_hook = []() noexcept {
    if (auto t = s->begin()) during.emplace(std::move(*t));
  };
  auto c = s->compact();
  compact_moved_hook = nullptr;
  ASSERT_TRUE(during);
  ASSERT_FALSE(c) << "removed segments a transaction begun meanwhile may read";
  EXPECT_EQ(c.error(), std::errc::timed_out);
  auto v = during->get("k0");
  ASSERT_TRUE(v) << v.error().message();
  EXPECT_EQ(*v, value_of(0, 1));
  during.reset();
  auto done = s->compact();
  ASSERT_TRUE(done) << done.error().message();
  s.reset();
}

// Keys put once and erased (a queue, a session cache) leave no trace for good: compaction
// forgets an erased key once its erase record is the only record of it left, so the
// segments and the index stop growing however many such keys come and go.
TEST(KvCompact, KeysPutAndErasedLeaveNothingBehind) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  // Stable keys, live in the oldest segments throughout.
  constexpr int stable = 300;
  std::vector<int> version(stable, 0);
  for (int k = 0; k < stable; ++k)
    ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, 0)));
  std::uint64_t dropped = 0;
  std::vector<std::uintmax_t> bytes;
  std::vector<std::uint64_t> pages;
  int next = 0;
  for (int round = 0; round < 12; ++round) {
    for (int i = 0; i < 2000; ++i) {
      ASSERT_TRUE(s->put("q" + std::to_string(next + i), value_of(next + i, round, 400)));
    }
    for (int i = 0; i < 2000; ++i)
      ASSERT_TRUE(s->erase("q" + std::to_string(next + i)));
    next += 2000;
    for (int pass = 0; pass < 2; ++pass) {
      auto c = s->compact();
      ASSERT_TRUE(c) << c.error().message();
      dropped += c->erasures_dropped;
    }
    auto st = s->stats();
    ASSERT_TRUE(st);
    bytes.push_back(segments_of(path).bytes);
    pages.push_back(st->index_pages);
  }
  EXPECT_GT(dropped, 16000u) << "erased keys forgotten by compaction";
  // 24 000 keys came and went: the last rounds hold no more than the early ones.
  EXPECT_LE(bytes.back(), bytes[3] + (std::uintmax_t{1} << 20))
      << "segment bytes after round 4: " << bytes[3] << ", after round 12: " << bytes.back();
  EXPECT_LE(pages.back(), pages[3] + 2)
      << "index pages after round 4: " << pages[3] << ", after round 12: " << pages.back();
  expect_values(*s, version, "after the churn");
  for (int q = 0; q < next; q += 97) {
    auto v = s->get("q" + std::to_string(q));
    EXPECT_FALSE(v) << "q" << q << " came back";
  }
  // A rebuild from the whole log (no index, no checkpoint) brings none of them back.
  s.reset();
  std::filesystem::remove(path + "/index");
  std::filesystem::remove(path + "/checkpoint");
  auto rebuilt = open_ok(path);
  ASSERT_TRUE(rebuilt);
  expect_values(*rebuilt, version, "rebuilt");
  for (int q = 0; q < next; ++q) {
    auto v = rebuilt->get("q" + std::to_string(q));
    if (v || v.error() != errc::not_found) {
      ADD_FAILURE() << "q" << q << " came back after a rebuild";
      break;
    }
  }
  auto st = rebuilt->stats();
  ASSERT_TRUE(st);
  EXPECT_EQ(st->records, static_cast<std::uint64_t>(stable));
}

// An erase record is kept while an older version of its key lives on in a segment that
// stays: without it, a rebuild from the whole log would bring that version back.
TEST(KvCompact, AnEraseOutlivesEveryOlderVersionOfItsKey) {
  temp_dir dir;
  const std::string path = dir.file("s");
  // Compacting only when asked: it counts what those compactions removed (one in the
  // background, under ASan and two busy cores, once removed it all first).
  auto s = open_ok(path, manual_compaction());
  ASSERT_TRUE(s);
  // Segment 1: the keys' first versions among stable keys that keep it more than half live.
  constexpr int keys = 900;
  std::vector<int> version(keys, 0);
  for (int k = 0; k < keys; ++k)
    ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, 0)));
  // Later segments: every tenth key erased among dead filler, so those segments go.
  for (int f = 0; f < 1500; ++f)
    ASSERT_TRUE(s->put("filler", value_of(f, 1)));
  for (int k = 0; k < keys; k += 10) {
    ASSERT_TRUE(s->erase("k" + std::to_string(k)));
    version[static_cast<std::size_t>(k)] = -1;
  }
  for (int f = 0; f < 1500; ++f)
    ASSERT_TRUE(s->put("filler", value_of(f, 2)));
  ASSERT_TRUE(s->erase("filler"));
  std::uint64_t removed = 0;
  for (int pass = 0; pass < 3; ++pass) {
    auto c = s->compact();
    ASSERT_TRUE(c) << c.error().message();
    removed += c->segments_removed;
  }
  EXPECT_GT(removed, 0u);
  expect_values(*s, version, "compacted");
  s.reset();
  std::filesystem::remove(path + "/index");
  std::filesystem::remove(path + "/checkpoint");
  auto rebuilt = open_ok(path);
  ASSERT_TRUE(rebuilt);
  expect_values(*rebuilt, version, "rebuilt from the whole log");
  auto gone = rebuilt->get("filler");
  EXPECT_FALSE(gone);
}

// A compaction takes as long as its copies: it holds no lock slot of keel::lock meanwhile,
// so no writer's page (whose lock slot may be any) waits for it. Checked from another
// process, which takes every slot in turn while the compaction is between its steps.
TEST(KvCompact, HoldsNoLockSlotAWriterMayNeed) {
  temp_dir dir;
  const std::string path = dir.file("s");
  static std::string lock_path;
  lock_path = path + "/lock";
  auto s = open_ok(path, manual_compaction());
  ASSERT_TRUE(s);
  for (int round = 0; round < 3; ++round) {
    for (int k = 0; k < 1500; ++k) {
      ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, round)));
    }
  }
  static int busy_slots;
  busy_slots = -1;
  compact_moved_hook = []() noexcept {
    const pid_t child = fork_child([] {
      auto m = lock::memory_map::open(lock_path);
      if (!m) return 255;
      // One entity value for each slot.
      std::vector<std::uint64_t> of_slot(lock::memory_map::slots, 0);
      std::size_t found = 0;
      for (std::uint64_t v = 1; found < of_slot.size(); ++v) {
        auto& o = of_slot[lock::memory_map_detail::slot_of(v)];
        if (o == 0) {
          o = v;
          ++found;
        }
      }
      int busy = 0;
      for (const std::uint64_t v : of_slot) {
        auto g = (*m)->lock({lock::entity(v)}, std::chrono::milliseconds(20));
        if (!g) ++busy;
      }
      return std::min(busy, 254);
    });
    busy_slots = test::wait_exit(child);
  };
  auto c = s->compact();
  compact_moved_hook = nullptr;
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_GT(c->segments_removed, 0u);
  EXPECT_EQ(busy_slots, 0) << "lock slots a writer's page may need were held by the compaction";
}

// A compactor killed after it took its victims off the manifest, before it emptied their
// entries in the segment table: the next opener, alone, removes the victims' files (nothing
// in them is live: their records were copied), and must empty their entries too. Left named,
// a sync commit after a sync leader died (which syncs every segment the table names) failed
// with ENOENT naming a victim, and so did every one after, reopened or not (found by an
// adversarial review that killed compactions at random).
TEST(KvCompact, ACompactorKilledAfterItUnlistedItsVictimsLeavesNoneNamed) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path, manual_compaction());
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("k0", value_of(0, 0)));
  }
  // The victims written since the last sync (a close syncs): a sync commit syncs them.
  const pid_t child = fork_child([&] {
    auto s = store::open(path, manual_compaction());
    if (!s) return 2;
    for (int round = 3; round < 6; ++round) {
      for (int k = 0; k < 1500; ++k) {
        if (!(*s)->put("k" + std::to_string(k), value_of(k, round))) return 4;
      }
    }
    compact_unlisted_hook = []() noexcept { ::raise(SIGKILL); };
    (void)(*s)->compact();
    return 3;  // not killed: it took no victim
  });
  ASSERT_EQ(test::wait_exit(child), 128 + SIGKILL);
  for (int open = 0; open < 2; ++open) {
    SCOPED_TRACE(open);
    auto s = open_ok(path, manual_compaction());  // alone: the victims' files are removed
    ASSERT_TRUE(s);
    // A writer killed in the middle of a sync: the next sync syncs every segment the table
    // names, so one named and gone fails it.
    const pid_t syncer = fork_child([&] {
      auto mine = store::open(path, manual_compaction());
      if (!mine) return 2;
      commit_hook = [](commit_step at) noexcept {
        if (at == commit_step::syncing) ::raise(SIGKILL);
      };
      auto t = (*mine)->begin();
      if (!t || !t->put("syncer", "1")) return 3;
      (void)t->commit(durability::sync);
      return 4;  // not killed
    });
    ASSERT_EQ(test::wait_exit(syncer), 128 + SIGKILL);
    auto t = s->begin();
    ASSERT_TRUE(t);
    ASSERT_TRUE(t->put("after", std::to_string(open)));
    auto c = t->commit(durability::sync);
    ASSERT_TRUE(c) << c.error().message();
    auto again = s->compact();
    ASSERT_TRUE(again) << again.error().message();
    for (int k = 0; k < 1500; ++k)
      ASSERT_EQ(s->get("k" + std::to_string(k)), value_of(k, 5));
    EXPECT_TRUE(s->verify());
  }
}

TEST(KvCompact, ReadersAndWritersGoOnMeanwhile) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  constexpr int keys = 800;
  for (int round = 0; round < 3; ++round) {
    for (int k = 0; k < keys; ++k)
      ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, round)));
  }
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  std::vector<std::atomic<int>> version(keys);
  for (auto& v : version)
    v = 2;
  // A writer process and a reader thread, while this thread compacts again and again.
  const pid_t writer = fork_child([&] {
    auto mine = store::open(path, small());
    if (!mine) return 2;
    for (int round = 3; round < 6; ++round) {
      for (int k = 0; k < keys; ++k) {
        if (!(*mine)->put("k" + std::to_string(k), value_of(k, round))) return 3;
      }
    }
    return 0;
  });
  std::thread reader([&] {
    std::mt19937 rng(1);
    while (!stop.load()) {
      const int k = static_cast<int>(rng() % keys);
      auto v = s->get("k" + std::to_string(k));
      // Any version, but always a whole value of this key.
      const std::string prefix = "k" + std::to_string(k) + "v";
      if (!v || v->size() != 1000 || v->compare(0, prefix.size(), prefix) != 0) ++errors;
    }
  });
  int removed = 0;
  for (int i = 0; i < 20; ++i) {
    auto c = s->compact();
    if (!c) {
      ADD_FAILURE() << c.error().message();
      break;
    }
    removed += static_cast<int>(c->segments_removed);
  }
  EXPECT_EQ(test::wait_exit(writer), 0);
  auto last = s->compact();
  ASSERT_TRUE(last) << last.error().message();
  removed += static_cast<int>(last->segments_removed);
  stop = true;
  reader.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_GT(removed, 0);
  std::vector<int> final_version(keys, 5);
  expect_values(*s, final_version, "after");
  s.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path);
  ASSERT_TRUE(rebuilt);
  expect_values(*rebuilt, final_version, "rebuilt");
}

// A file keel did not make, at the leftover's name compaction renames a kept victim to: it
// is left alone, and compaction still removes its victims (it failed with file_exists, every
// time, the victims off the manifest and their room held).
TEST(KvCompact, AForeignFileAtAKeptVictimsLeftoverNameIsLeftAloneAndCompactionWorks) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path, manual_compaction());
  ASSERT_TRUE(s);
  auto other =
      open_ok(path, manual_compaction());  // not alone: the lone opener's cleanup stays out of it
  ASSERT_TRUE(other);
  for (int round = 0; round < 3; ++round) {
    for (int k = 0; k < 1500; ++k) {
      ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, round)));
    }
  }
  const std::string foreign = path + "/seg/.seg." + segment_name(1);
  {
    std::ofstream f(foreign);
    f << "not keel's";
  }
  auto c = s->compact();
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_GT(c->segments_removed, 0u);
  std::ifstream in(foreign);
  std::string text;
  std::getline(in, text);
  EXPECT_EQ(text, "not keel's");
  for (int k = 0; k < 1500; ++k) {
    auto v = other->get("k" + std::to_string(k));
    ASSERT_TRUE(v && *v == value_of(k, 2)) << k;
  }
  EXPECT_TRUE(s->verify());
}

// A full ext4 directory refuses the rename to a kept victim's leftover name (a longer name
// needs a directory block) with ENOSPC: the victim then goes back to the volume, and the
// compaction still works (it failed outright before, so a full store could never compact).
TEST(KvCompact, ARenameRefusedForRoomGivesTheVictimBackAndCompactionWorks) {
  temp_dir dir;
  const std::string path = dir.file("s");
  io::fault_filesystem fs;
  options o = manual_compaction();
  o.fs = &fs;
  auto s = store::open(path, o);
  ASSERT_TRUE(s) << s.error().message();
  for (int round = 0; round < 3; ++round) {
    for (int k = 0; k < 1500; ++k) {
      ASSERT_TRUE((*s)->put("k" + std::to_string(k), value_of(k, round)));
    }
  }
  fs.inject({.on = io::fs_op::rename,
             .repeat = io::fault_filesystem::fault::repeat::forever,
             .error = ENOSPC,
             .path_contains = "seg"});
  auto c = (*s)->compact();
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_GT(c->segments_removed, 0u);
  EXPECT_GT(fs.injected(), 0u);
  fs.clear_faults();
  for (int k = 0; k < 1500; ++k) {
    auto v = (*s)->get("k" + std::to_string(k));
    ASSERT_TRUE(v && *v == value_of(k, 2)) << k;
  }
  EXPECT_TRUE((*s)->verify());
}

// A compactor SIGKILLed at a random moment, again and again: nothing is lost, and the next
// compaction (or a lone opener, or a rebuild) finds a sound store.
// (This process compacts only when asked: the compactor is the child, and a process with a
// thread of its own running cannot fork one under ThreadSanitizer.)
// A compactor killed in step 7, at the unlink of its second victim: the first is already
// emptied and gone, and its run not yet counted (header::compactions), which is what tells other
// users to drop their maps of removed segments. A user that mapped it (it wrote the values)
// then verified, and verify read an old commit's dead blob through that map, past the file's
// end: SIGBUS.
TEST(KvCompact, AUserOutlivesACompactorKilledWhileRemovingSegments) {
  temp_dir dir;
  const std::string path = dir.file("s");
  const options o = manual_compaction();
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("small", "kept"));
  const std::string big((std::size_t{3} << 20) / 2, 'a');
  for (const char c : {'a', 'b', 'c', 'd'})
    ASSERT_TRUE(s->put("K", std::string(big.size(), c)));
  ASSERT_TRUE(s->put("other", big));
  ASSERT_TRUE(s->verify());  // every segment mapped here
  const pid_t compactor = fork_child([&] {
    io::fault_filesystem fs;
    io::fault_filesystem::fault cut;
    cut.on = io::fs_op::unlink;
    cut.path_contains = "/seg/0";
    cut.nth = 2;
    cut.crash = true;
    fs.inject(cut);
    options mine = o;
    mine.fs = &fs;
    auto m = store::open(path, mine);
    if (!m) return 2;
    return (*m)->compact() ? 3 : 4;
  });
  ASSERT_EQ(test::wait_exit(compactor), 128 + SIGKILL) << "not killed at its second unlink";
  const pid_t user = fork_child([&] {
    auto v = s->get("K");
    if (!v || *v != std::string(big.size(), 'd')) return 2;
    return s->verify() ? 0 : 3;
  });
  EXPECT_EQ(test::wait_exit(user), 0) << "128 + 7: SIGBUS";
  s.reset();
  auto again = open_ok(path, o);
  ASSERT_TRUE(again);
  EXPECT_EQ(*again->get("K"), std::string(big.size(), 'd'));
  EXPECT_TRUE(again->compact());
}

TEST(KvCompact, ACompactorKilledAnywhereLosesNothing) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path, manual_compaction());
  ASSERT_TRUE(s);
  constexpr int keys = 1500;
  std::vector<int> version(keys, -1);
  std::mt19937 rng(7);
  for (int round = 0; round < 8; ++round) {
    for (int k = 0; k < keys; ++k) {
      if (rng() % 3 == 0) continue;
      ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, round)));
      version[static_cast<std::size_t>(k)] = round;
    }
    const pid_t compactor = fork_child([&] {
      auto mine = store::open(path, small());
      if (!mine) return 2;
      return (*mine)->compact() ? 0 : 3;
    });
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 20000));
    ::kill(compactor, SIGKILL);
    const int status = test::wait_status(compactor);
    EXPECT_TRUE(WIFSIGNALED(status) || WEXITSTATUS(status) == 0) << "status " << status;
    expect_values(*s, version, "after a killed compactor");
  }
  auto c = s->compact();
  ASSERT_TRUE(c) << c.error().message();
  expect_values(*s, version, "compacted");
  s.reset();
  auto reopened = open_ok(path);
  ASSERT_TRUE(reopened);
  expect_values(*reopened, version, "reopened");
  reopened.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path);
  ASSERT_TRUE(rebuilt);
  expect_values(*rebuilt, version, "rebuilt");
}

// Compaction in the background (options::compact_dead_fraction): a few keys put over and
// over keep the log within a few segments with no call to compact, and every value stays;
// with the policy off the same puts leave every segment they filled. The store is closed
// after one more put (closing waits for the thread that put started), so what is checked is
// what the policy leaves, however far behind the puts the thread ran.
TEST(KvCompact, RunsInTheBackgroundOnceHalfTheLogIsDead) {
  constexpr int keys = 300;
  constexpr int rounds = 40;  // 12 MiB of values in 1 MiB segments, 0.3 MiB live
  for (const double fraction : {0.5, 0.0}) {
    SCOPED_TRACE("compact_dead_fraction " + std::to_string(fraction));
    temp_dir dir;
    const std::string path = dir.file("s");
    options o = small();
    o.compact_dead_fraction = fraction;
    std::vector<int> version(keys, -1);
    {
      auto s = open_ok(path, o);
      ASSERT_TRUE(s);
      for (int round = 0; round < rounds; ++round) {
        for (int k = 0; k < keys; ++k) {
          ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, round)));
          version[static_cast<std::size_t>(k)] = round;
        }
      }
    }
    {
      auto s = open_ok(path, o);
      ASSERT_TRUE(s);
      ASSERT_TRUE(s->put("k0", value_of(0, rounds)));
      version[0] = rounds;
    }
    auto s = open_ok(path, manual_compaction());
    ASSERT_TRUE(s);
    expect_values(*s, version, "after the puts");
    auto st = s->stats();
    ASSERT_TRUE(st);
    const files f = segments_of(path);
    if (fraction > 0) {
      EXPECT_GT(st->compactions, 0u);
      // Live 0.3 MiB: at most two segments of dead (and one more while a run is not yet
      // due), the tail's, and the copies' segment.
      EXPECT_LE(f.count, 6u) << st->dead_bytes << " dead bytes";
      EXPECT_EQ(st->compaction_errno, 0);
    } else {
      EXPECT_EQ(st->compactions, 0u);
      EXPECT_GE(f.count, 11u);
    }
  }
}

// A transaction left open in another process (idle, for as long as it likes) holds up
// neither the close of a process whose background compaction found it, nor a checkpoint
// asked for meanwhile: the background run waits for it only a moment, then gives up the
// maintenance byte. (It waited the whole lock timeout: here an hour, so the close hung.)
TEST(KvCompact, ATransactionLeftOpenElsewhereHoldsUpNeitherCloseNorACheckpoint) {
  temp_dir dir;
  const std::string path = dir.file("s");
  options o = small();
  o.lock_timeout = std::chrono::hours(1);
  { ASSERT_TRUE(open_ok(path, o)); }
  const test::signal_pipe held, done;
  const pid_t reader = fork_child([&] {
    auto s = store::open(path, o);
    if (!s) return 2;
    auto t = (*s)->begin();
    if (!t) return 3;
    (void)t->get("k0");
    held.notify();
    (void)done.wait();
    return 0;
  });
  test::killed_on_failure guard{reader};
  ASSERT_NE(held.wait(), 0);
  {
    auto s = open_ok(path, o);
    ASSERT_TRUE(s);
    // 6 MiB of puts over 0.3 MiB of keys: a background compaction is due many times over.
    for (int round = 0; round < 20; ++round) {
      for (int k = 0; k < 300; ++k) {
        ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, round)));
      }
    }
  }  // closes, waiting for its background thread
  {
    auto s = open_ok(path, o);
    ASSERT_TRUE(s);
    auto cp = s->checkpoint();
    EXPECT_TRUE(cp) << cp.error().message();
    auto st = s->stats();
    ASSERT_TRUE(st);
    EXPECT_GT(st->checkpoint_seq, 0u);
  }
  done.notify();
  guard.pid = 0;
  EXPECT_EQ(test::wait_exit(reader), 0);
}

// A process that read a blob segment another process's compaction then removed still has
// it mapped (emptied: its blocks went back to the volume). Its verify judges every commit,
// the dead ones too, so it reads that blob: through the old map the read was past the end of
// the file, and the process died of SIGBUS. It must see the segment gone.
TEST(KvCompact, AVerifyAfterAnotherProcessRemovedASegmentItHadMappedWorks) {
  temp_dir dir;
  const std::string path = dir.file("s");
  const options o = manual_compaction();
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  const std::string big1(1536 << 10, '1');  // larger than a segment: a segment of its own
  ASSERT_TRUE(s->put("big", big1));
  const test::signal_pipe ready, go;
  const pid_t reader = fork_child([&] {
    auto r = store::open(path, o);
    if (!r) return 2;
    auto v = (*r)->get("big");  // maps the blob's segment
    if (!v || *v != big1) return 3;
    ready.notify();
    if (go.wait() == 0) return 4;
    return (*r)->verify() ? 0 : 5;
  });
  test::killed_on_failure guard{reader};
  ASSERT_NE(ready.wait(), 0);
  // The blob superseded, and the tail moved past its segment (kept live, so the segment
  // holding the first commit's block stays): the blob's segment is all dead, and goes.
  ASSERT_TRUE(s->put("big", std::string(1536 << 10, '2')));
  for (int k = 0; k < 1500; ++k) {
    ASSERT_TRUE(s->put("k" + std::to_string(k), value_of(k, 0)));
  }
  auto compacted = s->compact();
  ASSERT_TRUE(compacted) << compacted.error().message();
  EXPECT_GT(compacted->segments_removed, 0u);
  go.notify();
  guard.pid = 0;
  EXPECT_EQ(test::wait_exit(reader), 0);  // 128 + SIGBUS before
}

// Bad values of the policy are refused before anything is made.
TEST(KvCompact, ABadDeadFractionIsRefused) {
  temp_dir dir;
  for (const double bad : {-0.1, 1.0, 2.0, std::numeric_limits<double>::quiet_NaN()}) {
    options o = small();
    o.compact_dead_fraction = bad;
    auto s = store::open(dir.file("s"), o);
    ASSERT_FALSE(s) << bad;
    EXPECT_EQ(s.error(), std::errc::invalid_argument) << bad;
    EXPECT_FALSE(std::filesystem::exists(dir.file("s"))) << bad;
  }
}

}  // namespace
}  // namespace keel::kv
