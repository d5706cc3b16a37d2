// The index's retired pages are reused (doc/kv-format.md, "Growth"): a page a split retired
// goes to the free list and back into a split once no snapshot can read it. So the index stays
// near the pages it uses, a snapshot held anywhere (another process too) keeps its pages from
// reuse while a killed one does not, readers never meet a page reused under them, and a list
// change killed half way loses nothing.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "keel/kv/store.hpp"
#include "kv/kv_support.hpp"
#include "kv/store_impl.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;
using test_support::open_ok;
using test_support::small;

std::string key_of(int i) {
  return "k" + std::to_string(i);
}

store_stats stats_of(store& s) {
  auto st = s.stats();
  if (!st) ADD_FAILURE() << st.error().message();
  return st ? *st : store_stats{};
}

// Without reuse the index holds every page a split ever retired beside the ones it uses (about
// as many): twice its live pages.
TEST(KvIndexReuse, RetiredPagesAreReusedSoTheIndexStaysNearItsLivePages) {
  temp_dir dir;
  auto s = open_ok(dir.file("s"));
  ASSERT_TRUE(s);
  for (int i = 0; i < 60'000; ++i)
    ASSERT_TRUE(s->put(key_of(i), "v")) << i;
  const store_stats st = stats_of(*s);
  ASSERT_GT(st.index_pages, 400u);
  const std::uint64_t pages = st.index_bytes / 4096;
  // The fixed pages, the directory, what grows ahead (a quarter), and the live pages.
  EXPECT_LT(pages, 136 + st.index_pages * 3 / 2)
      << st.index_pages << " bucket pages in use, " << pages << " in the file";
  EXPECT_LE(st.index_free_pages, 4u) << "each split reuses what the one before retired";
}

// A snapshot held by a transaction in another process keeps every page retired meanwhile off
// the reuse list's takers; once it ends, splits take them.
TEST(KvIndexReuse, ASnapshotHeldInAnotherProcessKeepsRetiredPagesUntilItEnds) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  for (int i = 0; i < 2'000; ++i)
    ASSERT_TRUE(s->put(key_of(i), "v")) << i;
  int ready[2];
  int done[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(done), 0);
  const pid_t reader = fork_child([&] {
    auto mine = store::open(path, small());
    if (!mine) return 2;
    auto t = (*mine)->begin();
    if (!t) return 3;
    char c = 1;
    if (::write(ready[1], &c, 1) != 1) return 4;
    return ::read(done[0], &c, 1) == 1 ? 0 : 5;  // the transaction ends with the child
  });
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  for (int i = 2'000; i < 22'000; ++i)
    ASSERT_TRUE(s->put(key_of(i), "v")) << i;
  const store_stats held = stats_of(*s);
  EXPECT_GE(held.index_free_pages, held.index_pages / 3)
      << "pages retired while the snapshot was held wait: " << held.index_pages << " in use";
  ASSERT_EQ(::write(done[1], &c, 1), 1);
  EXPECT_EQ(test::wait_exit(reader), 0);
  for (int i = 22'000; i < 30'000; ++i)
    ASSERT_TRUE(s->put(key_of(i), "v")) << i;
  const store_stats after = stats_of(*s);
  // Each split since took two pages and retired one.
  const std::uint64_t splits = after.index_pages - held.index_pages;
  ASSERT_GT(splits, 20u);
  EXPECT_GE(held.index_free_pages, after.index_free_pages + splits)
      << held.index_free_pages << " free pages before, " << after.index_free_pages << " after";
  EXPECT_EQ(after.index_bytes, held.index_bytes) << "the splits since took retired pages";
  for (int fd : {ready[0], ready[1], done[0], done[1]})
    ::close(fd);
}

// A reader killed while it held a snapshot holds nothing back: its slot is found dead.
TEST(KvIndexReuse, AReaderKilledHoldingASnapshotDoesNotStopReuse) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  const pid_t reader = fork_child([&] {
    auto mine = store::open(path, small());
    if (!mine) return 2;
    auto t = (*mine)->begin();
    if (!t) return 3;
    ::raise(SIGKILL);
    return 4;
  });
  const int status = test::wait_status(reader);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  for (int i = 0; i < 30'000; ++i)
    ASSERT_TRUE(s->put(key_of(i), "v")) << i;
  const store_stats st = stats_of(*s);
  EXPECT_LE(st.index_free_pages, 4u) << st.index_pages << " pages in use";
}

// A reader stopped between finding a key's page and looking in it, while a writer's splits
// retire that page and go on splitting: the page is not reused under it, and it finds its key.
std::atomic<int> reader_at{0};  // 1: armed, 2: the reader waits in its page, 3: go on
TEST(KvIndexReuse, AReaderInARetiredPageStillFindsItsKey) {
  temp_dir dir;
  auto s = open_ok(dir.file("s"));
  ASSERT_TRUE(s);
  for (int i = 0; i < 1'000; ++i)
    ASSERT_TRUE(s->put(key_of(i), "v" + std::to_string(i))) << i;
  reader_at.store(1);
  read_page_hook = []() noexcept {
    int armed = 1;
    if (!reader_at.compare_exchange_strong(armed, 2)) return;
    while (reader_at.load() != 3)
      std::this_thread::yield();
  };
  result<std::string> got =
      std::unexpected(error(std::make_error_code(std::errc::invalid_argument)));
  std::thread reader([&] { got = s->get(key_of(5)); });
  while (reader_at.load() != 2)
    std::this_thread::yield();
  // Every page of 1 000 keys is split several times over: the reader's among them.
  for (int i = 1'000; i < 40'000; ++i)
    ASSERT_TRUE(s->put(key_of(i), "n")) << i;
  reader_at.store(3);
  reader.join();
  read_page_hook = nullptr;
  ASSERT_TRUE(got) << got.error().message();
  EXPECT_EQ(*got, "v5");
}

// Readers in other processes look keys up while splits retire and reuse pages as fast as one
// writer can: none ever misses a key that was there before it looked, or reads a wrong value.
TEST(KvIndexReuse, ReadersNeverMeetAPageReusedUnderThem) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  constexpr int known = 3'000;
  for (int i = 0; i < known; ++i)
    ASSERT_TRUE(s->put(key_of(i), "v" + std::to_string(i))) << i;
  int stop[2];
  ASSERT_EQ(::pipe(stop), 0);
  std::vector<pid_t> readers;
  for (int r = 0; r < 2; ++r) {
    readers.push_back(fork_child([&] {
      ::close(stop[1]);
      auto mine = store::open(path, small());
      if (!mine) return 2;
      std::atomic<bool> done{false};
      std::thread watch([&] {
        char c;
        (void)!::read(stop[0], &c, 1);
        done.store(true);
      });
      int bad = 0;
      for (int round = 0; !done.load(); ++round) {
        for (int i = round % 7; i < known; i += 7) {
          auto v = (*mine)->get(key_of(i));
          if (!v || *v != "v" + std::to_string(i)) ++bad;
        }
      }
      watch.join();
      return bad == 0 ? 0 : 3;
    }));
  }
  ::close(stop[0]);
  for (int i = known; i < 60'000; ++i)
    ASSERT_TRUE(s->put(key_of(i), "n")) << i;
  ::close(stop[1]);
  for (const pid_t r : readers)
    EXPECT_EQ(test::wait_exit(r), 0) << "3: a reader missed a key or read a wrong value";
  const store_stats st = stats_of(*s);
  EXPECT_LT(st.index_bytes / 4096, 136 + st.index_pages * 3 / 2) << "pages were reused meanwhile";
}

// A user killed while it changed the free list, taking a page off it or adding one: the next
// change rebuilds the list from what its head reaches, so no page is handed out twice and
// (but the one being taken) none is lost; every key is there, with the store open
// throughout, reopened, and rebuilt.
int kill_at_call = 0;
void kill_at_list_change(int at) noexcept {
  kill_at_call = at;
  free_list_hook = []() noexcept {
    if (--kill_at_call == 0) ::raise(SIGKILL);
  };
}

void every_key_is_there(store& s, int n, const std::string& value, const char* when) {
  for (int i = 0; i < n; ++i) {
    auto v = s.get(key_of(i));
    ASSERT_TRUE(v) << when << ": " << i << ": " << v.error().message();
    ASSERT_EQ(*v, value) << when << ": " << i;
  }
  EXPECT_EQ(stats_of(s).records, static_cast<std::uint64_t>(n)) << when;
}

void reopened_and_rebuilt(std::unique_ptr<store> s, const std::string& path, int n,
                          const std::string& value) {
  auto verified = s->verify();
  ASSERT_TRUE(verified) << verified.error().message();
  s.reset();
  auto again = open_ok(path);
  ASSERT_TRUE(again);
  every_key_is_there(*again, n, value, "reopened");
  again.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path);
  ASSERT_TRUE(rebuilt);
  every_key_is_there(*rebuilt, n, value, "rebuilt");
}

TEST(KvIndexReuse, AUserKilledTakingAFreePageLosesNothing) {
  for (const int at : {1, 2, 5}) {
    SCOPED_TRACE(at);
    temp_dir dir;
    const std::string path = dir.file("s");
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    const pid_t victim = fork_child([&] {
      auto mine = store::open(path, small());
      if (!mine) return 2;
      kill_at_list_change(at);  // each split takes the page the one before retired
      for (int i = 0; i < 20'000; ++i) {
        if (!(*mine)->put(key_of(i), "v")) return 3;
      }
      return 4;
    });
    const int status = test::wait_status(victim);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
    // What the victim acknowledged is unknown past its last split: the survivor writes all.
    for (int i = 0; i < 20'000; ++i)
      ASSERT_TRUE(s->put(key_of(i), "w")) << i;
    every_key_is_there(*s, 20'000, "w", "while open");
    EXPECT_LE(stats_of(*s).index_free_pages, 4u) << "the list works again";
    reopened_and_rebuilt(std::move(s), path, 20'000, "w");
  }
}

// Here the list is long (a snapshot holds every retired page back), and the victim dies
// having linked a page after the last one but before the tail moved on: the list is mended,
// not dropped, and the splits after take its pages one by one.
TEST(KvIndexReuse, AUserKilledAddingAFreePageLosesNothing) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  auto held = s->begin();
  ASSERT_TRUE(held);
  const pid_t victim = fork_child([&] {
    auto mine = store::open(path, small());
    if (!mine) return 2;
    kill_at_list_change(60);
    for (int i = 0; i < 20'000; ++i) {
      if (!(*mine)->put(key_of(i), "v")) return 3;
    }
    return 4;
  });
  const int status = test::wait_status(victim);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  const store_stats killed = stats_of(*s);
  ASSERT_GE(killed.index_free_pages, 50u) << "a long list when the victim died";
  held->abort();
  // New keys until a split: it mends the list, and takes one page off it.
  int more = 20'000;
  store_stats now = killed;
  for (; now.index_pages == killed.index_pages && more < 30'000; ++more) {
    ASSERT_TRUE(s->put(key_of(more), "w")) << more;
    now = stats_of(*s);
  }
  ASSERT_GT(now.index_pages, killed.index_pages);
  EXPECT_GE(now.index_free_pages + 2, killed.index_free_pages) << "the list kept what it held";
  // Every split after takes a page off it, until none is left.
  const store_stats mended = now;
  for (; now.index_free_pages > 2 && more < 200'000; ++more) {
    ASSERT_TRUE(s->put(key_of(more), "w")) << more;
    if (more % 50 == 0) now = stats_of(*s);
  }
  EXPECT_GE(now.index_pages - mended.index_pages + 3, mended.index_free_pages)
      << "as many splits as pages it held";
  for (int i = 0; i < 20'000; ++i)
    ASSERT_TRUE(s->put(key_of(i), "w")) << i;  // what the victim wrote, and more
  every_key_is_there(*s, more, "w", "while open");
  reopened_and_rebuilt(std::move(s), path, more, "w");
}

// stats walks the index holding a snapshot in a user slot; with every slot taken it holds the
// directory lock instead (no split meanwhile, so no page is reused under it), rather than fail.
TEST(KvIndexReuse, StatsWorkWithEveryUserSlotTaken) {
  temp_dir dir;
  auto s = open_ok(dir.file("s"));
  ASSERT_TRUE(s);
  for (int i = 0; i < 1'000; ++i)
    ASSERT_TRUE(s->put(key_of(i), "v")) << i;
  std::vector<transaction> open;
  for (;;) {
    auto t = s->begin();
    if (!t) {
      ASSERT_EQ(t.error(), errc::too_many_users) << t.error().message();
      break;
    }
    open.push_back(std::move(*t));
    ASSERT_LE(open.size(), 4096u);
  }
  auto st = s->stats();
  ASSERT_TRUE(st) << st.error().message();
  EXPECT_EQ(st->records, 1'000u);
  EXPECT_GT(st->index_pages, 1u);
  open.clear();
  EXPECT_TRUE(s->put("after", "1"));
}

// An index loaded from a checkpoint (after every user was gone) holds the retired pages as
// zeroes: they go to the free list, and the splits after take them.
TEST(KvIndexReuse, AnIndexLoadedFromACheckpointReusesItsFreePages) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    // A snapshot held throughout: nothing is reused, the checkpoint holds them all.
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    auto t = s->begin();
    ASSERT_TRUE(t);
    for (int i = 0; i < 20'000; ++i)
      ASSERT_TRUE(s->put(key_of(i), "v")) << i;
    ASSERT_GE(stats_of(*s).index_free_pages, 100u);
    ASSERT_TRUE(s->checkpoint());
  }
  std::filesystem::remove(path + "/index");  // as after a crash of every user
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  const store_stats loaded = stats_of(*s);
  ASSERT_GT(loaded.checkpoint_seq, 0u);
  EXPECT_GE(loaded.index_free_pages, 100u);
  // Until a few pages split (where the first ones do depends on the store's hash seed).
  int end = 20'000;
  store_stats after = loaded;
  while (after.index_free_pages + 4 > loaded.index_free_pages && end < 60'000) {
    for (const int stop = end + 500; end < stop; ++end)
      ASSERT_TRUE(s->put(key_of(end), "v")) << end;
    after = stats_of(*s);
  }
  EXPECT_EQ(after.index_bytes, loaded.index_bytes) << "the splits took the free pages";
  EXPECT_LE(after.index_free_pages + 4, loaded.index_free_pages) << end << " keys";
  for (int i = 0; i < end; ++i)
    ASSERT_TRUE(s->get(key_of(i))) << i;
}

}  // namespace
}  // namespace keel::kv
