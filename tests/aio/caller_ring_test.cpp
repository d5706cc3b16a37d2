// keel::aio: requests started by the thread that submits them (options::submit_on). On
// io_uring they go on the thread's own ring, which it submits to and reaps itself; what it
// leaves there (it computes, sleeps, waits with a deadline, or exits) a worker reaps, so
// every request still ends, and ends once. On posix a request runs inside the call that
// submits it.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <latch>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "aio_support.hpp"
#include "keel/aio/controller.hpp"
#include "keel/aio/errors.hpp"
#include "keel/io/filesystem.hpp"
#include "support/process.hpp"

namespace keel::aio {
namespace {

using namespace std::chrono_literals;
using test::temp_dir;
using test_support::open_rw;

// A controller on io_uring whose threads start requests as `who` says (with a write-back
// cache of 64 MiB if `cached`), or null (with the reason in `why`) where io_uring cannot
// start or KEEL_AIO_ENGINE forces another engine.
std::unique_ptr<controller> on_uring(submitter who, std::string& why, bool cached = false) {
  if (const char* env = std::getenv("KEEL_AIO_ENGINE");
      env != nullptr && *env != '\0' && std::string_view(env) != "io_uring") {
    why = std::string("KEEL_AIO_ENGINE=") + env + " forces every controller's engine";
    return nullptr;
  }
  if (const char* env = std::getenv("KEEL_AIO_SUBMIT_ON"); env != nullptr && *env != '\0') {
    why = std::string("KEEL_AIO_SUBMIT_ON=") + env + " forces where requests start";
    return nullptr;
  }
  options o;
  o.engine = engine_kind::io_uring;
  o.submit_on = who;
  if (cached) {
    o.cache_soft_limit = o.cache_hard_limit = std::size_t{64} << 20;
    o.cache_idle_round = std::chrono::seconds(60);
  }
  auto c = controller::start(o);
  if (!c) {
    why = "io_uring cannot start here: " + c.error().message();
    return nullptr;
  }
  return std::move(*c);
}

#define KEEL_ON_URING(c, who)        \
  std::string why_not;               \
  auto c = on_uring(who, why_not);   \
  do {                               \
    if (!c) GTEST_SKIP() << why_not; \
  } while (false)

// Requests go on the thread's ring (counted), and every byte lands where it should.
TEST(AioCallerRings, RequestsStartOnTheSubmittingThreadsRing) {
  KEEL_ON_URING(c, submitter::caller);
  temp_dir dir;
  file f = open_rw(*c, dir.file("own"));
  std::vector<std::byte> data(64 * 1024);
  for (std::size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<std::byte>(i * 13 + 1);
  ASSERT_EQ(f.write(0, data).wait().value_or(0), data.size());
  ASSERT_TRUE(f.fsync().wait());
  std::vector<std::byte> back(data.size());
  ASSERT_EQ(f.read(0, back).wait().value_or(0), back.size());
  EXPECT_EQ(back, data);
  // Past the end: what is there.
  std::vector<std::byte> tail(8192);
  EXPECT_EQ(f.read(data.size() - 100, tail).wait().value_or(0), 100u);
  // A buffered write the kernel would hand to a thread of its own (ext4, tmpfs) the thread
  // writes itself instead of on its ring: either way, on the submitting thread.
  const engine_stats st = c->engine_counts();
  EXPECT_GE(st.requests_on_caller_rings, 3u);
  EXPECT_GE(st.requests_on_caller_rings + st.buffered_writes_by_threads, 4u);
  // (A worker may still reap some: a caller ring's completions wake its worker, which takes
  // them when it gets the ring before the thread comes back to wait. It was asserted none
  // did, "the thread was always there", and a busy machine made it 1, under TSan.)
  EXPECT_LE(st.caller_requests_reaped_by_workers, st.requests_on_caller_rings);
}

// A cached file's writes that the cache steps aside for (nothing comes back to them) start
// on the thread's ring like any other file's; its fsync still meets the cache in a worker,
// which writes the cached bytes out first.
TEST(AioCallerRings, WritesTheCacheStepsAsideForStartOnTheRing) {
  std::string why_not;
  auto c = on_uring(submitter::caller, why_not, true);
  if (!c) GTEST_SKIP() << why_not;
  temp_dir dir;
  open_options how;
  how.write = true;
  how.create = true;
  how.cache = true;
  auto f = c->open(dir.file("cached"), how);
  ASSERT_TRUE(f) << f.error().message();
  constexpr std::size_t each = 16384;
  std::vector<std::byte> data(320 * each);
  for (std::size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<std::byte>(i * 7 + i / 4096);
  for (std::size_t i = 0; i < 320; ++i) {
    ASSERT_EQ(f->write(i * each, std::span(data).subspan(i * each, each)).wait().value_or(0), each);
  }
  EXPECT_EQ(c->cache().writes_cached, 32u);  // the first window's, before the verdict
  EXPECT_EQ(c->cache().writes_bypassed, 288u);
  // On the thread's ring, or written by the thread itself (see
  // AioBufferedWrites.WritesTheKernelWouldHandOffAreWrittenByKeelsThreads).
  const auto on_the_thread = [&] {
    const engine_stats st = c->engine_counts();
    return st.requests_on_caller_rings + st.buffered_writes_by_threads;
  };
  EXPECT_EQ(on_the_thread(), 288u);
  ASSERT_TRUE(f->fsync().wait());
  EXPECT_EQ(on_the_thread(), 288u) << "the fsync went to a worker";
  ASSERT_TRUE(f->close());
  std::vector<std::byte> back(data.size());
  const int fd = ::open(dir.file("cached").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::pread(fd, back.data(), back.size(), 0), static_cast<ssize_t>(back.size()));
  ::close(fd);
  EXPECT_EQ(back, data);
}

// A thread that submits and then sleeps (on something else) leaves its completion on its
// ring: a worker reaps it, and another thread's wait ends.
TEST(AioCallerRings, ACompletionTheThreadLeavesIsReapedByAWorker) {
  KEEL_ON_URING(c, submitter::caller);
  temp_dir dir;
  file f = open_rw(*c, dir.file("left"));
  std::latch submitted(1);
  std::latch go_on(1);
  receipt r;
  std::thread t([&] {
    r = f.fsync();  // io_uring runs an fsync in its own threads: it ends later
    submitted.count_down();
    go_on.wait();  // asleep, not in keel
  });
  submitted.wait();
  auto done = r.wait(20s);
  go_on.count_down();
  t.join();
  ASSERT_TRUE(done) << done.error().message();
  const engine_stats st = c->engine_counts();
  EXPECT_EQ(st.requests_on_caller_rings, 1u);
  EXPECT_EQ(st.caller_requests_reaped_by_workers, 1u);
}

// A thread that exits with requests running on its ring: they end (the kernel would cancel
// them with the thread; keel waits for them first), each exactly once.
TEST(AioCallerRings, AThreadThatExitsLetsItsRequestsEnd) {
  KEEL_ON_URING(c, submitter::caller);
  temp_dir dir;
  file f = open_rw(*c, dir.file("exit"));
  std::vector<std::byte> buf(4096, std::byte{7});
  std::atomic<int> completions{0};
  std::vector<receipt> rs(64);
  std::thread t([&] {
    for (std::size_t i = 0; i < rs.size(); ++i) {
      rs[i] = i % 8 == 7
                  ? f.fsync([&](const result<std::size_t>&) { ++completions; })
                  : f.write(i * 4096, buf, [&](const result<std::size_t>&) { ++completions; });
    }
  });
  t.join();
  for (auto& r : rs) {
    auto n = r.wait(20s);
    ASSERT_TRUE(n) << n.error().message();
  }
  EXPECT_EQ(completions.load(), 64);
  EXPECT_GE(c->engine_counts().requests_on_caller_rings, 8u);
}

// A completion that submits and waits on the same thread (inside the reaping of its ring;
// on another file: a request that must follow the one completing waits for its end).
TEST(AioCallerRings, ACompletionMaySubmitAndWaitOnItsThread) {
  KEEL_ON_URING(c, submitter::caller);
  temp_dir dir;
  file f = open_rw(*c, dir.file("nested"));
  file g = open_rw(*c, dir.file("other"));
  std::vector<std::byte> buf(4096, std::byte{3});
  std::vector<std::byte> back(4096);
  ASSERT_EQ(g.write(0, buf).wait().value_or(0), 4096u);
  std::atomic<std::size_t> inner{0};
  auto outer = f.write(0, buf, [&](const result<std::size_t>& n) {
    if (n) inner = g.read(0, back).wait().value_or(0);
  });
  ASSERT_EQ(outer.wait().value_or(0), 4096u);
  EXPECT_EQ(inner.load(), 4096u);
  EXPECT_EQ(back, buf);
}

// A chain of completions, each submitting the next request from the one before's callback:
// neither the ring nor the inline posix path recurses a level per request (20 000 levels
// overflowed the stack), and every request of the chain ends.
TEST(AioCallerRings, AChainOfCompletionsDoesNotRecurse) {
  if (const char* env = std::getenv("KEEL_AIO_ENGINE"); env != nullptr && *env != '\0') {
    GTEST_SKIP() << "KEEL_AIO_ENGINE=" << env << " forces every controller's engine";
  }
  temp_dir dir;
  for (const auto e : {engine_kind::io_uring, engine_kind::posix}) {
    options o;
    o.engine = e;
    o.submit_on = submitter::caller;
    auto started = controller::start(o);
    if (!started) continue;  // io_uring forbidden here: posix still runs
    auto& c = *started;
    file f = open_rw(*c, dir.file(std::string("chain-") + std::string(to_string(e))));
    std::vector<std::byte> buf(512, std::byte{9});
    ASSERT_EQ(f.write(0, buf).wait().value_or(0), 512u);
    constexpr int links = 20000;
    std::atomic<int> done{0};
    std::vector<std::byte> back(512);
    std::function<void(const result<std::size_t>&)> next;
    next = [&](const result<std::size_t>& n) {
      if (!n || *n != 512) return;
      if (done.fetch_add(1) + 1 < links) (void)f.read(0, back, next);
    };
    (void)f.read(0, back, next);
    const auto until = std::chrono::steady_clock::now() + 60s;
    while (done.load() < links && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(1ms);
    EXPECT_EQ(done.load(), links) << to_string(e);
    c->stop();
  }
}

// A thread that registered a file on its ring exits; the file is closed when close returns
// (a flock on it is free), not when the kernel gets round to tearing the ring down.
TEST(AioCallerRings, CloseAfterTheRingsThreadExitedReallyCloses) {
  KEEL_ON_URING(c, submitter::caller);
  temp_dir dir;
  const std::string path = dir.file("exited");
  file f = open_rw(*c, path);
  std::thread t([&] {  // a read: a buffered write may not go on the ring (ext4, tmpfs)
    std::byte one{1};
    (void)f.read(0, std::span(&one, 1)).wait();
  });
  t.join();
  ASSERT_GE(c->engine_counts().requests_on_registered_files, 1u);
  const int mine = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(mine, 0);
  ::close(mine);
  // keel's own descriptor: take a lock on it, then close the file.
  const int keel_fd = test_support::descriptor_of(path);
  ASSERT_GE(keel_fd, 0);
  ASSERT_EQ(::flock(keel_fd, LOCK_EX | LOCK_NB), 0);
  ASSERT_TRUE(f.close());
  const int other = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(other, 0);
  EXPECT_EQ(::flock(other, LOCK_EX | LOCK_NB), 0) << "the lock outlived close: " << errno;
  ::close(other);
}

// Stopping while a thread's ring has requests running: they end, and stop returns.
TEST(AioCallerRings, StopWaitsForTheRequestsOnThreadsRings) {
  KEEL_ON_URING(c, submitter::caller);
  temp_dir dir;
  file f = open_rw(*c, dir.file("stop"));
  std::vector<std::byte> buf(4096);
  std::vector<receipt> rs;
  for (int i = 0; i < 16; ++i) {
    rs.push_back(f.write(static_cast<std::uint64_t>(i) * 4096, buf));
    rs.push_back(f.fsync());
  }
  c->stop();
  for (auto& r : rs) {
    ASSERT_TRUE(r.ready());
    EXPECT_NE(r.state(), status::pending);
  }
}

// Many threads on their rings at once, each checking its own bytes (the model test of
// controller_test.cpp runs every engine; this one the rings with threads coming and going).
TEST(AioCallerRings, ThreadsComeAndGoEachSeesItsOwnWrites) {
  KEEL_ON_URING(c, submitter::caller);
  temp_dir dir;
  file f = open_rw(*c, dir.file("many"));
  std::atomic<int> bad{0};
  for (int round = 0; round < 5; ++round) {
    std::vector<std::thread> ts;
    for (int t = 0; t < 8; ++t) {
      ts.emplace_back([&, t, round] {
        const std::uint64_t base = static_cast<std::uint64_t>(t) * 65536;
        std::vector<std::byte> buf(4096);
        std::vector<std::byte> back(4096);
        for (int i = 0; i < 16; ++i) {
          std::memset(buf.data(), round * 16 + i, buf.size());
          const std::uint64_t at = base + static_cast<std::uint64_t>(i) * 4096;
          auto w = f.write(at, buf);
          auto r = f.read(at, back);  // must see the write (same thread, same range)
          if (r.wait().value_or(0) != 4096 || back != buf || w.wait().value_or(0) != 4096) {
            ++bad;
          }
        }
      });
    }
    for (auto& th : ts)
      th.join();
  }
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GE(c->engine_counts().requests_on_caller_rings, 5u * 8 * 16);
}

// submitter::adaptive: a thread that only submits and waits comes to start its requests
// itself; one that computes between its requests (and waits for them at the end) keeps
// handing them to the workers.
TEST(AioCallerRings, AdaptiveFollowsWhatTheThreadDoes) {
  KEEL_ON_URING(c, submitter::adaptive);
  temp_dir dir;
  file f = open_rw(*c, dir.file("adaptive"));
  std::vector<std::byte> buf(4096, std::byte{1});
  ASSERT_EQ(f.write(0, buf).wait().value_or(0), 4096u);
  std::thread computing([&] {
    std::vector<receipt> rs;
    for (std::uint64_t i = 0; i < 100; ++i) {
      const auto until = std::chrono::steady_clock::now() + 200us;
      while (std::chrono::steady_clock::now() < until) {
      }
      rs.push_back(f.write(4096 * (i + 1), buf));
    }
    for (auto& r : rs)
      (void)r.wait();
  });
  computing.join();
  EXPECT_EQ(c->engine_counts().requests_on_caller_rings, 0u);
  std::thread waiting([&] {
    std::vector<std::byte> back(4096);
    for (int i = 0; i < 400; ++i)
      (void)f.read(0, back).wait();
  });
  waiting.join();
  EXPECT_GT(c->engine_counts().requests_on_caller_rings, 100u);
}

// The OS's filesystem, counting the reads that run on one thread.
class reads_on_thread final : public io::filesystem_wrapper {
 public:
  explicit reads_on_thread(std::thread::id t) noexcept : filesystem_wrapper(io::os()), on_(t) {}
  result<std::size_t> read(const io::file_handle& file, off_t offset,
                           std::span<const iovec> buffers) noexcept override {
    if (std::this_thread::get_id() == on_) ++count;
    return filesystem_wrapper::read(file, offset, buffers);
  }
  std::atomic<int> count{0};

 private:
  std::thread::id on_;
};

// posix: a thread that submits one read at a time and waits runs them itself, inside the
// call that submits them: always with submitter::caller, and with adaptive once the
// thread is seen to do nothing else.
TEST(AioPosixOnTheCaller, AThreadThatSubmitsAndWaitsRunsItsReads) {
  if (const char* env = std::getenv("KEEL_AIO_SUBMIT_ON"); env != nullptr && *env != '\0') {
    GTEST_SKIP() << "KEEL_AIO_SUBMIT_ON=" << env << " forces where requests start";
  }
  temp_dir dir;
  const auto reads_here = [&](submitter who) {
    reads_on_thread fs(std::this_thread::get_id());
    options o;
    o.fs = &fs;
    o.engine = engine_kind::posix;
    o.submit_on = who;
    auto c = controller::start(o);
    EXPECT_TRUE(c) << c.error().message();
    if (!c) return -1;
    file f = open_rw(**c, dir.file("posix"));
    std::vector<std::byte> buf(4096, std::byte{5});
    EXPECT_EQ(f.write(0, buf).wait().value_or(0), 4096u);
    std::vector<std::byte> back(4096);
    int ended_at_once = 0;
    int whole = 0;
    for (int i = 0; i < 200; ++i) {  // nothing else in the loop: the thread only waits
      auto r = f.read(0, back);
      ended_at_once += r.state() == status::done ? 1 : 0;
      whole += r.wait().value_or(0) == 4096 ? 1 : 0;
    }
    EXPECT_EQ(whole, 200);
    EXPECT_EQ(back, buf);
    if (who == submitter::caller) {
      EXPECT_EQ(ended_at_once, 200);
    }
    return fs.count.load();
  };
  EXPECT_EQ(reads_here(submitter::caller), 200);
  // Judged every 32 timed calls, from a clock a sanitizer slows unevenly: most of them.
  EXPECT_GE(reads_here(submitter::adaptive), 100);
}

// On posix too: a cached file's write the cache steps aside for runs inside the call that
// submits it, as any other file's would.
TEST(AioPosixOnTheCaller, WritesTheCacheStepsAsideForRunInTheCall) {
  if (const char* env = std::getenv("KEEL_AIO_SUBMIT_ON"); env != nullptr && *env != '\0') {
    GTEST_SKIP() << "KEEL_AIO_SUBMIT_ON=" << env << " forces where requests start";
  }
  options o;
  o.engine = engine_kind::posix;
  o.submit_on = submitter::caller;
  o.cache_soft_limit = o.cache_hard_limit = std::size_t{64} << 20;
  o.cache_idle_round = std::chrono::seconds(60);
  auto c = controller::start(o);
  ASSERT_TRUE(c) << c.error().message();
  temp_dir dir;
  open_options how;
  how.write = true;
  how.create = true;
  how.cache = true;
  auto f = (*c)->open(dir.file("cached"), how);
  ASSERT_TRUE(f) << f.error().message();
  std::vector<std::byte> data(16384, std::byte{3});
  int ended_at_once = 0;
  for (std::size_t i = 0; i < 320; ++i) {
    auto r = f->write(i * data.size(), data);
    ended_at_once += r.state() == status::done ? 1 : 0;
    ASSERT_EQ(r.wait().value_or(0), data.size());
  }
  EXPECT_EQ((*c)->cache().writes_bypassed, 288u);
  EXPECT_EQ(ended_at_once, 320) << "cached writes end in the call, and so do those passed on";
  ASSERT_TRUE(f->close());
  EXPECT_EQ(std::filesystem::file_size(dir.file("cached")), 320u * data.size());
}

// options::reader_descriptions: a thread that keeps reading a file one request at a time
// on its own reads through an open file description of its own after its 64th read.

// How many descriptors this process has open on `path`.
int descriptors_on(const std::string& path) {
  return static_cast<int>(test_support::descriptors_on(path).size());
}

// A posix controller whose threads run their requests themselves, with at most `readers`
// descriptions of threads' own; null (a skip's reason in `why`) where the environment says
// where requests start.
std::unique_ptr<controller> posix_on_caller(unsigned readers, std::string& why) {
  if (const char* env = std::getenv("KEEL_AIO_SUBMIT_ON"); env != nullptr && *env != '\0') {
    why = std::string("KEEL_AIO_SUBMIT_ON=") + env + " forces where requests start";
    return nullptr;
  }
  options o;
  o.engine = engine_kind::posix;
  o.submit_on = submitter::caller;
  o.reader_descriptions = readers;
  auto c = controller::start(o);
  EXPECT_TRUE(c) << c.error().message();
  return c ? std::move(*c) : nullptr;
}

// `n` reads of the first block of `f` on this thread: how many came back whole and equal to
// `expect`.
int reads_equal(file& f, const std::vector<std::byte>& expect, int n) {
  std::vector<std::byte> back(expect.size());
  int good = 0;
  for (int i = 0; i < n; ++i) {
    std::fill(back.begin(), back.end(), std::byte{0});
    good += f.read(0, back).wait().value_or(0) == expect.size() && back == expect ? 1 : 0;
  }
  return good;
}

// A file of one block of 7s, open on posix_on_caller(readers); `c` null (the reason in `why`)
// where the test cannot run.
struct one_block {
  temp_dir dir;
  std::string path = dir.file("read");
  std::vector<std::byte> data = std::vector<std::byte>(4096, std::byte{7});
  std::string why;
  std::unique_ptr<controller> c;
  file f;

  explicit one_block(unsigned readers) : c(posix_on_caller(readers, why)) {
    if (!c) return;
    f = open_rw(*c, path);
    EXPECT_EQ(f.write(0, data).wait().value_or(0), data.size());
  }
};

TEST(AioPosixOnTheCaller, AThreadThatKeepsReadingGetsADescriptionOfItsOwn) {
  one_block b(32);
  if (!b.c) GTEST_SKIP() << b.why;
  auto [f, data, path] = std::tie(b.f, b.data, b.path);
  EXPECT_EQ(descriptors_on(path), 1);
  EXPECT_EQ(reads_equal(f, data, 63), 63);
  EXPECT_EQ(descriptors_on(path), 1) << "a thread that reads now and then shares the file's";
  EXPECT_EQ(reads_equal(f, data, 100), 100);
  EXPECT_EQ(descriptors_on(path), 2);
  // Writes still go through the file's descriptor, and its own reads see them.
  const std::vector<std::byte> later(4096, std::byte{9});
  ASSERT_EQ(f.write(0, later).wait().value_or(0), later.size());
  EXPECT_EQ(reads_equal(f, later, 10), 10);
  std::thread([&] { EXPECT_EQ(reads_equal(f, later, 100), 100); }).join();
  EXPECT_EQ(descriptors_on(path), 3) << "one per thread, kept after the thread is gone";
  ASSERT_TRUE(f.close());
  EXPECT_EQ(descriptors_on(path), 0) << "they close with the file";
}

// Its own description is of the file open, not of what the name says now: a file renamed
// over the name, or the name removed, changes nothing it reads.
TEST(AioPosixOnTheCaller, AThreadsOwnDescriptionIsOfTheOpenFileNotOfItsName) {
  one_block b(32);
  if (!b.c) GTEST_SKIP() << b.why;
  auto [f, data, path] = std::tie(b.f, b.data, b.path);
  {
    const std::string other = b.dir.file("other");
    std::FILE* o = std::fopen(other.c_str(), "w");
    ASSERT_NE(o, nullptr);
    const std::vector<char> foreign(4096, 'x');
    ASSERT_EQ(std::fwrite(foreign.data(), 1, foreign.size(), o), foreign.size());
    ASSERT_EQ(std::fclose(o), 0);
    std::filesystem::rename(other, path);
  }
  EXPECT_EQ(reads_equal(f, data, 200), 200);
  std::filesystem::remove(path);
  std::thread([&] { EXPECT_EQ(reads_equal(f, data, 200), 200); }).join();
  ASSERT_TRUE(f.close());
}

TEST(AioPosixOnTheCaller, DescriptionsOfThreadsOwnAreCappedPerController) {
  for (const unsigned cap : {0u, 1u}) {
    one_block b(cap);
    if (!b.c) GTEST_SKIP() << b.why;
    auto [f, data, path] = std::tie(b.f, b.data, b.path);
    std::vector<std::thread> readers;
    for (int t = 0; t < 3; ++t)
      readers.emplace_back([&] { EXPECT_EQ(reads_equal(f, data, 100), 100); });
    for (auto& t : readers)
      t.join();
    EXPECT_EQ(descriptors_on(path), 1 + static_cast<int>(cap)) << "cap " << cap;
    ASSERT_TRUE(f.close());
  }
}

// A child of fork() has its threads' states afresh: it reads through descriptions of its
// own making, and the parent's keep working.
TEST(AioPosixOnTheCaller, AForkedChildLeavesTheParentsDescriptionsAlone) {
  one_block b(32);
  if (!b.c) GTEST_SKIP() << b.why;
  auto [f, data, path] = std::tie(b.f, b.data, b.path);
  ASSERT_EQ(reads_equal(f, data, 100), 100);
  ASSERT_EQ(descriptors_on(path), 2);
  const pid_t child = test::fork_child([&] {
    // The controller is the parent's: refused here, and dropping it closes nothing.
    std::vector<std::byte> back(data.size());
    const auto r = f.read(0, back).wait();
    if (r || r.error() != keel::errc::inherited_across_fork) return 1;
    if (f.close()) return 2;
    return descriptors_on(path) == 2 ? 0 : 3;
  });
  EXPECT_EQ(test::wait_exit(child), 0);
  EXPECT_EQ(reads_equal(f, data, 100), 100);
  ASSERT_TRUE(f.close());
}

// A receipt outlives its file and its controller: a wait after both are gone (for requests
// that ended within their submissions) gives what the requests did.
TEST(AioPosixOnTheCaller, AReceiptOutlivesItsFileAndController) {
  one_block b(32);
  if (!b.c) GTEST_SKIP() << b.why;
  auto [f, data, path] = std::tie(b.f, b.data, b.path);
  std::vector<std::byte> back(4096);
  receipt r = f.read(0, back);
  receipt w = f.write(4096, data);
  ASSERT_TRUE(f.close());
  b.c.reset();
  EXPECT_EQ(r.state(), status::done);
  EXPECT_EQ(r.wait().value_or(0), 4096u);
  EXPECT_EQ(w.wait().value_or(0), 4096u);
  EXPECT_EQ(back, data);
}

// Buffered writes to a file whose filesystem cannot take one without blocking (the kernel
// would hand each to an io-wq thread) are written by a thread of keel's, or by the thread
// that submits them: on tmpfs here; on xfs they go to the ring. Either way every byte lands.

// What the kernel says of a write that must not block into a new file in `dir`: whether it
// refuses it (EOPNOTSUPP), as io_uring then hands buffered writes to a thread of its own.
bool refuses_nowait_writes(const std::string& dir) {
  const std::string probe = dir + "/probe";
  const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  char b[4096] = {};
  iovec v{b, sizeof b};
  const bool refused = ::pwritev2(fd, &v, 1, 0, RWF_NOWAIT) < 0 && errno == EOPNOTSUPP;
  ::close(fd);
  ::unlink(probe.c_str());
  return refused;
}

// In a child with `fs` mounted on `mnt`: random 4 KiB writes, 32 in flight, from a thread
// started as `who` says, against a model of the file; then the file read back. 0: all well;
// cannot_set_up: skipped; else which check failed.
int buffered_writes_land(const std::string& fs, const temp_dir& dir, const std::string& mnt,
                         submitter who) {
  const std::string why =
      fs == "tmpfs" ? (test::mount_private_tmpfs(mnt, std::size_t{64} << 20) ? "" : "no tmpfs")
                    : test::mount_private_loop(fs, dir.file(fs + ".img"), mnt, 300 << 20);
  if (!why.empty()) return test::cannot_set_up;
  std::string no_uring;
  auto c = on_uring(who, no_uring);
  if (!c) return test::cannot_set_up;
  const std::string path = mnt + "/data";
  constexpr std::size_t blocks = 64;
  constexpr int depth = 32;
  file f = open_rw(*c, path);
  if (!f.is_open()) return 1;
  std::vector<std::byte> model(blocks * 4096, std::byte{0});
  std::vector<std::vector<std::byte>> bufs(depth, std::vector<std::byte>(4096));
  std::vector<receipt> rs(depth);
  std::mt19937 rng(5);
  constexpr int writes = 2000;
  for (int i = 0; i < writes; ++i) {
    const int k = i % depth;
    if (rs[k].valid() && rs[k].wait().value_or(0) != 4096) return 2;
    const std::size_t at = rng() % blocks * 4096;
    std::fill(bufs[k].begin(), bufs[k].end(), static_cast<std::byte>(i % 251 + 1));
    std::copy(bufs[k].begin(), bufs[k].end(), model.begin() + static_cast<std::ptrdiff_t>(at));
    rs[k] = f.write(at, bufs[k]);
    // One block has one write in flight at a time: the model's order is the file's.
    for (int j = 0; j < depth; ++j) {
      if (j != k && rs[j].valid() && rs[j].wait().value_or(0) != 4096) return 3;
    }
  }
  for (auto& r : rs) {
    if (r.valid() && r.wait().value_or(0) != 4096) return 4;
  }
  if (!f.fsync().wait()) return 5;
  const std::uint64_t by_threads = c->engine_counts().buffered_writes_by_threads;
  if (!f.close()) return 6;
  std::vector<std::byte> back(model.size());
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::pread(fd, back.data(), back.size(), 0) != static_cast<ssize_t>(back.size())) {
    return 7;
  }
  ::close(fd);
  if (back != model) return 8;
  const bool refused = refuses_nowait_writes(mnt);
  if (refused && by_threads != writes) return 9;
  if (!refused && by_threads != 0) return 10;
  return 0;
}

TEST(AioBufferedWrites, WritesTheKernelWouldHandOffAreWrittenByKeelsThreads) {
  if (::geteuid() != 0) GTEST_SKIP() << "mounting tmpfs and xfs needs root";
  int ran = 0;
  for (const char* fs : {"tmpfs", "xfs"}) {
    for (const submitter who : {submitter::workers, submitter::caller}) {
      temp_dir dir;
      const std::string mnt = dir.file("mnt");
      std::filesystem::create_directory(mnt);
      const pid_t child = test::fork_child([&] { return buffered_writes_land(fs, dir, mnt, who); });
      const int code = test::wait_exit(child);
      if (code == test::cannot_set_up) continue;
      EXPECT_EQ(code, 0) << fs << ", submit_on "
                         << (who == submitter::workers ? "workers" : "caller");
      ++ran;
    }
  }
  if (ran == 0) GTEST_SKIP() << "neither tmpfs nor xfs could be mounted, or io_uring is denied";
}

// An empty write ends with 0 bytes, wherever buffered writes go, and does not stand for the
// file's first write when it finds out what kind of file it is.
TEST(AioBufferedWrites, AnEmptyWriteWritesNothingAndSucceeds) {
  KEEL_ON_URING(c, submitter::caller);
  temp_dir dir;
  file f = open_rw(*c, dir.file("empty"));
  EXPECT_EQ(f.write(0, std::span<const std::byte>()).wait().value_or(99), 0u) << "first";
  const std::vector<std::byte> data(4096, std::byte{1});
  ASSERT_EQ(f.write(0, data).wait().value_or(0), data.size());
  EXPECT_EQ(f.write(4096, std::span<const std::byte>()).wait().value_or(99), 0u) << "after";
  ASSERT_EQ(f.write(4096, data).wait().value_or(0), data.size());
  const std::uint64_t by_threads = c->engine_counts().buffered_writes_by_threads;
  EXPECT_EQ(by_threads, refuses_nowait_writes(dir.path().string()) ? 2u : 0u);
  ASSERT_TRUE(f.close());
  EXPECT_EQ(std::filesystem::file_size(dir.file("empty")), 8192u);
}

TEST(AioCallerRings, UnknownSubmitOnInTheEnvironmentIsRefused) {
  const pid_t child = test::fork_child([] {
    ::setenv("KEEL_AIO_SUBMIT_ON", "sideways", 1);
    auto c = controller::start();
    if (c) return 1;
    return c.error() == std::errc::invalid_argument ? 0 : 2;
  });
  EXPECT_EQ(test::wait_exit(child), 0);
}

}  // namespace
}  // namespace keel::aio
