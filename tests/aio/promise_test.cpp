// keel::aio keeps its word where it was caught breaking it: a write is acknowledged only once
// it is where the engine's contract says, a failure is reported by the request or fsync it
// belongs to, a forked child never runs the parent's requests, a completion may close its
// own file and wait for later requests, and errors keep their errno and their file. Each
// on every engine it applies to; what fails by hanging runs in a child with a time limit.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "aio_support.hpp"
#include "keel/aio/controller.hpp"
#include "keel/aio/errors.hpp"
#include "support/process.hpp"
#include "support/seccomp.hpp"

namespace keel::aio {
namespace {

using namespace std::chrono_literals;
using test::temp_dir;
using test_support::ends_on_its_own;
using test_support::expect_ends_in_a_child;
using test_support::hold_until;
using test_support::one_worker;
using test_support::workers_forced_away;

#if defined(__SANITIZE_THREAD__)
constexpr bool under_thread_sanitizer = true;
#else
constexpr bool under_thread_sanitizer = false;
#endif
#if defined(__SANITIZE_ADDRESS__)
constexpr bool under_address_sanitizer = true;
#else
constexpr bool under_address_sanitizer = false;
#endif

// Whether `r` is the refusal of a controller inherited across fork().
template <class T>
bool inherited(const result<T>& r) {
  return !r && r.error() == keel::errc::inherited_across_fork;
}

std::vector<std::byte> bytes_of(std::size_t n, char c) {
  return std::vector<std::byte>(n, static_cast<std::byte>(c));
}

// `n` bytes of `path` at `offset` as the kernel has them (fewer at its end).
std::vector<std::byte> on_disk(const std::string& path, std::uint64_t offset, std::size_t n) {
  std::vector<std::byte> out(n);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  const ssize_t got = ::pread(fd, out.data(), n, static_cast<off_t>(offset));
  ::close(fd);
  out.resize(got < 0 ? 0 : static_cast<std::size_t>(got));
  return out;
}

// Waits for `child`, which exits 0 on success or test::cannot_set_up where `what` cannot be
// had here (then the test skips, saying so).
#define EXPECT_CHILD_PASSES(child, what)                                      \
  do {                                                                        \
    const int code_ = test::wait_exit(child);                                 \
    if (code_ == test::cannot_set_up) GTEST_SKIP() << "cannot " what " here"; \
    EXPECT_EQ(code_, 0);                                                      \
  } while (false)

// In a child only: files may grow to `bytes` (EFBIG past it, not SIGXFSZ); 0 lifts it.
bool limit_file_size(rlim_t bytes) {
  std::signal(SIGXFSZ, SIG_IGN);
  rlimit r{};
  if (::getrlimit(RLIMIT_FSIZE, &r) != 0) return false;
  r.rlim_cur = bytes == 0 ? r.rlim_max : bytes;
  return ::setrlimit(RLIMIT_FSIZE, &r) == 0;
}

file open_file(controller& c, const std::string& path, bool cache) {
  open_options how;
  how.write = true;
  how.create = true;
  how.cache = cache;
  auto f = c.open(path, how);
  return f ? std::move(*f) : file();
}

// ---- every engine, with and without the write-back cache ----

struct engine_and_cache {
  engine_kind engine;
  bool cache;
};

std::string name_of(const ::testing::TestParamInfo<engine_and_cache>& p) {
  return std::string(to_string(p.param.engine)) + (p.param.cache ? "Cache" : "");
}

class Promises : public ::testing::TestWithParam<engine_and_cache> {
 protected:
  void SetUp() override {
    KEEL_NEED_ENGINE(GetParam().engine);
    if (const std::string why = workers_forced_away(); !why.empty()) GTEST_SKIP() << why;
  }
  [[nodiscard]] bool does_io() const { return GetParam().engine != engine_kind::null; }
};

// What only engines that do I/O can show (the null engine completes every request at once).
class IoPromises : public Promises {};

// A write the kernel refuses (past RLIMIT_FSIZE: EFBIG) is acknowledged by nobody: without
// the cache its own receipt fails; with the cache the fsync that covers it does, and keeps
// its bytes for the next one. Once the limit is lifted, a write (or fsync) again, the fsync
// and the close succeed, and the bytes are in the file: none was dropped on the way.
TEST_P(IoPromises, AWriteTheKernelRefusedIsNeverAcknowledgedNorLost) {
  const auto [engine, cache] = GetParam();
  temp_dir dir;
  const std::string path = dir.file("limited");
  const pid_t child = test::fork_child([&] {
    if (!limit_file_size(64 << 10)) return test::cannot_set_up;
    auto c = one_worker(engine, cache);
    if (!c) return 1;
    file f = open_file(*c, path, cache);
    if (!f.is_open()) return 2;
    const auto a = bytes_of(100, 'A');
    const auto w = f.write(1 << 20, a).wait();
    if (cache) {
      if (!w) return 3;  // cached: finished at once
      const auto s = f.fsync().wait();
      if (s || s.error() != std::errc::file_too_large) return 4;
    } else if (w || w.error() != std::errc::file_too_large) {
      return 5;
    }
    // A later request (a read of what is there) must not find the refused bytes anywhere.
    std::vector<std::byte> back(100);
    if (!cache && f.read(1 << 20, back).wait().value_or(1) != 0) return 6;
    if (!limit_file_size(0)) return test::cannot_set_up;
    if (!cache && !f.write(1 << 20, a).wait()) return 7;
    if (!f.fsync().wait()) return 8;
    if (!f.close()) return 9;
    return on_disk(path, 1 << 20, 200) == a ? 0 : 10;
  });
  EXPECT_CHILD_PASSES(child, "set RLIMIT_FSIZE");
}

// A write past the cache that fails leaves the end of the file where it was: a read from 0
// returns the file's bytes, not zeros up to where the failed write would have ended.
TEST_P(IoPromises, AFailedWriteLeavesTheEndOfTheFile) {
  const auto [engine, cache] = GetParam();
  temp_dir dir;
  const std::string path = dir.file("short");
  const pid_t child = test::fork_child([&] {
    if (!limit_file_size(64 << 10)) return test::cannot_set_up;
    options o;
    o.engine = engine;
    o.workers = 1;
    // One page of cache: the write at 1 MiB goes past it (the hard limit).
    o.cache_soft_limit = o.cache_hard_limit = cache ? 4096 : 0;
    o.cache_idle_round = 60s;
    auto c = controller::start(o);
    if (!c) return 1;
    file f = open_file(**c, path, cache);
    if (!f.is_open()) return 2;
    const auto page = bytes_of(4096, 'p');
    // In the file, and cached again (dirty): the cache is at its limit.
    if (!f.write(0, page).wait() || !f.fsync().wait() || !f.write(0, page).wait()) return 3;
    if (f.write(1 << 20, bytes_of(100, 'A')).wait()) return 4;
    std::vector<std::byte> back(2 << 20);
    const auto n = f.read(0, back).wait();
    if (!n) return 5;
    return *n == 4096 ? 0 : 6;
  });
  EXPECT_CHILD_PASSES(child, "set RLIMIT_FSIZE");
}

// Errors are the kernel's, as the posix engine reports them (a read of a directory is
// EISDIR, not EIO), and name the file they are about, whatever the engine.
TEST_P(IoPromises, ErrorsKeepTheirErrnoAndTheirFile) {
  const auto [engine, cache] = GetParam();
  temp_dir dir;
  const std::string sub = dir.file("a-directory");
  ASSERT_EQ(::mkdir(sub.c_str(), 0755), 0);
  auto c = one_worker(engine, cache);
  ASSERT_TRUE(c);
  open_options how;
  how.cache = cache;
  auto d = c->open(sub, how);
  ASSERT_TRUE(d) << d.error().message();
  std::vector<std::byte> back(100);
  const auto r = d->read(0, back).wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), std::errc::is_a_directory) << r.error().message();
  EXPECT_NE(r.error().path().find("a-directory"), std::string_view::npos) << r.error().message();

  // A write far past any file's end: the errno the posix engine gets here, if any.
  const std::string path = dir.file("far");
  auto p = one_worker(engine_kind::posix);
  ASSERT_TRUE(p);
  file pf = open_file(*p, path + "-posix", false);
  const auto a = bytes_of(100, 'A');
  const auto expected = pf.write(std::uint64_t{1} << 62, a).wait();
  file f = open_file(*c, path, cache);
  auto got = f.write(std::uint64_t{1} << 62, a).wait();
  if (got && cache) {
    if (auto s = f.fsync().wait(); !s) got = std::unexpected(s.error());
  }
  ASSERT_EQ(static_cast<bool>(got), static_cast<bool>(expected));
  if (!got) {
    EXPECT_EQ(got.error().code(), expected.error().code()) << got.error().message();
    EXPECT_NE(got.error().path().find("far"), std::string_view::npos) << got.error().message();
  }
}

// A completion closes its own request's file while a later request of the file, which must
// follow it, waits: the close waits for that request (which runs) rather than for itself,
// and the controller then stops. The request is a write, or with the cache (which finishes
// a write at once, on the submitting thread) a task, which runs on the worker.
TEST_P(Promises, ACompletionMayCloseItsOwnFile) {
  const auto [engine, cache] = GetParam();
  temp_dir dir;
  expect_ends_in_a_child([&] {
    auto c = one_worker(engine, cache);
    if (!c) return 1;
    file h = open_file(*c, dir.file("held"), false);
    file f = open_file(*c, dir.file("own"), cache);
    std::atomic<bool> go{false};
    receipt hold = hold_until(h, go);
    const auto data = bytes_of(4096, 'w');
    std::atomic<int> closed{-1};
    const auto close_it = [&](const result<std::size_t>&) { closed = f.close() ? 1 : 0; };
    receipt w = cache ? f.submit([&]() -> result<std::size_t> { return 4096; }, close_it)
                      : f.write(0, data, close_it);
    receipt w2 = cache ? f.write(0, data) : receipt();
    std::vector<std::byte> back(4096);
    receipt r = f.read(0, back);  // must follow the write (or the task)
    go = true;
    if (!ends_on_its_own(w, 10) || !ends_on_its_own(r, 10)) return 2;
    if (w.wait().value_or(0) != 4096 || closed.load() != 1) return 3;
    if (r.wait().value_or(0) != 4096) return 4;
    if (engine != engine_kind::null && back != data) return 5;
    c.reset();
    return 0;
  });
}

// A completion on the worker closes a file the main thread is closing. When the completion
// is of the file's own last request, the first closer waits for that request, which the
// second lets go of: the first must be woken for it. When it is of another file, the first
// closer waits for the worker itself (an io_uring worker's ring lets go of a file it
// registered), so the second must run what its worker owes while it waits. Both closes
// return, and so does the request.
TEST_P(Promises, ACompletionMayCloseAFileAnotherThreadCloses) {
  const auto [engine, cache] = GetParam();
  temp_dir dir;
  for (const bool own : {true, false}) {
    SCOPED_TRACE(own ? "a completion of the file's own request" : "of another file's");
    expect_ends_in_a_child([&] {
      auto c = one_worker(engine, cache);
      if (!c) return 1;
      file f = open_file(*c, dir.file("shared"), cache);
      file g = open_file(*c, dir.file("other"), false);
      // Through the worker, so that its ring (io_uring) holds the file.
      if (!f.write(0, bytes_of(4096, 'c')).wait() || !f.fsync().wait()) return 2;
      std::atomic<bool> started{false};
      std::atomic<int> inner{-1};
      receipt last = (own ? f : g)
                         .submit([]() -> result<std::size_t> { return 1; },
                                 [&](const result<std::size_t>&) {
                                   started = true;
                                   for (;;) {  // until the main thread closes it
                                     const auto probe = f.fsync().wait();
                                     if (!probe && probe.error() == keel::errc::file_closed) {
                                       break;
                                     }
                                   }
                                   inner = f.close() ? 1 : 0;
                                 });
      while (!started.load())
        std::this_thread::yield();
      if (!f.close()) return 3;
      if (!ends_on_its_own(last, 10) || inner.load() != 1) return 4;
      c.reset();
      return 0;
    });
  }
}

// A completion on controller A stops controller B, whose own completion waits for a write
// queued on A's only worker: that worker is the thread stopping B, so the stop must run it
// while it waits for B's requests.
TEST_P(Promises, ACompletionMayStopAControllerThatWaitsForItsOwn) {
  const auto [engine, cache] = GetParam();
  temp_dir dir;
  expect_ends_in_a_child([&] {
    auto a = one_worker(engine, cache);
    auto b = one_worker(engine, cache);
    if (!a || !b) return 1;
    file fa = open_file(*a, dir.file("a"), cache);
    file fb = open_file(*b, dir.file("b"), cache);
    std::atomic<bool> queued{false};
    receipt on_a;
    std::atomic<long> seen{-1};
    receipt rb = fb.submit([]() -> result<std::size_t> { return 1; },
                           [&](const result<std::size_t>&) {
                             while (!queued.load())
                               std::this_thread::yield();
                             seen = static_cast<long>(on_a.wait().value_or(0));
                           });
    std::atomic<bool> stopped{false};
    receipt stopper = fa.submit(
        [&]() -> result<std::size_t> {
          while (!queued.load())  // the write below is in the inbox by then
            std::this_thread::yield();
          return 1;
        },
        [&](const result<std::size_t>&) {
          b->stop();
          stopped = true;
        });
    const auto data = bytes_of(4096, 'a');
    on_a = fa.write(0, data);
    queued = true;
    if (!ends_on_its_own(stopper, 10) || !stopped.load()) return 2;
    if (!ends_on_its_own(rb, 10) || seen.load() != 4096) return 3;
    return 0;
  });
}

// A completion of read X waits for read Y of another range, and a write Z overlapping both
// was submitted between them: Y waits for Z, Z for X. The wait lets the requests behind X
// go: Y ends, and so does X's completion.
TEST_P(Promises, ACompletionMayWaitForALaterReadBehindAWrite) {
  const auto [engine, cache] = GetParam();
  temp_dir dir;
  expect_ends_in_a_child([&] {
    auto c = one_worker(engine, cache);
    if (!c) return 1;
    file h = open_file(*c, dir.file("held"), false);
    file f = open_file(*c, dir.file("chain"), cache);
    // In the file, not in the cache (written out and dropped): the reads go to the worker.
    if (!f.write(0, bytes_of(3 * 4096, 'o')).wait() || !f.fsync().wait()) return 2;
    std::atomic<bool> go{false};
    receipt hold = hold_until(h, go);
    std::vector<std::byte> x_back(4096);
    std::vector<std::byte> y_back(4096);
    const auto z_data = bytes_of(3 * 4096, 'z');
    receipt y;
    std::atomic<bool> y_known{false};
    std::atomic<int> seen{-1};
    receipt x = f.read(0, x_back, [&](const result<std::size_t>&) {
      while (!y_known.load())
        std::this_thread::sleep_for(1ms);
      seen = static_cast<int>(y.wait().value_or(0));
    });
    receipt z = f.write(0, z_data);
    y = f.read(2 * 4096, y_back);
    y_known = true;
    go = true;
    if (!ends_on_its_own(x, 10) || !ends_on_its_own(y, 10) || !ends_on_its_own(z, 10)) return 3;
    if (seen.load() != 4096) return 4;
    if (engine != engine_kind::null &&
        (x_back != bytes_of(4096, 'o') || y_back != bytes_of(4096, 'z'))) {
      return 5;
    }
    return 0;
  });
}

// ---- fork ----

// A child forked while the parent had a write queued never runs it: not when it waits on
// the inherited controller (which refuses: errc::inherited_across_fork), not when it drops
// it. The parent's later write and fsync stand.
TEST_P(IoPromises, AForkedChildNeverRunsTheParentsRequests) {
  const auto [engine, cache] = GetParam();
  temp_dir dir;
  const std::string path = dir.file("forked");
  auto c = one_worker(engine, cache);
  ASSERT_TRUE(c);
  file h = open_file(*c, dir.file("held"), false);
  file f = open_file(*c, path, cache);
  file g = open_file(*c, dir.file("other"), false);
  ASSERT_TRUE(f.is_open() && g.is_open());
  std::atomic<bool> go{false};
  receipt hold = hold_until(h, go);
  const auto old_bytes = bytes_of(4096, 'O');
  const auto new_bytes = bytes_of(4096, 'N');
  receipt old_write = f.write(0, old_bytes);
  receipt fsync_queued = f.fsync();
  test::signal_pipe parent_done;
  const pid_t child = test::fork_child([&] {
    if (parent_done.wait() != 'd') return 1;
    std::vector<std::byte> back(10);
    if (!inherited(g.read(0, back).wait())) return 2;
    const auto o = old_write.wait();  // pending in the parent when it forked (or done)
    if (!o && !inherited(o)) return 3;
    if (!inherited(f.write(0, old_bytes).wait())) return 4;
    if (!inherited(f.fsync().wait())) return 5;
    (void)f.close();
    (void)g.close();
    (void)h.close();
    c.reset();
    return 0;
  });
  test::killed_on_failure guard{child};
  go = true;
  ASSERT_TRUE(old_write.wait());
  ASSERT_TRUE(fsync_queued.wait());
  ASSERT_TRUE(f.write(0, new_bytes).wait());
  ASSERT_TRUE(f.fsync().wait());
  parent_done.notify('d');
  EXPECT_EQ(test::wait_exit(child), 0);
  guard.pid = 0;
  EXPECT_EQ(on_disk(path, 0, 4096), new_bytes);
  ASSERT_TRUE(f.close());
  EXPECT_EQ(on_disk(path, 0, 4096), new_bytes);
}

// What a child may do: nothing with the inherited controller (every call refused, dropping
// it writes nothing: the parent's cached bytes are not written out by the child), and
// everything with a controller of its own.
TEST_P(Promises, AForkedChildStartsAControllerOfItsOwn) {
  const auto [engine, cache] = GetParam();
  temp_dir dir;
  const std::string path = dir.file("parents");
  auto c = one_worker(engine, cache);
  ASSERT_TRUE(c);
  file f = open_file(*c, path, cache);
  ASSERT_TRUE(f.is_open());
  const auto p_bytes = bytes_of(4096, 'P');
  ASSERT_TRUE(f.write(0, p_bytes).wait());  // cached: not in the file yet
  const pid_t child = test::fork_child([&] {
    std::vector<std::byte> back(10);
    if (!inherited(f.read(0, back).wait())) return 1;
    if (!inherited(c->open(dir.file("x"), open_options{}))) return 2;
    (void)f.close();
    c.reset();
    // ThreadSanitizer cannot run threads started after a fork of a process with threads, and
    // GCC 12's AddressSanitizer does not take its allocator's locks around fork(): a parent
    // thread inside malloc at the fork leaves a lock that new threads in the child wait on
    // for ever (seen in CI). Both sanitizers still check everything above.
    if (under_thread_sanitizer || under_address_sanitizer) return 0;
    auto mine = one_worker(engine, cache);
    if (!mine) return 3;
    file m = open_file(*mine, dir.file("childs"), cache);
    const auto data = bytes_of(5000, 'C');
    back.assign(5000, std::byte{0});
    if (!m.write(0, data).wait() || !m.fsync().wait()) return 4;
    if (m.read(0, back).wait().value_or(0) != 5000) return 5;
    if (engine != engine_kind::null && back != data) return 6;
    return m.close() ? 0 : 7;
  });
  EXPECT_EQ(test::wait_exit(child), 0);
  if (cache) {
    EXPECT_TRUE(on_disk(path, 0, 4096).empty()) << "the child wrote the parent's cache out";
  }
  ASSERT_TRUE(f.fsync().wait());
  if (does_io()) {
    EXPECT_EQ(on_disk(path, 0, 4096), p_bytes);
  }
  EXPECT_TRUE(f.close());
}

// ---- the write-back cache and writes that went past it ----

// Thread A's write goes past the cache (at its hard limit) and waits for the worker; thread B
// then caches a write of the same page (the cache had room for one page, not two) and its
// fsync writes it out, leaving the page clean in the cache (O_DIRECT keeps written pages).
// A's write then lands in the file. Either order of the two writes is right, but the cache
// and the file must agree: keel reads what the file holds.
TEST(AioCacheRace, AWriteThatWentPastTheCacheLeavesNoStalePage) {
  temp_dir dir;
  {
    const std::string probe = dir.file("direct-probe");
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
    if (fd < 0) GTEST_SKIP() << "O_DIRECT is refused here: " << std::strerror(errno);
    ::close(fd);
  }
  if (const std::string why = workers_forced_away(); !why.empty()) GTEST_SKIP() << why;
  int ran = 0;
  for (const auto e : {engine_kind::io_uring, engine_kind::posix}) {
    if (!test_support::unavailable(e).empty()) continue;
    SCOPED_TRACE(to_string(e));
    ++ran;
    options o;
    o.engine = e;
    o.workers = 2;
    o.submit_on = submitter::workers;
    o.cache_soft_limit = o.cache_hard_limit = 2 * 4096;
    o.cache_idle_round = 60s;
    o.cache_write_behind = 0;
    auto c = controller::start(o);
    ASSERT_TRUE(c);
    const std::string path = dir.file(std::string("race-") + std::string(to_string(e)));
    open_options how;
    how.write = true;
    how.create = true;
    how.direct = true;
    how.cache = true;
    auto f = (*c)->open(path, how);
    ASSERT_TRUE(f) << f.error().message();
    auto h = (*c)->open(dir.file("held"), open_options{.write = true, .create = true});
    ASSERT_TRUE(h);
    struct alignas(4096) page {
      std::array<std::byte, 4096> b;
    };
    std::vector<page> zero(1), a(2), b(1), back(1);
    for (auto& p : a)
      p.b.fill(std::byte{'A'});
    b[0].b.fill(std::byte{'B'});
    const auto span_of = [](std::vector<page>& v) {
      return std::span(v.front().b.data(), v.size() * 4096);
    };
    // Each thread's requests on a file go to the workers in turn (a cached write takes its
    // turn too): the held task is the second worker's, and so is A's write; B's fsync, its
    // thread's third request, is the first worker's.
    ASSERT_TRUE(f->write(0, span_of(zero)).wait());  // one page cached: room for one more
    ASSERT_TRUE(h->write(0, span_of(zero)).wait());
    std::atomic<bool> go{false};
    std::atomic<bool> holding{false};
    receipt hold = hold_until(*h, go, &holding);
    // Running before `past` is queued: the held worker's inbox then has `past` behind it.
    // (It follows the write above, which lets it go to its worker only as that ends.)
    // A waiting thread helps the workers and so could run `past` from the held worker's
    // inbox: the threads wait by looking, never by helping.
    while (!holding.load())
      std::this_thread::yield();
    receipt past = f->write(4096, span_of(a));  // two pages: past the limit, behind `hold`
    const auto looked_at = [](const receipt& r) {
      while (!r.ready())
        std::this_thread::yield();
      return r.wait();
    };
    std::thread other([&] {
      EXPECT_TRUE(looked_at(f->write(4096, span_of(b))));  // cached (the page is made)
      EXPECT_TRUE(looked_at(f->write(4096, span_of(b))));
      EXPECT_TRUE(looked_at(f->fsync()));  // out, by the first worker
      EXPECT_FALSE(past.ready());
    });
    other.join();
    go = true;
    ASSERT_TRUE(past.wait());
    ASSERT_EQ(f->read(4096, span_of(back)).wait().value_or(0), 4096u);
    ASSERT_TRUE(f->fsync().wait());
    const auto disk = on_disk(path, 4096, 4096);
    EXPECT_TRUE(std::vector<std::byte>(back[0].b.begin(), back[0].b.end()) == disk)
        << "keel read '" << static_cast<char>(back[0].b[0]) << "', the file holds '"
        << (disk.empty() ? '?' : static_cast<char>(disk[0])) << "'";
    ASSERT_TRUE(f->close());
  }
  if (ran == 0) GTEST_SKIP() << "neither io_uring nor posix can be had here";
}

// ---- io_uring that cannot be entered ----

// A seccomp profile that lets rings be set up but denies io_uring_enter: the probe finds it
// when the controller starts (io_uring asked for: EPERM; the default: posix, saying why).
TEST(AioUringDenied, ARingThatCannotBeEnteredIsFoundAtStart) {
  const pid_t child = test::fork_child([&] {
    if (!test::deny_io_uring({.enter_only = true})) return test::cannot_set_up;
    ::unsetenv("KEEL_AIO_ENGINE");
    options forced;
    forced.engine = engine_kind::io_uring;
    auto no = controller::start(forced);
    if (no || no.error() != std::errc::operation_not_permitted) return 2;
    auto c = controller::start();
    if (!c || (*c)->engine() != engine_kind::posix) return 3;
    return (*c)->fallback_reason().find("io_uring") == std::string::npos ? 4 : 0;
  });
  EXPECT_CHILD_PASSES(child, "install a seccomp filter");
}

// io_uring_enter denied once the rings run (the filter put on every thread): a request
// then fails with the error, the worker does not spin, and the controller stops.
TEST(AioUringDenied, ARingDeniedOnceRunningFailsItsRequestsWithoutSpinning) {
  KEEL_NEED_ENGINE(engine_kind::io_uring);
  if (const std::string why = workers_forced_away(); !why.empty()) GTEST_SKIP() << why;
  temp_dir dir;
  const std::string path = dir.file("denied");
  const pid_t child = test::fork_child([&] {
    ::alarm(20);
    auto c = one_worker(engine_kind::io_uring);
    if (!c) return 1;
    file f = open_file(*c, path, false);
    const auto data = bytes_of(4096, 'd');
    if (!f.write(0, data).wait()) return 2;
    if (!test::deny_io_uring({.enter_only = true, .all_threads = true})) {
      return test::cannot_set_up;
    }
    std::vector<std::byte> back(4096);
    const auto r = f.read(0, back).wait(io::deadline(10s));
    if (r || r.error() != std::errc::operation_not_permitted) return 3;
    rusage before{};
    rusage after{};
    ::getrusage(RUSAGE_SELF, &before);
    std::this_thread::sleep_for(300ms);
    ::getrusage(RUSAGE_SELF, &after);
    const auto cpu_us = [](const rusage& u) {
      return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1'000'000L + u.ru_utime.tv_usec +
             u.ru_stime.tv_usec;
    };
    if (cpu_us(after) - cpu_us(before) > 150'000) return 4;  // a spinning worker: ~300 000
    const auto w = f.write(0, data).wait();
    if (w || w.error() != std::errc::operation_not_permitted) return 5;
    if (!f.close()) return 6;  // the dead ring still lets go of the file it registered
    c.reset();
    return 0;
  });
  const int code = test::wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot install a seccomp filter here";
  EXPECT_EQ(code, 0) << "3: the read did not fail with EPERM; 4: the process spun; 142: hung";
}

// A child that merely exits with exit() (glibc then syncs every stdio stream, the parent's
// too) must not move where the parent's stdio engine reads and writes: the descriptor's
// offset is the parent's and the child's. The parent reads at 100 and writes 'W' at 12000
// in a loop while children come and go; a 'W' anywhere else is a write sent astray.
TEST(AioForkedChild, ExitingLeavesTheParentsStdioWritesWhereTheyWereSent) {
  KEEL_NEED_ENGINE(engine_kind::stdio);
#if defined(__SANITIZE_ADDRESS__)
  // LeakSanitizer checks at the children's exit(), which this test is about: it reports
  // the parent's memory their threads held, and can hang stopping threads that do not exist.
  GTEST_SKIP() << "exit() in a forked child runs LeakSanitizer";
#endif
  temp_dir dir;
  const std::string path = dir.file("stdio-fork");
  auto c = one_worker(engine_kind::stdio);
  ASSERT_TRUE(c);
  file f = open_file(*c, path, false);
  ASSERT_TRUE(f.write(0, bytes_of(16384, '.')).wait());
  std::atomic<bool> done{false};
  std::thread io([&] {
    const auto w = bytes_of(10, 'W');
    std::vector<std::byte> back(10);
    while (!done.load()) {
      (void)f.read(100, back).wait();
      (void)f.write(12000, w).wait();
    }
  });
  for (int i = 0; i < 200; ++i) {
    const pid_t child = test::fork_child([] {
      std::exit(0);  // destructors and stdio's cleanup run
      return 0;
    });
    EXPECT_EQ(test::wait_exit(child), 0);
  }
  done = true;
  io.join();
  ASSERT_TRUE(f.close());
  const auto all = on_disk(path, 0, 16384);
  std::size_t astray = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (all[i] == std::byte{'W'} && (i < 12000 || i >= 12010)) ++astray;
  }
  EXPECT_EQ(astray, 0u) << "bytes of 'W' outside [12000, 12010)";
}

std::vector<engine_and_cache> engines(bool with_null) {
  std::vector<engine_and_cache> out;
  for (const auto k :
       {engine_kind::io_uring, engine_kind::posix, engine_kind::stdio, engine_kind::null}) {
    if (k == engine_kind::null && !with_null) continue;
    out.push_back({k, false});
    out.push_back({k, true});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Engines, Promises, ::testing::ValuesIn(engines(true)), name_of);
INSTANTIATE_TEST_SUITE_P(Engines, IoPromises, ::testing::ValuesIn(engines(false)), name_of);

}  // namespace
}  // namespace keel::aio
