// store::backup and transaction::scan: a copy of a store in use is the store as it was when the
// backup began (every commit acknowledged before it, nothing half of one after), it opens and
// verifies, `to` is a whole copy or absent, and nothing that was there is touched.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <atomic>
#include <climits>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include "base/futex.hpp"
#include "keel/kv/store.hpp"
#include "kv/kv_support.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;
using test::wait_exit;
using test_support::open_ok;
using test_support::small;

// A counter another process can read and sleep on (a shared futex: std::atomic::wait's are
// private to a process): the writer's last acknowledged commit.
struct shared_counter {
  std::atomic<std::uint32_t>* n;
  pid_t writer = 0;
  shared_counter() {
    void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) std::abort();
    n = new (p) std::atomic<std::uint32_t>(0);
  }
  ~shared_counter() { ::munmap(n, 4096); }
  shared_counter(const shared_counter&) = delete;
  shared_counter& operator=(const shared_counter&) = delete;
};

// In a child: commits forever, each commit setting "a" and "b" to i and adding "n<i>", and
// publishes i once the commit is acknowledged.
void start_pair_writer(const std::string& path, shared_counter& acked) {
  acked.writer = fork_child([&] {
    auto s = store::open(path, small());
    if (!s) return 2;
    for (std::uint32_t i = 1;; ++i) {
      auto t = (*s)->begin();
      const std::string v = std::to_string(i);
      if (!t || !t->put("a", v) || !t->put("b", v) || !t->put("n" + v, v)) return 3;
      if (auto c = t->commit(); !c) return 4;
      acked.n->store(i);
      base::futex_wake(*acked.n, INT_MAX, base::futex_scope::shared);
    }
  });
}

// Until the writer has acknowledged `at_least` commits; false if it died first.
bool wait_for(const shared_counter& c, std::uint64_t at_least) {
  for (std::uint32_t seen = c.n->load(); seen < at_least; seen = c.n->load()) {
    int status = 0;
    if (::waitpid(c.writer, &status, WNOHANG) != 0) {
      ADD_FAILURE() << "the writer ended (status " << status << ")";
      return false;
    }
    base::futex_wait(base::detail::word_of(*c.n), seen, std::chrono::milliseconds(100),
                     base::futex_scope::shared);
  }
  return true;
}

// Every page of a transaction's scan reads its snapshot, whatever commits between pages.
TEST(KvScanInATransaction, EveryPageReadsTheTransactionsSnapshot) {
  temp_dir d;
  const std::string path = d.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  for (int i = 0; i < 3000; ++i)
    ASSERT_TRUE(s->put("k" + std::to_string(i), std::string(100, 'x')));
  shared_counter acked;
  start_pair_writer(path, acked);
  ASSERT_TRUE(wait_for(acked, 5));
  auto t = s->begin();
  ASSERT_TRUE(t);
  const std::string a_then = *t->get("a");
  auto first = t->scan("", 100);
  ASSERT_TRUE(first) << first.error().message();
  // Many commits land between the pages.
  ASSERT_TRUE(wait_for(acked, std::stoull(a_then) + 200));
  std::size_t items = first->items.size();
  std::size_t numbered = 0;
  std::string a, b;
  const auto look = [&](const scan_page& p) {
    for (const item& it : p.items) {
      if (it.key == "a") a = it.value;
      if (it.key == "b") b = it.value;
      if (it.key.starts_with("n")) {
        ++numbered;
        EXPECT_LE(std::stoull(it.value), std::stoull(a_then)) << "a commit after the snapshot";
      }
    }
  };
  look(*first);
  for (std::string cursor = first->cursor; !first->done;) {
    auto page = t->scan(cursor, 100);
    ASSERT_TRUE(page) << page.error().message();
    look(*page);
    items += page->items.size();
    if (page->done) break;
    cursor = page->cursor;
  }
  ::kill(acked.writer, SIGKILL);
  (void)wait_exit(acked.writer);
  EXPECT_EQ(a, a_then);
  EXPECT_EQ(b, a_then);
  EXPECT_EQ(numbered, std::stoull(a_then));
  EXPECT_EQ(items, 3000 + 2 + numbered);
  // A transaction that scanned may not write; one that wrote may not scan.
  EXPECT_EQ(t->put("x", "1").error(), std::errc::invalid_argument);
  EXPECT_EQ(t->erase("x").error(), std::errc::invalid_argument);
  auto w = s->begin();
  ASSERT_TRUE(w && w->put("x", "1"));
  EXPECT_EQ(w->scan("", 10).error(), std::errc::invalid_argument);
}

// Splits that another process's commits make while a scan walks the index list no key twice
// (an entry can be seen in its old page and again in its new one within one call) and lose
// none. The race is not forced: before the fix, about one round in six listed keys twice.
TEST(KvScanInATransaction, SplitsUnderTheWalkListEveryKeyOnce) {
  temp_dir d;
  const std::string path = d.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  for (int i = 0; i < 2000; ++i)
    ASSERT_TRUE(s->put("base" + std::to_string(i), "b"));
  const pid_t writer = fork_child([&] {
    auto own = store::open(path, small());
    if (!own) return 2;
    for (long n = 0;; n += 300) {
      auto t = (*own)->begin();
      if (!t) return 3;
      for (int i = 0; i < 300; ++i) {
        if (!t->put("grown" + std::to_string(n + i), "v")) return 4;
      }
      if (!t->commit()) return 5;
    }
  });
  for (int round = 0; round < 6; ++round) {
    // A store that has grown since the last round, with the writer still at it.
    const std::uint64_t grown = 2000 + 5000 * static_cast<std::uint64_t>(round + 1);
    while (s->stats()->records < grown) {
      int status = 0;
      ASSERT_EQ(::waitpid(writer, &status, WNOHANG), 0) << "the writer ended: " << status;
      std::this_thread::yield();
    }
    auto t = s->begin();
    ASSERT_TRUE(t);
    std::set<std::string> keys;
    std::size_t items = 0;
    for (std::string cursor;;) {
      auto page = t->scan(cursor, 256, true);
      ASSERT_TRUE(page) << page.error().message();
      for (const item& it : page->items) {
        ++items;
        keys.insert(it.key);
      }
      if (page->done) break;
      cursor = page->cursor;
    }
    EXPECT_EQ(items, keys.size()) << "round " << round << ": keys listed twice";
    for (int i = 0; i < 2000; i += 7)
      ASSERT_TRUE(keys.contains("base" + std::to_string(i))) << i;
  }
  ::kill(writer, SIGKILL);
  EXPECT_EQ(wait_exit(writer), 128 + SIGKILL);
}

// A backup taken while a writer commits is one snapshot: "a" and "b" agree, every commit
// acknowledged before it is there, and the copy verifies.
TEST(KvBackup, ACopyWhileAWriterCommitsIsOneSnapshotAndVerifies) {
  temp_dir d;
  const std::string path = d.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  for (int i = 0; i < 5000; ++i)
    ASSERT_TRUE(s->put("k" + std::to_string(i), std::string(200, static_cast<char>('a' + i % 26))));
  shared_counter acked;
  start_pair_writer(path, acked);
  ASSERT_TRUE(wait_for(acked, 20));
  const std::uint64_t before = acked.n->load();
  auto r = s->backup(d.file("copy"));
  ::kill(acked.writer, SIGKILL);
  EXPECT_EQ(wait_exit(acked.writer), 128 + SIGKILL);
  ASSERT_TRUE(r) << r.error().message();
  auto c = open_ok(d.file("copy"));
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->verify()) << "the copy does not verify";
  const auto a = c->get("a");
  const auto b = c->get("b");
  ASSERT_TRUE(a && b);
  EXPECT_EQ(*a, *b) << "half of a commit in the copy";
  EXPECT_GE(std::stoull(*a), before) << "a commit acknowledged before the backup is missing";
  for (std::uint64_t i = 1; i <= std::stoull(*a); ++i)
    ASSERT_TRUE(c->get("n" + std::to_string(i))) << i;
  EXPECT_FALSE(c->get("n" + std::to_string(std::stoull(*a) + 1))) << "a commit after the copy";
  for (int i = 0; i < 5000; i += 97)
    EXPECT_EQ(*c->get("k" + std::to_string(i)), std::string(200, static_cast<char>('a' + i % 26)));
  EXPECT_EQ(r->keys, 5000 + 2 + std::stoull(*a));
  EXPECT_EQ(c->stats()->records, r->keys);
  // Nothing but the copy was left beside it.
  std::size_t entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(d.path()))
    entries += e.path().filename().string().starts_with(".copy") ? 100 : 1;
  EXPECT_EQ(entries, 2u) << "the store and the copy only";
}

// `to` that exists, whatever it is, is refused and left as it was.
TEST(KvBackup, AnExistingDestinationIsRefusedAndLeftAlone) {
  temp_dir d;
  auto s = open_ok(d.file("s"));
  ASSERT_TRUE(s && s->put("k", "v"));
  std::filesystem::create_directory(d.file("empty"));
  std::ofstream(d.file("file")) << "mine";
  for (const char* to : {"empty", "file", "s"}) {
    auto r = s->backup(d.file(to));
    ASSERT_FALSE(r) << to;
    EXPECT_EQ(r.error(), std::errc::file_exists) << to;
  }
  EXPECT_TRUE(std::filesystem::is_empty(d.file("empty")));
  std::ifstream in(d.file("file"));
  std::string mine;
  in >> mine;
  EXPECT_EQ(mine, "mine");
  EXPECT_EQ(s->backup(d.file("nodir/x")).error(), std::errc::no_such_file_or_directory);
  EXPECT_EQ(s->backup("").error(), std::errc::invalid_argument);
}

// A backup that fails half-way (its volume fills) leaves no `to` and nothing of its own.
TEST(KvBackup, OneThatFailsHalfWayLeavesNothing) {
  for (const std::size_t kib : {std::size_t{512}, std::size_t{8192}}) {
    SCOPED_TRACE(kib);
    temp_dir d;
    const std::string path = d.file("s");
    {
      auto s = open_ok(path);
      ASSERT_TRUE(s);
      for (int i = 0; i < 150; ++i)
        ASSERT_TRUE(s->put("k" + std::to_string(i), std::string(100'000, 'v')));
    }
    const std::string mnt = d.file("mnt" + std::to_string(kib));
    std::filesystem::create_directory(mnt);
    const pid_t child = fork_child([&] {
      // 512 KiB: the copy cannot even be opened; 8 MiB: it fails half-way.
      if (!test::mount_private_tmpfs(mnt, kib << 10)) return test::cannot_set_up;
      auto s = store::open(path, small());
      if (!s) return 2;
      auto r = (*s)->backup(mnt + "/copy");
      if (r) return 3;
      if (r.error() != std::errc::no_space_on_device) return 4;
      if (!std::filesystem::is_empty(mnt)) return 5;
      auto still = (*s)->get("k149");
      return still && still->size() == 100'000 ? 0 : 6;
    });
    const int code = wait_exit(child);
    if (code == test::cannot_set_up) GTEST_SKIP() << "cannot mount a private tmpfs here";
    EXPECT_EQ(code, 0) << "3: it succeeded, 4: another error, 5: something was left, 6: source";
  }
}

}  // namespace
}  // namespace keel::kv
