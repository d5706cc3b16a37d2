// keel::kv::store: what a user of the store relies on, one claim per test. Concurrency and
// crash claims are tested with real processes (fork, SIGKILL); kv/store_crash_test.cpp has
// the power-loss ones.

#include "keel/kv/store.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "io/map_guard.hpp"
#include "kv/kv_support.hpp"
#include "kv/store_impl.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;
using test::wait_exit;

using test_support::open_ok;
using test_support::small;

TEST(KvStore, PutGetEraseAndReopen) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    EXPECT_EQ(s->get("a").error(), errc::not_found);
    ASSERT_TRUE(s->put("a", "one"));
    ASSERT_TRUE(s->put("b", std::string("\0two\xff", 5)));
    EXPECT_EQ(*s->get("a"), "one");
    ASSERT_TRUE(s->put("a", "uno"));
    EXPECT_EQ(*s->get("a"), "uno");
    EXPECT_EQ(*s->get("b"), std::string("\0two\xff", 5));
    ASSERT_TRUE(s->erase("b"));
    EXPECT_EQ(s->get("b").error(), errc::not_found);
    EXPECT_EQ(s->erase("b").error(), errc::not_found);
    ASSERT_TRUE(s->put("", "x").error() == std::errc::invalid_argument);
    EXPECT_EQ(s->put(std::string(max_key_size + 1, 'k'), "x").error(), errc::too_large);
    ASSERT_TRUE(s->put(std::string(max_key_size, 'k'), ""));
    EXPECT_EQ(*s->get(std::string(max_key_size, 'k')), "");
  }
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  EXPECT_EQ(*s->get("a"), "uno");
  EXPECT_EQ(s->get("b").error(), errc::not_found);
  EXPECT_EQ(*s->get(std::string(max_key_size, 'k')), "");
  auto st = s->stats();
  ASSERT_TRUE(st);
  EXPECT_EQ(st->records, 2u);
}

// A get into the caller's string: the value, in the memory the string has when it is large
// enough (a loop of gets allocates nothing), and the string as it was after any error.
TEST(KvStore, AGetIntoAStringReusesItsMemoryAndKeepsItOnAnError) {
  temp_dir dir;
  auto s = open_ok(dir.file("s"));
  ASSERT_TRUE(s);
  const std::string small_value(100, 's');
  std::string blob(200'000, 'b');  // over the blob threshold: a block of its own
  blob[123'456] = 'x';
  ASSERT_TRUE(s->put("a", small_value));
  ASSERT_TRUE(s->put("big", blob));
  ASSERT_TRUE(s->put("empty", ""));
  std::string out;
  out.reserve(300'000);
  const char* memory = out.data();
  ASSERT_TRUE(s->get("a", out));
  EXPECT_EQ(out, small_value);
  ASSERT_TRUE(s->get("big", out));
  EXPECT_EQ(out, blob);
  ASSERT_TRUE(s->get("empty", out));
  EXPECT_EQ(out, "");
  EXPECT_EQ(out.data(), memory) << "the string's memory was not reused";
  out = "kept";
  EXPECT_EQ(s->get("missing", out).error(), errc::not_found);
  EXPECT_EQ(s->get("", out).error(), std::errc::invalid_argument);
  EXPECT_EQ(s->get(std::string(max_key_size + 1, 'k'), out).error(), errc::too_large);
  ASSERT_TRUE(s->erase("a"));
  EXPECT_EQ(s->get("a", out).error(), errc::not_found);
  EXPECT_EQ(out, "kept");
  // A string shorter than the value grows to it.
  std::string tiny;
  ASSERT_TRUE(s->get("big", tiny));
  EXPECT_EQ(tiny, blob);
}

TEST(KvStore, ATransactionReadsItsSnapshotAndItsOwnWrites) {
  temp_dir dir;
  auto s = open_ok(dir.file("s"));
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("k", "old"));
  auto t = s->begin();
  ASSERT_TRUE(t);
  ASSERT_TRUE(s->put("k", "new"));
  ASSERT_TRUE(s->put("other", "x"));
  EXPECT_EQ(*t->get("k"), "old") << "the snapshot, not the newer commit";
  EXPECT_EQ(t->get("other").error(), errc::not_found);
  ASSERT_TRUE(t->put("mine", "m"));
  EXPECT_EQ(*t->get("mine"), "m");
  ASSERT_TRUE(t->erase("mine"));
  EXPECT_EQ(t->get("mine").error(), errc::not_found);
  t->abort();
  EXPECT_EQ(s->get("mine").error(), errc::not_found);
  EXPECT_EQ(*s->get("k"), "new");
}

TEST(KvStore, ACommitOverAKeyCommittedSinceItsSnapshotConflictsAndLeavesNoTrace) {
  temp_dir dir;
  auto s = open_ok(dir.file("s"));
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("x", "1"));
  auto t = s->begin();
  ASSERT_TRUE(t);
  EXPECT_EQ(*t->get("x"), "1");
  ASSERT_TRUE(t->put("y", "from t"));
  ASSERT_TRUE(s->put("x", "2"));  // commits a key t read
  auto r = t->commit();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), errc::conflict);
  EXPECT_EQ(s->get("y").error(), errc::not_found) << "nothing of a failed commit is applied";
  // A blind write over a key committed since the snapshot conflicts too.
  auto u = s->begin();
  ASSERT_TRUE(u);
  ASSERT_TRUE(s->put("z", "a"));
  ASSERT_TRUE(u->put("z", "b"));
  EXPECT_EQ(u->commit().error(), errc::conflict);
  EXPECT_EQ(*s->get("z"), "a");
  // Disjoint keys do not conflict.
  auto v = s->begin();
  ASSERT_TRUE(v);
  ASSERT_TRUE(s->put("p", "1"));
  ASSERT_TRUE(v->put("q", "1"));
  EXPECT_TRUE(v->commit());
}

// A large transaction (its keys planned in the order of their pages): each key's last write
// is what it commits, whether written once, written again larger or smaller, erased, or put
// after an erase; a key it only read and another commit changed is a conflict, and a
// conflict leaves nothing of it.
TEST(KvStore, ALargeTransactionCommitsEachKeysLastWriteAndConflictsOnAKeyItRead) {
  const auto is_absent = [](const result<std::string>& g) {
    return !g && g.error() == errc::not_found;
  };
  temp_dir dir;
  auto s = open_ok(dir.file("s"));
  ASSERT_TRUE(s);
  constexpr int n = 5'000;
  for (int i = 0; i < n; i += 7)
    ASSERT_TRUE(s->put("k" + std::to_string(i), "before"));
  std::map<std::string, std::string> want;  // ("": absent)
  for (int i = 0; i < n; i += 7)
    want["k" + std::to_string(i)] = "before";
  const auto build = [&](transaction& t, std::map<std::string, std::string>& model) {
    for (int i = 0; i < n; ++i) {
      const std::string k = "k" + std::to_string(i);
      const std::string v(static_cast<std::size_t>(2 + i % 97), static_cast<char>('a' + i % 26));
      switch (i % 5) {
        case 0:  // read only
          if (auto g = t.get(k); g) {
            EXPECT_EQ(*g, want[k]) << k;
          } else {
            EXPECT_TRUE(is_absent(g)) << k;
            EXPECT_FALSE(want.contains(k)) << k;
          }
          break;
        case 1:  // once
          ASSERT_TRUE(t.put(k, v));
          model[k] = v;
          break;
        case 2:  // again, larger
          ASSERT_TRUE(t.put(k, "x"));
          ASSERT_TRUE(t.put(k, v + v + v));
          model[k] = v + v + v;
          break;
        case 3:  // erased, then put smaller
          ASSERT_TRUE(t.put(k, v + v));
          ASSERT_TRUE(t.erase(k));
          EXPECT_TRUE(is_absent(t.get(k))) << k;
          ASSERT_TRUE(t.put(k, v.substr(0, v.size() / 2)));
          model[k] = v.substr(0, v.size() / 2);
          break;
        default:  // erased
          ASSERT_TRUE(t.put(k, v));
          ASSERT_TRUE(t.erase(k));
          model[k] = "";
      }
      if (model.contains(k) && !model[k].empty()) {
        EXPECT_EQ(*t.get(k), model[k]);
      }
    }
  };
  {
    auto t = s->begin();
    ASSERT_TRUE(t);
    std::map<std::string, std::string> lost;
    build(*t, lost);
    ASSERT_TRUE(s->put("k35", "changed"));  // a key t only read (35 % 5 == 0)
    auto r = t->commit();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error(), errc::conflict);
    want["k35"] = "changed";
  }
  for (const auto& [k, v] : want) {
    auto g = s->get(k);
    ASSERT_TRUE(g) << k;
    EXPECT_EQ(*g, v) << k << ": nothing of a failed commit is applied";
  }
  auto t = s->begin();
  ASSERT_TRUE(t);
  build(*t, want);
  ASSERT_TRUE(t->commit());
  for (int i = 0; i < n; ++i) {
    const std::string k = "k" + std::to_string(i);
    auto g = s->get(k);
    const auto it = want.find(k);
    if (it == want.end() || it->second.empty()) {
      EXPECT_TRUE(is_absent(g)) << k;
    } else {
      ASSERT_TRUE(g) << k;
      EXPECT_EQ(*g, it->second) << k;
    }
  }
}

TEST(KvStore, ManyKeysGrowTheIndexAndAScanReturnsEachOnce) {
  temp_dir dir;
  const std::string path = dir.file("s");
  constexpr int n = 20000;
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    for (int i = 0; i < n; ++i) {
      ASSERT_TRUE(s->put("key-" + std::to_string(i), "value-" + std::to_string(i))) << i;
    }
    for (int i = 0; i < n; i += 7) {
      auto v = s->get("key-" + std::to_string(i));
      ASSERT_TRUE(v) << i << " " << v.error().message();
      EXPECT_EQ(*v, "value-" + std::to_string(i));
    }
  }
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  std::set<std::string> seen;
  std::string cursor;
  for (;;) {
    auto page = s->scan(cursor, 333);
    ASSERT_TRUE(page) << page.error().message();
    for (const auto& it : page->items) {
      EXPECT_TRUE(seen.insert(it.key).second) << "twice: " << it.key;
      EXPECT_EQ(it.value, "value-" + it.key.substr(4));
    }
    if (page->done) break;
    cursor = page->cursor;
  }
  EXPECT_EQ(seen.size(), static_cast<std::size_t>(n));
  auto st = s->stats();
  ASSERT_TRUE(st);
  EXPECT_EQ(st->records, static_cast<std::uint64_t>(n));
  EXPECT_GT(st->index_pages, 100u);
  auto checked = s->verify();
  ASSERT_TRUE(checked) << checked.error().message();
  EXPECT_EQ(*checked, static_cast<std::uint64_t>(n));
}

TEST(KvStore, LargeValuesGoToBlobsAndComeBackWhole) {
  temp_dir dir;
  const std::string path = dir.file("s");
  std::string mid(200 << 10, '\0');
  std::string huge(3 << 20, '\0');  // larger than a segment: a segment of its own
  std::mt19937_64 rng(7);
  for (auto& c : mid)
    c = static_cast<char>(rng());
  for (auto& c : huge)
    c = static_cast<char>(rng());
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("mid", mid));
    auto r = s->put("huge", huge);
    ASSERT_TRUE(r) << r.error().message();
    EXPECT_EQ(*s->get("mid"), mid);
    EXPECT_EQ(*s->get("huge"), huge);
  }
  std::filesystem::remove(path + "/index");  // a rebuild finds them too
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  EXPECT_EQ(*s->get("mid"), mid);
  EXPECT_EQ(*s->get("huge"), huge);
  auto t = s->begin();
  ASSERT_TRUE(t);
  auto view = t->get_view("huge");
  ASSERT_TRUE(view);
  EXPECT_EQ(view->size(), huge.size());
  EXPECT_EQ(std::memcmp(view->data(), huge.data(), huge.size()), 0);
}

TEST(KvStore, ARebuiltIndexHasEveryCommitAndNoUndoneOne) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    for (int i = 0; i < 500; ++i)
      ASSERT_TRUE(s->put("k" + std::to_string(i % 50), std::to_string(i)));
    for (int i = 0; i < 50; i += 5)
      ASSERT_TRUE(s->erase("k" + std::to_string(i)));
  }
  std::filesystem::remove(path + "/index");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  for (int i = 0; i < 50; ++i) {
    auto v = s->get("k" + std::to_string(i));
    if (i % 5 == 0) {
      EXPECT_EQ(v.error(), errc::not_found) << i;
    } else {
      ASSERT_TRUE(v) << i;
      EXPECT_EQ(*v, std::to_string(450 + i));
    }
  }
  EXPECT_EQ(s->stats()->records, 40u);
}

// Increments `counters` counters `rounds` times in read-modify-write transactions, retrying
// conflicts. Returns the number of commits that succeeded.
int increment(store& s, int counters, int rounds, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  int done = 0;
  for (int i = 0; i < rounds; ++i) {
    const std::string key = "c" + std::to_string(rng() % static_cast<std::uint64_t>(counters));
    for (;;) {
      auto t = s.begin();
      if (!t) return -1;
      auto v = t->get(key);
      long n = 0;
      if (v) {
        n = std::stol(*v);
      } else if (v.error() != errc::not_found) {
        return -1;
      }
      if (!t->put(key, std::to_string(n + 1))) return -1;
      auto r = t->commit();
      if (r) {
        ++done;
        break;
      }
      if (r.error() != errc::conflict) {
        std::fprintf(stderr, "commit: %s\n", r.error().message().c_str());
        return -1;
      }
    }
  }
  return done;
}

long total(store& s, int counters) {
  long sum = 0;
  for (int c = 0; c < counters; ++c) {
    auto v = s.get("c" + std::to_string(c));
    if (v) sum += std::stol(*v);
  }
  return sum;
}

TEST(KvStore, ThreadsIncrementingSharedCountersLoseNoUpdate) {
  temp_dir dir;
  auto s = open_ok(dir.file("s"));
  ASSERT_TRUE(s);
  constexpr int threads = 8;
  constexpr int rounds = 500;
  std::atomic<int> ok{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      if (increment(*s, 4, rounds, static_cast<std::uint64_t>(t)) == rounds) ok.fetch_add(1);
    });
  }
  for (auto& t : ts)
    t.join();
  EXPECT_EQ(ok.load(), threads);
  EXPECT_EQ(total(*s, 4), threads * rounds);
}

TEST(KvStore, FortyEightWriterProcessesIncrementingSharedCountersLoseNoUpdate) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
  }
  constexpr int writers = 48;
  constexpr int rounds = 100;
  constexpr int counters = 8;
  std::vector<pid_t> pids;
  for (int w = 0; w < writers; ++w) {
    pids.push_back(fork_child([&, w] {
      auto s = store::open(path, small());
      if (!s) return 2;
      return increment(**s, counters, rounds, static_cast<std::uint64_t>(w) + 100) == rounds ? 0
                                                                                             : 1;
    }));
  }
  for (const pid_t p : pids)
    EXPECT_EQ(wait_exit(p), 0);
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  EXPECT_EQ(total(*s, counters), writers * rounds);
}

TEST(KvStore, WritersKilledAtAnyPointBlockNobodyAndLoseNoAcknowledgedCommit) {
  temp_dir dir;
  const std::string path = dir.file("s");
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
  }
  constexpr int counters = 4;
  constexpr int victims = 16;
  constexpr int survivors = 3;
  constexpr int survivor_rounds = 400;
  // Every writer reports each acknowledged increment through a pipe. Victims are killed at
  // random moments, mid-commit or not, while the survivors go on.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const auto writer = [&](int w, int rounds) {
    ::close(fds[0]);
    auto s = store::open(path, small());
    if (!s) return 2;
    for (int i = 0; rounds < 0 || i < rounds; ++i) {
      if (increment(**s, counters, 1, static_cast<std::uint64_t>(w * 100000 + i)) != 1) return 1;
      if (::write(fds[1], "+", 1) != 1) return 3;
    }
    return 0;
  };
  std::vector<pid_t> kept;
  for (int w = 0; w < survivors; ++w) {
    kept.push_back(fork_child([&, w] { return writer(w, survivor_rounds); }));
  }
  std::vector<pid_t> pids;
  std::mt19937_64 rng(3);
  for (int w = 0; w < victims; ++w) {
    pids.push_back(fork_child([&, w] { return writer(survivors + w, -1); }));
    std::this_thread::sleep_for(std::chrono::milliseconds(2 + rng() % 15));
    ::kill(pids.back(), SIGKILL);
  }
  ::close(fds[1]);
  const auto start = std::chrono::steady_clock::now();
  for (const pid_t p : kept)
    EXPECT_EQ(wait_exit(p), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
  for (const pid_t p : pids)
    test::wait_status(p);
  long acknowledged = 0;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n <= 0) break;
    acknowledged += n;
  }
  ::close(fds[0]);
  EXPECT_GE(acknowledged, survivors * survivor_rounds);
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  const long before = total(*s, counters);
  EXPECT_GE(before, acknowledged);
  EXPECT_LE(before, acknowledged + victims) << "at most one unacknowledged commit per victim";
  ASSERT_EQ(increment(*s, counters, 200, 9), 200);
  EXPECT_EQ(total(*s, counters), before + 200);
}

// A transaction begun before a fork belongs to the parent: its snapshot is held by the
// parent's slot, and a commit through it would write into that slot. The child's copy is
// refused; the child's own transactions work, and the parent's commits as usual.
TEST(KvStore, ATransactionBegunBeforeAForkIsTheParents) {
  temp_dir d;
  const std::string path = d.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("a", "1"));
  auto t = s->begin();
  ASSERT_TRUE(t);
  ASSERT_TRUE(t->put("b", "2"));
  const pid_t child = fork_child([&] {
    auto v = t->get("a");
    if (v || v.error() != std::errc::invalid_argument) return 1;
    auto c = t->commit();
    if (c || c.error() != std::errc::invalid_argument) return 2;
    auto own = s->begin();
    if (!own || !own->put("c", "3") || !own->commit()) return 3;
    return 0;
  });
  EXPECT_EQ(test::wait_exit(child), 0);
  auto c = t->commit();
  ASSERT_TRUE(c) << c.error().message();
  for (const auto& [k, v] : {std::pair{"a", "1"}, {"b", "2"}, {"c", "3"}}) {
    auto got = s->get(k);
    ASSERT_TRUE(got) << k;
    EXPECT_EQ(*got, v);
  }
}

// A forked child holds no open byte of the store until its first call takes a slot, so a lone
// opener may rebuild the index meanwhile, cutting the file to nothing first. A get that read
// the directory before its slot (to prefetch the entry) met that rebuild between the
// directory word and the entry it names, and died of SIGBUS (found by review). The child's
// reads of the index come after its slot, or while it holds the byte.
// Zeroes the state word of the index of the store at `path` (closed): as a rebuild begun and
// not finished leaves it. The next opener alone rebuilds it.
void zero_index_state(const std::string& path) {
  std::fstream f(path + "/index", std::ios::in | std::ios::out | std::ios::binary);
  const std::uint64_t zero = 0;
  f.seekp(static_cast<std::streamoff>(header::state));
  f.write(reinterpret_cast<const char*>(&zero), sizeof zero);
}

test::signal_pipe* directory_read;  // the child's "read the directory word"
test::signal_pipe* go_on;           // the parent's "read on"
pid_t reading_child = 0;
int reading_child_status = -1;  // its wait status, if the rebuild waited for it

TEST(KvStore, AChildsFirstGetNeverReadsAnIndexALoneOpenerMayRebuild) {
  temp_dir d;
  const std::string path = d.file("s");
  options o = small();
  o.lock_timeout = std::chrono::milliseconds(1000);
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  const std::string value(40, 'v');
  for (int k = 0; k < 1000; ++k)
    ASSERT_TRUE(s->put("k" + std::to_string(k), value));
  test::signal_pipe read_it;
  test::signal_pipe read_on;
  directory_read = &read_it;
  go_on = &read_on;
  reading_child_status = -1;
  const pid_t child = fork_child([&] {
    ::alarm(60);  // a child that waits forever is killed, and fails the test
    index::directory_hook = []() noexcept {
      index::directory_hook = nullptr;
      directory_read->notify();
      (void)go_on->wait();
    };
    auto v = s->get("k123");
    return v && *v == value ? 0 : 1;
  });
  test::killed_on_failure guard{child};
  reading_child = child;
  s.reset();  // the parent's byte let go: the child holds none until it takes a slot
  ASSERT_TRUE(read_it.ready_within(std::chrono::seconds(60))) << "the child never read";
  // The state word zeroed, and no checkpoint to rebuild from: the next opener alone rebuilds
  // the index. Its rebuild, with the file cut to nothing, lets the child read on and waits
  // for it. An opener not alone finds the state invalid and waits for a rebuilder until its
  // lock_timeout.
  const auto invalidate = [&] {
    std::filesystem::remove(path + "/checkpoint");
    zero_index_state(path);
  };
  invalidate();
  index_reset_hook = []() noexcept {
    index_reset_hook = nullptr;
    go_on->notify();
    reading_child_status = test::wait_status(reading_child);
  };
  (void)store::open(path, o);
  index_reset_hook = nullptr;
  const bool rebuilt_under_it = reading_child_status != -1;
  int status = reading_child_status;
  if (!rebuilt_under_it) {
    read_on.notify();
    status = test::wait_status(child);
  }
  guard.pid = 0;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << (WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                              : "exit " + std::to_string(WEXITSTATUS(status)))
      << (rebuilt_under_it ? ", the index rebuilt under its read" : "");
  EXPECT_FALSE(rebuilt_under_it) << "a rebuild while the child read";
  invalidate();
  auto again = open_ok(path, o);
  ASSERT_TRUE(again);
  EXPECT_EQ(*again->get("k123"), value);
}

// The same, for every call a child makes first, and an index a lone opener left cut to
// nothing (it died rebuilding it: the first thing a rebuild does is cut the file). Calls that
// read the index's header before their slot (stats, put, a slot's unmapping of removed
// segments) faulted, were retried by the map guard and then killed by SIGBUS. Every call
// takes the open byte first now, and finds the index as an opener that is not alone does:
// not valid, so it waits for a rebuild, until its lock_timeout.
TEST(KvStore, AChildsFirstCallOverAnIndexCutToNothingWaitsAndNeverFaults) {
  temp_dir d;
  const std::string path = d.file("s");
  options o = small();
  o.lock_timeout = std::chrono::milliseconds(300);
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  for (int k = 0; k < 100; ++k)
    ASSERT_TRUE(s->put("k" + std::to_string(k), "v" + std::to_string(k)));
  const std::string copy = d.file("copy");
  std::string into;
  const std::vector<std::pair<std::string, std::function<std::error_code(store&)>>> calls{
      {"get", [](store& st) { return st.get("k1").error(); }},
      {"get into a string", [&](store& st) { return st.get("k1", into).error(); }},
      {"put", [](store& st) { return st.put("k1", "w").error(); }},
      {"erase", [](store& st) { return st.erase("k1").error(); }},
      {"begin", [](store& st) { return st.begin().error(); }},
      {"scan", [](store& st) { return st.scan("", 10).error(); }},
      {"stats", [](store& st) { return st.stats().error(); }},
      {"verify", [](store& st) { return st.verify().error(); }},
      {"compact", [](store& st) { return st.compact().error(); }},
      {"checkpoint", [](store& st) { return st.checkpoint().error(); }},
      {"backup", [&](store& st) { return st.backup(copy).error(); }},
  };
  test::signal_pipe go;
  std::vector<pid_t> children;
  std::vector<test::killed_on_failure> guards;
  guards.reserve(calls.size());
  for (const auto& [name, call] : calls) {
    children.push_back(fork_child([&] {
      ::alarm(60);  // a child that waits forever is killed, and fails the test
      // A fault is not retried for 20 s here: without the fix the child dies at once.
      io::map_guard::set_give_up(std::chrono::milliseconds(200));
      if (!go.ready_within(std::chrono::seconds(60))) return 3;
      // (.error() of a success: the call went through over no index at all)
      const std::error_code e = call(*s);
      return e == std::errc::timed_out ? 0 : 1;
    }));
    guards.emplace_back(children.back());  // (in place: a temporary's end would kill it)
  }
  s.reset();  // the last user out: the children hold no byte
  std::filesystem::resize_file(path + "/index", 0);
  go.notify();
  for (std::size_t i = 0; i < calls.size(); ++i) {
    const int status = test::wait_status(children[i]);
    guards[i].pid = 0;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << calls[i].first << ": "
        << (WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                                : "exit " + std::to_string(WEXITSTATUS(status)));
  }
  // The next opener alone rebuilds it, from the log: nothing was lost.
  auto again = open_ok(path, o);
  ASSERT_TRUE(again);
  for (int k = 0; k < 100; ++k)
    EXPECT_EQ(*again->get("k" + std::to_string(k)), "v" + std::to_string(k));
}

// A child whose first call comes after a lone opener rebuilt the index (its parent gone)
// reads the rebuilt index, and writes into it what others then read.
TEST(KvStore, AChildsFirstCallAfterARebuildUsesTheRebuiltIndex) {
  temp_dir d;
  const std::string path = d.file("s");
  options o = small();
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  for (int k = 0; k < 100; ++k)
    ASSERT_TRUE(s->put("k" + std::to_string(k), "v" + std::to_string(k)));
  test::signal_pipe go;
  const pid_t child = fork_child([&] {
    ::alarm(60);
    if (go.wait() != '!') return 3;
    for (int k = 0; k < 100; ++k) {
      auto v = s->get("k" + std::to_string(k));
      if (!v || *v != "v" + std::to_string(k)) return 1;
    }
    return s->put("child", "c") && s->erase("k0") ? 0 : 2;
  });
  test::killed_on_failure guard{child};
  s.reset();
  // The state word zeroed and no checkpoint: the next opener alone rebuilds the index.
  std::filesystem::remove(path + "/checkpoint");
  zero_index_state(path);
  auto rebuilt = open_ok(path, o);
  ASSERT_TRUE(rebuilt);
  go.notify();
  EXPECT_EQ(test::wait_exit(child), 0);
  guard.pid = 0;
  EXPECT_EQ(*rebuilt->get("child"), "c");
  EXPECT_EQ(rebuilt->get("k0").error(), errc::not_found);
  EXPECT_EQ(*rebuilt->get("k1"), "v1");
}

// A child whose store's index was removed (by hand, say) and made anew by another opener since
// its parent closed the store maps a file nobody else uses: its reads would be stale and its
// writes lost (a reviewer saw both). Its first call is told the store it has is gone: ESTALE.
TEST(KvStore, AChildWhoseIndexWasRemovedAndMadeAnewIsToldItIsStale) {
  temp_dir d;
  const std::string path = d.file("s");
  options o = small();
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("k1", "v1"));
  ASSERT_TRUE(s->put("k2", "v2"));
  test::signal_pipe go;
  const pid_t child = fork_child([&] {
    ::alarm(60);
    if (go.wait() != '!') return 3;
    const std::error_code stale(ESTALE, std::generic_category());
    auto v = s->get("k1");
    if (v || v.error() != stale) return 1;
    auto p = s->put("k2", "from the child");
    return !p && p.error() == stale ? 0 : 2;
  });
  test::killed_on_failure guard{child};
  s.reset();
  ASSERT_TRUE(std::filesystem::remove(path + "/index"));
  auto other = open_ok(path, o);  // alone: a new index, rebuilt
  ASSERT_TRUE(other);
  ASSERT_TRUE(other->put("k1", "new"));
  go.notify();
  EXPECT_EQ(test::wait_exit(child), 0);
  guard.pid = 0;
  EXPECT_EQ(*other->get("k1"), "new");
  EXPECT_EQ(*other->get("k2"), "v2");
}

// An index removed by hand while a process has the store open: that process goes on through
// the index it maps, so another opener must not take the store for nobody's and build a
// second index over the same log (two indexes lost each other's acknowledged commits, and
// verify then found a segment corrupt). It waits, and is refused; once the user has closed
// the store, the next opener rebuilds it with every commit.
TEST(KvStore, AnOpenerStandsAsideWhileAUserHasTheStoreOpenThroughARemovedIndex) {
  temp_dir d;
  const std::string path = d.file("s");
  options o = small();
  o.lock_timeout = std::chrono::milliseconds(300);
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("k1", "v1"));
  ASSERT_TRUE(std::filesystem::remove(path + "/index"));
  const pid_t child = fork_child([&] {
    ::alarm(60);
    auto other = store::open(path, o);
    if (other) {
      (void)(*other)->put("k1", "from the child");
      return 1;
    }
    return other.error() == std::errc::device_or_resource_busy ? 0 : 2;
  });
  test::killed_on_failure guard{child};
  EXPECT_EQ(test::wait_exit(child), 0) << "1: it opened beside the user; 2: another error";
  guard.pid = 0;
  ASSERT_TRUE(s->put("k2", "v2"));
  s.reset();
  auto after = open_ok(path, o);
  ASSERT_TRUE(after);
  EXPECT_EQ(*after->get("k1"), "v1");
  EXPECT_EQ(*after->get("k2"), "v2");
  auto checked = after->verify();
  ASSERT_TRUE(checked) << checked.error().message();
  EXPECT_EQ(*checked, 2u);
}

// An index replaced between an opener's two opens of it by path: the opener locked the new
// file and worked through its map of the old one, and the next opener, finding the new file
// held and never built, waited in vain (commits through the old one were lost).
std::string replaced_index;

TEST(KvStore, AnOpenerLocksTheIndexItMaps) {
  temp_dir d;
  const std::string path = d.file("s");
  options o = small();
  o.lock_timeout = std::chrono::milliseconds(300);
  {
    auto s = open_ok(path, o);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("k1", "v1"));
  }
  replaced_index = path + "/index";
  index_opened_hook = []() noexcept {
    index_opened_hook = nullptr;
    std::filesystem::remove(replaced_index);
    std::ofstream{replaced_index};  // another, empty
  };
  auto s = open_ok(path, o);
  index_opened_hook = nullptr;
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("k2", "v2"));
  auto other = store::open(path, o);
  ASSERT_TRUE(other) << other.error().message();
  EXPECT_EQ(*(*other)->get("k1"), "v1");
  EXPECT_EQ(*(*other)->get("k2"), "v2");
}

// A child forked by another thread while a store opens (its descriptors holding the index's
// open byte and the store file's presence byte, not yet handed to the store's users) keeps
// none of those bytes held: its copies kept them for its whole life, and once the index was
// removed every opener was refused, a user present that was none.
int forked_while_opening = 0;
int child_may_end[2] = {-1, -1};
// Forks (once) a child that holds on until the parent closes its end of child_may_end.
void fork_idle_child() noexcept {
  if (forked_while_opening != 0) return;
  forked_while_opening = ::fork();
  if (forked_while_opening == 0) {
    ::close(child_may_end[1]);
    char c;
    (void)!::read(child_may_end[0], &c, 1);
    ::_exit(0);
  }
}

// With the store closed and its index removed, while the idle child lives: the next opener
// must be alone (and rebuild the index, with "k").
void opens_alone_while_the_child_lives(const std::string& path, const options& o) {
  test::killed_on_failure guard{forked_while_opening};
  ::close(child_may_end[0]);
  ASSERT_TRUE(std::filesystem::remove(path + "/index"));
  auto again = store::open(path, o);
  if (again) {
    EXPECT_EQ(*(*again)->get("k"), "v");
  } else {
    ADD_FAILURE() << again.error().message();
  }
  ::close(child_may_end[1]);
  EXPECT_EQ(test::wait_exit(forked_while_opening), 0);
  guard.pid = 0;
}

TEST(KvStore, AChildForkedWhileAStoreOpensKeepsNoneOfItsBytes) {
  temp_dir d;
  const std::string path = d.file("s");
  options o = small();
  o.lock_timeout = std::chrono::milliseconds(300);
  ASSERT_TRUE(open_ok(path, o));
  ASSERT_EQ(::pipe(child_may_end), 0);
  alone_opening_hook = fork_idle_child;
  auto s = open_ok(path, o);
  alone_opening_hook = nullptr;
  ASSERT_TRUE(s);
  ASSERT_GT(forked_while_opening, 0);
  ASSERT_TRUE(s->put("k", "v"));
  s.reset();
  opens_alone_while_the_child_lives(path, o);
}

// So too a child forked while a store closes: its copies kept the bytes (the open byte
// exclusively, as the last user out seals what is durable).
TEST(KvStore, AChildForkedWhileAStoreClosesKeepsNoneOfItsBytes) {
  temp_dir d;
  const std::string path = d.file("s");
  options o = small();
  o.lock_timeout = std::chrono::milliseconds(300);
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("k", "v"));
  forked_while_opening = 0;
  ASSERT_EQ(::pipe(child_may_end), 0);
  closing_hook = fork_idle_child;
  s.reset();
  closing_hook = nullptr;
  ASSERT_GT(forked_while_opening, 0);
  opens_alone_while_the_child_lives(path, o);
}

// The threads of a child that wait for an index to be rebuilt each wait out their own
// lock_timeout, together: not one after another (4 threads took 4 lock_timeouts, each
// waiting for the one before while it held the process's users' mutex).
TEST(KvStore, AChildsThreadsWaitForARebuildTogether) {
  temp_dir d;
  const std::string path = d.file("s");
  options o = small();
  o.lock_timeout = std::chrono::milliseconds(1000);
  auto s = open_ok(path, o);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("k", "v"));
  test::signal_pipe go;
  const pid_t child = fork_child([&] {
    ::alarm(60);
    if (go.wait() != '!') return 3;
    const auto start = std::chrono::steady_clock::now();
    std::atomic<int> timed_out{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        auto v = s->get("k");
        if (!v && v.error() == std::errc::timed_out) ++timed_out;
      });
    }
    for (auto& t : threads)
      t.join();
    if (timed_out != 4) return 1;
    // One after another they take 4 s at least; together, 1 s and what the machine adds.
    return std::chrono::steady_clock::now() - start < 3 * o.lock_timeout ? 0 : 2;
  });
  test::killed_on_failure guard{child};
  s.reset();
  zero_index_state(path);  // a rebuild begun and not finished, which nobody finishes here
  go.notify();
  EXPECT_EQ(test::wait_exit(child), 0);
  guard.pid = 0;
}

// A fork while another thread maps a segment (holding the mutex that guards this process's
// map of segments) must not leave the child that mutex held: the child's first read of a
// segment its parent had not mapped would wait forever.
std::atomic<int> mapping_stage{0};  // 1: a mapper is in the hook; 2: it may go on

TEST(KvStore, AForkWhileASegmentIsBeingMappedLeavesTheChildAbleToRead) {
  temp_dir d;
  const std::string path = d.file("s");
  auto writer = open_ok(path);
  ASSERT_TRUE(writer);
  const std::string value(100'000, 'v');
  // k0's value fits in a std::string's own bytes: once the mapper lets the mutex go, it
  // allocates nothing more, so the fork cannot catch it inside malloc (GCC 12's
  // AddressSanitizer, unlike glibc, does not hold its allocator across fork, and a child
  // forked mid-malloc there hangs on its first allocation: no fault of keel's).
  ASSERT_TRUE(writer->put("k0", "small"));
  for (int i = 1; i < 30; ++i)
    ASSERT_TRUE(writer->put("k" + std::to_string(i), value));
  ASSERT_GE(writer->stats()->segments, 3u);
  // A second handle maps segments only as it reads them.
  auto reader = open_ok(path);
  ASSERT_TRUE(reader);
  mapping_stage = 0;
  segment_map_hook = []() noexcept {
    int expected = 0;
    if (!mapping_stage.compare_exchange_strong(expected, 1)) return;
    mapping_stage.notify_all();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  };
  std::atomic<bool> forked{false};
  std::thread mapper([&] {
    (void)reader->get("k0");
    // Alive until the fork is done (a thread that ended unjoined before it is a leak to
    // ThreadSanitizer in the child).
    while (!forked.load())
      forked.wait(false);
  });
  while (mapping_stage.load() != 1)
    mapping_stage.wait(0);
  const pid_t child = fork_child([&] {
    ::alarm(10);  // a child that waits forever is killed, and fails the test
    auto last = reader->get("k29");
    return last && *last == value ? 0 : 1;
  });
  forked = true;
  forked.notify_all();
  mapper.join();
  segment_map_hook = nullptr;
  EXPECT_EQ(wait_exit(child), 0) << "128 + 14: the child hung on the inherited mutex";
}

// For a store that holds a = 1: opened read-only, it reads it and refuses a change (0), or
// the number of the failed check.
int reads_it_read_only(const std::string& path) {
  options o = small();
  o.read_only = true;
  auto r = store::open(path, o);
  if (!r) return 12;
  auto a = (*r)->get("a");
  if (!a || *a != "1") return 13;
  return (*r)->put("b", "2") ? 14 : 0;
}

// A store on a filesystem mounted read-only: opening it to write, or making one there, is a
// clear error naming the store; a read-only open reads it (with an index of its own, see
// store_read_only_test.cpp); the store is whole once the filesystem is writable again.
TEST(KvStore, OnAReadOnlyFilesystemOpenIsAClearErrorAndLosesNothing) {
  temp_dir dir;
  const std::string mnt = dir.file("mnt");
  std::filesystem::create_directory(mnt);
  const pid_t child = fork_child([&] {
    if (!test::mount_private_tmpfs(mnt, std::size_t{64} << 20)) return test::cannot_set_up;
    const std::string path = mnt + "/s";
    {
      auto s = store::open(path, small());
      if (!s || !(*s)->put("a", "1")) return 2;
    }
    if (::mount(nullptr, mnt.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr) != 0) return 3;
    {
      auto s = store::open(path, small());
      if (s) return 4;
      if (s.error() != std::errc::read_only_file_system) return 5;
      if (s.error().message().find(path) == std::string::npos) return 6;
      if (const int r = reads_it_read_only(path); r != 0) return r;
    }
    auto made = store::open(mnt + "/new", small());
    if (made || made.error() != std::errc::read_only_file_system) return 7;
    if (::mount(nullptr, mnt.c_str(), nullptr, MS_REMOUNT, nullptr) != 0) return 8;
    auto s = store::open(path, small());
    if (!s) return 9;
    auto a = (*s)->get("a");
    if (!a || *a != "1") return 10;
    if (std::filesystem::exists(mnt + "/new")) return 11;
    return 0;
  });
  const int code = wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot mount a private tmpfs here";
  EXPECT_EQ(code, 0) << "see the child's numbered checks";
}

// A full filesystem: the put that finds no room fails with no_space naming the segment
// directory (where it could not make a segment and leave room for deletes), and every put
// before it is there after a reopen.
TEST(KvStore, AFullFilesystemIsNoSpaceNamingTheSegmentAndLosesNothing) {
  temp_dir dir;
  const std::string mnt = dir.file("mnt");
  std::filesystem::create_directory(mnt);
  const pid_t child = fork_child([&] {
    if (!test::mount_private_tmpfs(mnt, std::size_t{8} << 20)) return test::cannot_set_up;
    const std::string path = mnt + "/s";
    const std::string value(1000, 'v');
    int stored = 0;
    {
      auto s = store::open(path, small());
      if (!s) return 2;
      for (;; ++stored) {
        auto r = (*s)->put("k" + std::to_string(stored), value);
        if (r) continue;
        if (r.error() != std::errc::no_space_on_device) return 3;
        if (r.error().message().find(path + "/seg") == std::string::npos) return 4;
        break;
      }
    }
    if (stored < 1000) return 5;
    auto s = store::open(path, small());
    if (!s) return 6;
    for (int i = 0; i < stored; ++i) {
      auto v = (*s)->get("k" + std::to_string(i));
      if (!v || *v != value) return 7;
    }
    return 0;
  });
  const int code = wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot mount a private tmpfs here";
  EXPECT_EQ(code, 0) << "see the child's numbered checks";
}

// A user without the right to write the store's files gets permission denied naming the
// store when it opens it to write, reads it when it opens it read-only, and the store is
// unchanged. (As root, the child drops to nobody.)
TEST(KvStore, PermissionDeniedIsAClearErrorAndLosesNothing) {
  temp_dir dir;
  const std::string path = dir.file("s");
  std::filesystem::permissions(dir.path(), std::filesystem::perms::owner_all |
                                               std::filesystem::perms::group_exec |
                                               std::filesystem::perms::others_exec);
  {
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("a", "1"));
  }
  const bool root = ::geteuid() == 0;
  if (!root) {
    for (const auto& e : std::filesystem::recursive_directory_iterator(path))
      std::filesystem::permissions(e.path(), std::filesystem::perms::owner_write,
                                   std::filesystem::perm_options::remove);
    std::filesystem::permissions(path, std::filesystem::perms::owner_write,
                                 std::filesystem::perm_options::remove);
  }
  const pid_t child = fork_child([&] {
    if (root && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return test::cannot_set_up;
    auto s = store::open(path, small());
    if (s) return 2;
    if (s.error() != std::errc::permission_denied) return 3;
    if (s.error().message().find(path) == std::string::npos) return 4;
    return reads_it_read_only(path);
  });
  const int code = wait_exit(child);
  if (!root) {
    std::filesystem::permissions(path, std::filesystem::perms::owner_write,
                                 std::filesystem::perm_options::add);
    for (const auto& e : std::filesystem::recursive_directory_iterator(path))
      std::filesystem::permissions(e.path(), std::filesystem::perms::owner_write,
                                   std::filesystem::perm_options::add);
  }
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot drop privileges here";
  EXPECT_EQ(code, 0) << "see the child's numbered checks";
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  EXPECT_EQ(*s->get("a"), "1");
}

TEST(KvStore, AForeignDirectoryIsRefusedAndLeftAlone) {
  temp_dir dir;
  const std::string path = dir.file("foreign");
  std::filesystem::create_directory(path);
  {
    std::FILE* f = std::fopen((path + "/notes.txt").c_str(), "w");
    std::fputs("mine", f);
    std::fclose(f);
  }
  auto s = store::open(path, small());
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), errc::not_keel_file);
  EXPECT_FALSE(std::filesystem::exists(path + "/index"));
  EXPECT_FALSE(std::filesystem::exists(path + "/lock"));
  options o = small();
  o.create_if_missing = false;
  EXPECT_EQ(store::open(dir.file("absent"), o).error(), std::errc::no_such_file_or_directory);
}

// Names a store uses, taken by a user's files in a directory that is not a store: the store is
// refused, nothing is made there and nothing of the user's is touched. (A user's file `seg`
// once got a store made beside it; a user's directory `seg/` became a store's, and its
// `.seg.draft` was deleted.)
TEST(KvStore, AUsersFileNamedAsTheStoresOwnIsNeverTakenForOne) {
  for (const bool as_directory : {false, true}) {
    temp_dir dir;
    const std::string path = dir.file("mine");
    std::filesystem::create_directory(path);
    if (as_directory) {
      std::filesystem::create_directory(path + "/seg");
      std::ofstream(path + "/seg/.seg.draft") << "my draft";
    } else {
      std::ofstream(path + "/seg") << "my notes";
    }
    auto s = store::open(path, small());
    ASSERT_FALSE(s) << "a store was made in a user's directory";
    EXPECT_EQ(s.error(), errc::not_keel_file) << s.error().message();
    std::size_t entries = 0;
    for (const auto& e : std::filesystem::directory_iterator(path)) {
      EXPECT_EQ(e.path().filename(), "seg");
      ++entries;
    }
    EXPECT_EQ(entries, 1u) << "something was made beside the user's file";
    if (as_directory) {
      std::ifstream draft(path + "/seg/.seg.draft");
      std::string content;
      std::getline(draft, content);
      EXPECT_EQ(content, "my draft");
    }
  }
}

// Options that cannot work are refused before anything is made: a budget below what a store
// needs on an absent path (it once made the store, then refused), a negative lock timeout.
TEST(KvStore, BadOptionsAreRefusedBeforeAnythingIsMade) {
  temp_dir dir;
  const std::string path = dir.file("absent");
  options o = small();
  o.max_bytes = 4096;
  auto s = store::open(path, o);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), std::errc::invalid_argument) << s.error().message();
  EXPECT_FALSE(std::filesystem::exists(path)) << "made before it was refused";
  o = small();
  o.lock_timeout = std::chrono::milliseconds(-1);
  s = store::open(path, o);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), std::errc::invalid_argument) << s.error().message();
  EXPECT_FALSE(std::filesystem::exists(path)) << "made before it was refused";
  o = small();
  o.segment_size = 3 << 20;  // not a power of two
  s = store::open(path, o);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), std::errc::invalid_argument) << s.error().message();
  EXPECT_FALSE(std::filesystem::exists(path)) << "made before it was refused";
}

// A writer killed at each step of its commit: the others go on at once, and the commit is
// all there (its block was complete) or not at all.
class KvStoreKilledAt : public ::testing::TestWithParam<commit_step> {};

TEST_P(KvStoreKilledAt, TheCommitIsWholeOrAbsentAndNobodyWaitsForIt) {
  temp_dir dir;
  const std::string path = dir.file("s");
  // Nobody waits for it: not for a lock's timeout, long here, so that a survivor that did
  // stands out from one slowed by a busy machine (half of it is the bound below).
  options o = small();
  o.lock_timeout = std::chrono::seconds(120);
  const auto bound = std::chrono::seconds(60);
  auto s = open_ok(path, o);  // open throughout: the survivors settle, not a lone reopener
  ASSERT_TRUE(s);
  for (const char* k : {"a", "b", "c"})
    ASSERT_TRUE(s->put(k, "0"));
  const commit_step at = GetParam();
  const pid_t victim = fork_child([&] {
    auto mine = store::open(path, o);
    if (!mine) return 2;
    test_support::die_at(at);
    auto t = (*mine)->begin();
    if (!t || !t->get("c") || !t->put("a", "1") || !t->put("b", "1")) return 3;
    (void)t->commit();
    return 4;  // not killed: the step was not reached
  });
  const int status = test::wait_status(victim);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  const bool happened = at >= commit_step::written;
  const auto start = std::chrono::steady_clock::now();
  // Another writer of the same keys.
  for (;;) {
    auto t = s->begin();
    ASSERT_TRUE(t);
    auto a = t->get("a");
    auto b = t->get("b");
    ASSERT_TRUE(a && b);
    EXPECT_EQ(*a, *b) << "half a commit is visible";
    ASSERT_TRUE(t->put("a", *a + "+"));
    ASSERT_TRUE(t->put("b", *b + "+"));
    ASSERT_TRUE(t->put("c", "1"));
    auto r = t->commit();
    if (r) break;
    ASSERT_EQ(r.error(), errc::conflict) << r.error().message();
    ASSERT_LT(std::chrono::steady_clock::now() - start, bound);
  }
  const std::string want = happened ? "1+" : "0+";
  EXPECT_EQ(*s->get("a"), want);
  EXPECT_EQ(*s->get("b"), want);
  // And after every user is gone, the next opener finds the same.
  s.reset();
  auto again = open_ok(path);
  ASSERT_TRUE(again);
  EXPECT_EQ(*again->get("a"), want);
  EXPECT_EQ(*again->get("b"), want);
  again.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path);
  ASSERT_TRUE(rebuilt);
  EXPECT_EQ(*rebuilt->get("a"), want);
  EXPECT_EQ(*rebuilt->get("b"), want);
}

INSTANTIATE_TEST_SUITE_P(EachStep, KvStoreKilledAt,
                         ::testing::Values(commit_step::charging, commit_step::charged,
                                           commit_step::locked, commit_step::reserved,
                                           commit_step::marked, commit_step::took_seq,
                                           commit_step::recorded, commit_step::written,
                                           commit_step::published_one, commit_step::published,
                                           commit_step::visible, commit_step::leaving),
                         [](const auto& p) { return std::to_string(static_cast<int>(p.param)); });

// The wait status of a writer of the store at `path`, forked to put "a" = "1" and killed
// (SIGKILL) at step `at` of that commit.
int put_killed_at(const std::string& path, commit_step at) {
  const pid_t victim = fork_child([&] {
    auto mine = store::open(path, small());
    if (!mine) return 2;
    test_support::die_at(at);
    (void)(*mine)->put("a", "1");
    return 4;
  });
  return test::wait_status(victim);
}

// Waiters take turns to look whether the writer in front died (a hint in the index header,
// header::dead_check_ns). Whatever the hint says, a look comes: a time just now delays it by
// at most 2 ms, and a time ahead of this clock (another boot's) is no one's turn.
TEST(KvStoreKilled, ADeadWritersCommitIsSettledWhateverTheLookHintSays) {
  const auto now_ns = [] {
    return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                          std::chrono::steady_clock::now().time_since_epoch())
                                          .count());
  };
  // A look that never came would leave the put to wait out the lock's timeout: long here, so
  // that it stands out from a put slowed by a busy machine (half of it is the bound below).
  options o = small();
  o.lock_timeout = std::chrono::seconds(120);
  for (const bool ahead : {false, true}) {
    temp_dir dir;
    const std::string path = dir.file("s");
    auto s = open_ok(path, o);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->put("a", "0"));
    const int status = put_killed_at(path, commit_step::took_seq);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
    const int fd = ::open((path + "/index").c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    const std::uint64_t hint = ahead ? now_ns() + (std::uint64_t{1} << 62) : now_ns();
    ASSERT_EQ(::pwrite(fd, &hint, sizeof hint, header::dead_check_ns), 8);
    ::close(fd);
    const auto start = std::chrono::steady_clock::now();
    ASSERT_TRUE(s->put("a", "2"));
    EXPECT_LT(std::chrono::steady_clock::now() - start, o.lock_timeout / 2)
        << (ahead ? "a hint from the future" : "a hint of just now");
    EXPECT_EQ(*s->get("a"), "2");
  }
}

// Writers killed where their slots used to stay taken for as long as anybody had the store
// open (reserved, marked, after their commit was visible): more victims than there are
// slots, and new users still get one. (Those killed holding a seq are freed by the settler;
// KvStoreKilledAt covers them.)
TEST(KvStoreKilled, DeadWritersSlotsAreReclaimedWhileTheStoreStaysOpen) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);  // open throughout: no lone opener clears the slots
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("a", "0"));
  static constexpr std::array steps{commit_step::reserved, commit_step::marked,
                                    commit_step::visible};
  const int victims = static_cast<int>(max_slots) + 32;
  for (int i = 0; i < victims; ++i) {
    const pid_t victim = fork_child([&] {
      auto mine = store::open(path, small());
      if (!mine) return 2;
      test_support::die_at(steps[static_cast<std::size_t>(i) % steps.size()]);
      auto r = (*mine)->put("k" + std::to_string(i), "v");
      return r ? 4 : r.error() == errc::too_many_users ? 5 : 3;
    });
    const int status = test::wait_status(victim);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "victim " << i << ": status " << status << " (exit 5: no slot left)";
  }
  // A new process, and new threads here, still get slots and commit.
  const pid_t late = fork_child([&] {
    auto mine = store::open(path, small());
    return mine && (*mine)->put("late", "1") ? 0 : 1;
  });
  EXPECT_EQ(test::wait_exit(late), 0);
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      if (s->put("t" + std::to_string(t), "1")) ++ok;
    });
  }
  for (auto& t : threads)
    t.join();
  EXPECT_EQ(ok.load(), 4);
  EXPECT_TRUE(s->get("late"));
  EXPECT_EQ(*s->get("a"), "0");
}

// A splitter killed after switching the first of the directory entries that named the page
// it split: the others must finish that split before they change its pages, or an update
// made through one half is lost when the old page is split again.
TEST(KvStoreKilled, ASplitHalfDoneIsFinishedAndLosesNoUpdate) {
  const test_support::one_page_index one;
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);  // open throughout: a survivor finishes it, not a lone reopener
  ASSERT_TRUE(s);
  const auto key = [](const char* p, int i) { return p + std::to_string(i); };
  for (int i = 0; i < 100; ++i)
    ASSERT_TRUE(s->put(key("k", i), "v1"));
  const pid_t victim = fork_child([&] {
    auto mine = store::open(path, small());
    if (!mine) return 2;
    index::split_hook = []() noexcept { ::raise(SIGKILL); };
    for (int i = 100; i < 200; ++i) {
      if (!(*mine)->put(key("k", i), "v1")) return 3;
    }
    return 4;  // not killed: no split
  });
  const int status = test::wait_status(victim);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  // The one page held 126 keys when the 127th came: k0-k125 were acknowledged.
  for (int i = 0; i < 126; ++i)
    ASSERT_TRUE(s->put(key("k", i), "v2")) << i;
  for (int i = 0; i < 1000; ++i)
    ASSERT_TRUE(s->put(key("n", i), "n")) << i;  // splits again, the old page's range too
  const auto check = [&](store& st, const char* when) {
    for (int i = 0; i < 126; ++i) {
      auto v = st.get(key("k", i));
      ASSERT_TRUE(v) << when << ": k" << i << ": " << v.error().message();
      EXPECT_EQ(*v, "v2") << when << ": k" << i;
    }
    for (int i = 0; i < 1000; ++i)
      EXPECT_TRUE(st.get(key("n", i))) << when << ": n" << i;
    auto st_stats = st.stats();
    ASSERT_TRUE(st_stats);
    EXPECT_EQ(st_stats->records, 1126u) << when;
  };
  check(*s, "while open");
  s.reset();
  auto again = open_ok(path);
  ASSERT_TRUE(again);
  check(*again, "reopened");
  again.reset();
  std::filesystem::remove(path + "/index");
  auto rebuilt = open_ok(path);
  ASSERT_TRUE(rebuilt);
  check(*rebuilt, "rebuilt");
}

// Alone, the next opener finishes a split its dead splitter left.
TEST(KvStoreKilled, ALoneOpenerFinishesAHalfDoneSplit) {
  const test_support::one_page_index one;
  temp_dir dir;
  const std::string path = dir.file("s");
  const auto key = [](int i) { return "k" + std::to_string(i); };
  const pid_t victim = fork_child([&] {
    auto mine = store::open(path, small());
    if (!mine) return 2;
    index::split_hook = []() noexcept { ::raise(SIGKILL); };
    for (int i = 0; i < 200; ++i) {
      if (!(*mine)->put(key(i), "v1")) return 3;
    }
    return 4;
  });
  const int status = test::wait_status(victim);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  for (int i = 0; i < 126; ++i)
    ASSERT_TRUE(s->put(key(i), "v2")) << i;
  for (int i = 126; i < 1000; ++i)
    ASSERT_TRUE(s->put(key(i), "v3")) << i;
  for (int i = 0; i < 1000; ++i) {
    auto v = s->get(key(i));
    ASSERT_TRUE(v) << i;
    EXPECT_EQ(*v, i < 126 ? "v2" : "v3") << i;
  }
}

TEST(KvStoreKilled, AReaderSeesADeadWritersCompleteCommitOnlyOnceItIsSettled) {
  temp_dir dir;
  const std::string path = dir.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->put("a", "0"));
  auto before = s->begin();  // a snapshot from before the dead commit
  ASSERT_TRUE(before);
  (void)put_killed_at(path, commit_step::written);
  EXPECT_EQ(*before->get("a"), "0");
  ASSERT_TRUE(s->put("z", "z"));  // settles the dead commit on its way to visible
  EXPECT_EQ(*s->get("a"), "1");
  EXPECT_EQ(*before->get("a"), "0") << "an older snapshot still reads its own version";
}

}  // namespace
}  // namespace keel::kv
