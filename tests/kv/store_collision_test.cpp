// Keys whose 128-bit hashes are equal: a collision costs a probe, never an error nor another
// key's value. Every step that settles, scans, checkpoints or compacts an entry tells the
// keys apart by their bytes, also when the commit that wrote them was left half published by
// a writer that died. The hashes are made equal through disk::hash_hook.

#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "kv/kv_support.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;
using test_support::open_ok;
using test_support::small;

// Keys that start with "c" all hash alike; the others hash as ever.
constexpr disk::key_hash shared_hash{0x5a5a5a5a5a5a5a5aULL, 42};

struct colliding_hashes {
  colliding_hashes() noexcept {
    disk::hash_hook = [](std::span<const std::byte> key, std::uint64_t seed) noexcept {
      if (!key.empty() && key[0] == std::byte{'c'}) return shared_hash;
      // (Not by unsetting the hook meanwhile: a background thread hashing then would get
      // another hash for a colliding key.)
      return disk::unhooked_hash_key(key, seed);
    };
  }
  ~colliding_hashes() { disk::hash_hook = nullptr; }
  colliding_hashes(const colliding_hashes&) = delete;
  colliding_hashes& operator=(const colliding_hashes&) = delete;
};

// Every key and value a full scan returns (a key twice fails the test).
std::map<std::string, std::string> scan_all(store& s) {
  std::map<std::string, std::string> out;
  std::string cursor;
  for (;;) {
    auto page = s.scan(cursor, 7);
    if (!page) {
      ADD_FAILURE() << page.error().message();
      return out;
    }
    for (auto& it : page->items) {
      EXPECT_TRUE(out.emplace(it.key, it.value).second) << "scanned twice: " << it.key;
    }
    if (page->done) return out;
    cursor = page->cursor;
  }
}

void expect_values(store& s, const std::map<std::string, std::string>& want, const char* when) {
  for (const auto& [k, v] : want) {
    auto got = s.get(k);
    ASSERT_TRUE(got) << when << ": " << k << ": " << got.error().message();
    EXPECT_EQ(*got, v) << when << ": " << k;
  }
  EXPECT_EQ(scan_all(s), want) << when;
}

TEST(KvCollision, KeysSharingAHashLiveSideBySide) {
  const colliding_hashes same;
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  std::map<std::string, std::string> want;
  for (int i = 0; i < 20; ++i) {
    const std::string k = "c" + std::to_string(i);
    ASSERT_TRUE(s->put(k, "v" + std::to_string(i)));
    want[k] = "v" + std::to_string(i);
  }
  ASSERT_TRUE(s->put("other", "o"));
  want["other"] = "o";
  expect_values(*s, want, "put");
  ASSERT_TRUE(s->erase("c3"));
  want.erase("c3");
  EXPECT_EQ(s->get("c3").error(), errc::not_found);
  ASSERT_TRUE(s->put("c4", "again"));
  want["c4"] = "again";
  expect_values(*s, want, "changed");
  ASSERT_TRUE(s->compact());
  expect_values(*s, want, "compacted");
  ASSERT_TRUE(s->checkpoint());
  s.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path);
  ASSERT_TRUE(rebuilt);
  expect_values(*rebuilt, want, "rebuilt");
}

// More keys of one hash than a bucket page holds: no split can separate them, so the page
// grows a chain of overflow pages rather than doubling the directory up to its 2^40 entries.
// Keys of other hashes then split the chained page (each half takes its share of the chain);
// erases, compaction, a checkpoint and both rebuilds keep every key. Two processes add keys
// of the hash at once.
TEST(KvCollision, ManyKeysOfOneHashGrowAChainNotTheDirectory) {
  const colliding_hashes same;
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  auto before = s->stats();
  ASSERT_TRUE(before);
  std::map<std::string, std::string> want;
  // One by one, then 300 in one commit (its page needs three more pages at once).
  for (int i = 0; i < 400; ++i) {
    const std::string k = "c" + std::to_string(i);
    ASSERT_TRUE(s->put(k, "v" + k)) << k;
    want[k] = "v" + k;
  }
  {
    auto t = s->begin();
    ASSERT_TRUE(t);
    for (int i = 400; i < 700; ++i) {
      const std::string k = "c" + std::to_string(i);
      ASSERT_TRUE(t->put(k, "v" + k));
      want[k] = "v" + k;
    }
    ASSERT_TRUE(t->commit());
  }
  // Two processes at once, each its own keys of the hash.
  std::vector<pid_t> kids;
  for (int w = 0; w < 2; ++w) {
    kids.push_back(fork_child([&, w] {
      auto mine = store::open(path, small());
      if (!mine) return 2;
      for (int i = 0; i < 300; ++i) {
        const std::string k = "c" + std::to_string(w) + "-" + std::to_string(i);
        if (!(*mine)->put(k, "v" + k)) return 3;
      }
      return 0;
    }));
    for (int i = 0; i < 300; ++i) {
      const std::string k = "c" + std::to_string(w) + "-" + std::to_string(i);
      want[k] = "v" + k;
    }
  }
  for (const pid_t kid : kids)
    EXPECT_EQ(test::wait_status(kid), 0);
  auto grown = s->stats();
  ASSERT_TRUE(grown);
  // 1300 keys of one hash: 11 pages of 126 entries, give or take; a directory doubled each
  // time would have failed (file_too_large) or taken terabytes.
  EXPECT_GE(grown->index_pages, before->index_pages + 10);
  EXPECT_LE(grown->index_pages, before->index_pages + 16);
  EXPECT_EQ(grown->index_bytes, before->index_bytes);
  expect_values(*s, want, "one hash");

  // Keys of other hashes: the chained page is split (its range holds them too).
  for (int i = 0; i < 20000; ++i) {
    const std::string k = "k" + std::to_string(i);
    ASSERT_TRUE(s->put(k, "w")) << k;
    want[k] = "w";
  }
  for (int i = 0; i < 700; i += 3) {
    const std::string k = "c" + std::to_string(i);
    auto erased = s->erase(k);
    ASSERT_TRUE(erased) << k << ": " << erased.error().message();
    want.erase(k);
  }
  ASSERT_TRUE(s->put("c5", "changed"));
  want["c5"] = "changed";
  expect_values(*s, want, "split");
  ASSERT_TRUE(s->compact());
  expect_values(*s, want, "compacted");
  verify_report found;
  EXPECT_TRUE(s->verify(&found)) << (found.damaged.empty() ? "" : found.damaged[0].what);
  ASSERT_TRUE(s->checkpoint());
  s.reset();
  std::filesystem::remove(path + "/index");
  auto from_checkpoint = open_ok(path);
  ASSERT_TRUE(from_checkpoint);
  expect_values(*from_checkpoint, want, "from a checkpoint");
  // Keys of the hash added to the loaded chain, and then a rebuild from the log alone.
  for (int i = 0; i < 200; ++i) {
    const std::string k = "c-after-" + std::to_string(i);
    ASSERT_TRUE(from_checkpoint->put(k, "a"));
    want[k] = "a";
  }
  from_checkpoint.reset();
  std::filesystem::remove(path + "/index");
  std::filesystem::remove(path + "/checkpoint");
  auto rebuilt = open_ok(path);
  ASSERT_TRUE(rebuilt);
  expect_values(*rebuilt, want, "rebuilt from the log");
}

// A writer puts two keys of one hash in one commit and dies once its block is whole, with
// nothing published: the commit happened. Once its seq is settled, readers see each key's own
// value; a scan returns
// each once; a writer that settles the entries (another key of the hash) gives each its own
// record; a checkpoint and a rebuild keep both.
class KvCollisionDeadWriter : public ::testing::TestWithParam<int> {
 protected:
  const colliding_hashes same_;
  temp_dir dir_;
  const std::string path_ = dir_.file("s");
  std::map<std::string, std::string> want_;

  // The store with "ca" and "cb" as GetParam() says (0: both new; 1: both exist; 2: the
  // first exists, the second is new; 3: the other way), after a writer of both in one commit
  // died with its block whole and nothing published, and another commit settled its seq.
  std::unique_ptr<store> after_the_dead_commit() {
    auto s = open_ok(path_);
    if (!s) return nullptr;
    const int kind = GetParam();
    if ((kind == 1 || kind == 2) && !s->put("ca", "old a")) return nullptr;
    if ((kind == 1 || kind == 3) && !s->put("cb", "old b")) return nullptr;
    const pid_t victim = fork_child([&] {
      auto mine = store::open(path_, small());
      if (!mine) return 2;
      test_support::die_at(commit_step::written);
      auto t = (*mine)->begin();
      if (!t || !t->put("ca", "new a") || !t->put("cb", "new b")) return 3;
      (void)t->commit();
      return 4;
    });
    const int status = test::wait_status(victim);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
    want_ = {{"ca", "new a"}, {"cb", "new b"}, {"unrelated", "u"}};
    // Its writer waits for the dead commit's seq and settles it; not its entries.
    if (!s->put("unrelated", "u")) return nullptr;
    return s;
  }
};

TEST_P(KvCollisionDeadWriter, SettlesEachKeyToItsOwnRecord) {
  auto s = after_the_dead_commit();
  ASSERT_TRUE(s);
  // Readers, before anything settles the entries.
  expect_values(*s, want_, "read");
  // A writer of the page settles both entries.
  ASSERT_TRUE(s->put("cc", "c"));
  want_["cc"] = "c";
  expect_values(*s, want_, "settled");
  ASSERT_TRUE(s->checkpoint());
  s.reset();
  auto again = open_ok(path_);
  ASSERT_TRUE(again);
  expect_values(*again, want_, "reopened");
  again.reset();
  std::filesystem::remove(path_ + "/index");
  auto rebuilt = open_ok(path_);
  ASSERT_TRUE(rebuilt);
  expect_values(*rebuilt, want_, "rebuilt from the checkpoint");
  ASSERT_TRUE(rebuilt->put("ca", "newer a"));
  want_["ca"] = "newer a";
  expect_values(*rebuilt, want_, "after");
}

// The same, with the checkpoint copying the entries while they are still pending.
TEST_P(KvCollisionDeadWriter, ACheckpointCopiesEachPendingKeyAsItsOwn) {
  auto s = after_the_dead_commit();
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->checkpoint());
  s.reset();
  std::filesystem::remove(path_ + "/index");
  auto rebuilt = open_ok(path_);
  ASSERT_TRUE(rebuilt);
  expect_values(*rebuilt, want_, "rebuilt from a checkpoint of pending entries");
}

// A writer of new keys of one hash (and of one that existed) killed once it had published
// the first entry, the others still pending: the published entry's record is its own, never
// handed again to a pending entry. Scans return every key once, a writer of the hash settles
// each key to its own record, and a checkpoint keeps them. (A scan once missed a key, and
// settling then lost it: its record had gone to two entries.)
TEST(KvCollision, AWriterKilledAfterPublishingOneEntryLeavesEveryKeyItsOwn) {
  const colliding_hashes same;
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("c-old", "old"));
  }
  const pid_t victim = fork_child([&] {
    auto mine = store::open(path, small());
    if (!mine) return 2;
    test_support::die_at(commit_step::published_one);
    auto t = (*mine)->begin();
    if (!t) return 3;
    for (const char* k : {"c0", "c1", "c-old", "c2", "c3"}) {
      if (!t->put(k, std::string("v-") + k)) return 4;
    }
    (void)t->commit();
    return 5;
  });
  const int status = test::wait_status(victim);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  const std::map<std::string, std::string> want{
      {"c0", "v-c0"}, {"c1", "v-c1"}, {"c-old", "v-c-old"}, {"c2", "v-c2"}, {"c3", "v-c3"}};
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  expect_values(*s, want, "opened alone");
  ASSERT_TRUE(s->put("c-other", "o"));  // settles the hash's entries
  auto settled = want;
  settled["c-other"] = "o";
  expect_values(*s, settled, "settled");
  ASSERT_TRUE(s->checkpoint());
  s.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path);
  ASSERT_TRUE(rebuilt);
  expect_values(*rebuilt, settled, "from the checkpoint");
}

INSTANTIATE_TEST_SUITE_P(Kinds, KvCollisionDeadWriter, ::testing::Values(0, 1, 2, 3));

}  // namespace
}  // namespace keel::kv
