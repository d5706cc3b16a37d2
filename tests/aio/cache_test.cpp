// keel::aio's write-back cache: what it promises beyond the model test (controller_test):
// writes finish into memory and reach the file by fsync, close, stop, the soft limit and
// idle rounds; the hard limit bypasses; a failed write-out is reported; reads combine pages
// and file.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include "aio/cache.hpp"
#include "keel/aio/controller.hpp"
#include "keel/aio/errors.hpp"
#include "support/process.hpp"

namespace keel::aio {
namespace {

using namespace std::chrono_literals;
using test::temp_dir;

std::unique_ptr<controller> start_cached(std::size_t soft, std::size_t hard,
                                         std::chrono::milliseconds idle,
                                         std::size_t behind = options{}.cache_write_behind) {
  options o;
  o.engine = engine_kind::posix;
  o.cache_soft_limit = soft;
  o.cache_hard_limit = hard;
  o.cache_idle_round = idle;
  o.cache_write_behind = behind;
  auto c = controller::start(o);
  if (!c) {
    ADD_FAILURE() << "start: " << c.error().message();
    return nullptr;
  }
  return std::move(*c);
}

file open_cached(controller& c, const std::string& path, bool direct = false) {
  open_options how;
  how.write = true;
  how.create = true;
  how.cache = true;
  how.direct = direct;
  auto f = c.open(path, how);
  if (!f) ADD_FAILURE() << "open " << path << ": " << f.error().message();
  return f ? std::move(*f) : file();
}

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v)
    b = static_cast<std::byte>(rng());
  return v;
}

// What the file holds at [offset, offset + n), read past keel.
std::vector<std::byte> on_disk(const std::string& path, std::uint64_t offset, std::size_t n) {
  std::vector<std::byte> v(n);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  const ssize_t got = ::pread(fd, v.data(), n, static_cast<off_t>(offset));
  ::close(fd);
  v.resize(got < 0 ? 0 : static_cast<std::size_t>(got));
  return v;
}

// Polls `done` every millisecond for up to `limit`.
template <class Done>
bool eventually(Done&& done, std::chrono::milliseconds limit = 10s) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// A controller on the posix engine with the given cache settings, and a cached file `f` at
// `path` opened through it.
class AioCache : public ::testing::Test {
 protected:
  void start(std::size_t soft, std::size_t hard, std::chrono::milliseconds idle,
             std::size_t behind = options{}.cache_write_behind) {
    c = start_cached(soft, hard, idle, behind);
    ASSERT_TRUE(c);
    f = open_cached(*c, path);
    ASSERT_TRUE(f.is_open());
  }

  temp_dir dir;
  std::string path = dir.file("f");
  std::unique_ptr<controller> c;
  file f;
};

TEST(AioCachePages, BitsMatchAModel) {
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    detail::page_bits bits;
    std::vector<bool> model(detail::page_size);
    for (int k = 0; k < 6; ++k) {
      const std::size_t lo = rng() % detail::page_size;
      const std::size_t hi = lo + 1 + rng() % (detail::page_size - lo);
      bits.set(lo, hi);
      for (std::size_t i = lo; i < hi; ++i)
        model[i] = true;
    }
    const std::size_t lo = rng() % detail::page_size;
    const std::size_t hi = lo + 1 + rng() % (detail::page_size - lo);
    std::vector<bool> seen(detail::page_size);
    std::size_t last_end = 0;
    bits.runs(lo, hi, [&](std::size_t a, std::size_t b) {
      ASSERT_LT(a, b);
      ASSERT_GE(a, lo);
      ASSERT_LE(b, hi);
      ASSERT_TRUE(last_end == 0 || a > last_end) << "runs are maximal and in order";
      last_end = b;
      for (std::size_t i = a; i < b; ++i)
        seen[i] = true;
    });
    bool all = true;
    for (std::size_t i = lo; i < hi; ++i) {
      ASSERT_EQ(seen[i], static_cast<bool>(model[i])) << "byte " << i;
      all = all && model[i];
    }
    EXPECT_EQ(bits.all(lo, hi), all);
    EXPECT_TRUE(bits.any());
  }
}

// A cached write is finished when write() returns, is read back from memory, and is in the
// file after fsync (not before: the idle round is far away).
TEST_F(AioCache, WritesFinishAtOnceAndReachTheFileByFsync) {
  ASSERT_NO_FATAL_FAILURE(start(1 << 20, 4 << 20, 60s));
  const auto data = pattern(10000, 1);
  receipt w = f.write(3000, data);
  EXPECT_TRUE(w.ready()) << "the cache finishes a write on the spot";
  EXPECT_EQ(w.wait().value_or(0), data.size());
  EXPECT_EQ(on_disk(path, 0, 20000).size(), 0u) << "nothing written out yet";

  std::vector<std::byte> back(10000);
  EXPECT_EQ(f.read(3000, back).wait().value_or(0), back.size());
  EXPECT_EQ(back, data);
  EXPECT_EQ(c->cache().reads_served, 1u);
  EXPECT_EQ(c->cache().dirty_bytes, 4 * detail::page_size);  // bytes 3000..12999: pages 0..3

  ASSERT_TRUE(f.fsync().wait());
  EXPECT_EQ(on_disk(path, 3000, 10000), data);
  EXPECT_EQ(c->cache().dirty_bytes, 0u);
  EXPECT_EQ(c->cache().cached_bytes, 0u)
      << "a buffered file's written pages go: the kernel's page cache holds their bytes";
  std::vector<std::byte> again(10000);
  EXPECT_EQ(f.read(3000, again).wait().value_or(0), again.size());
  EXPECT_EQ(again, data);
  EXPECT_EQ(c->cache().reads_served, 1u) << "read from the file";
}

// A read the pages do not wholly hold gets the file's bytes with the cached ones laid over,
// and the file's end moves with cached writes past it (the gap reads as zeros).
TEST_F(AioCache, ReadsCombinePagesWithTheFile) {
  const auto base = pattern(8192, 2);
  {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, base.data(), base.size(), 0), 8192);
    ::close(fd);
  }
  ASSERT_NO_FATAL_FAILURE(start(1 << 20, 4 << 20, 60s));
  const auto mid = pattern(100, 3);
  const auto tail = pattern(50, 4);
  ASSERT_TRUE(f.write(4000, mid).wait());
  ASSERT_TRUE(f.write(20000, tail).wait());

  std::vector<std::byte> expected(20050, std::byte{0});
  std::memcpy(expected.data(), base.data(), base.size());
  std::memcpy(expected.data() + 4000, mid.data(), mid.size());
  std::memcpy(expected.data() + 20000, tail.data(), tail.size());
  std::vector<std::byte> back(30000);
  auto n = f.read(0, back).wait();
  ASSERT_TRUE(n) << n.error().message();
  ASSERT_EQ(*n, expected.size()) << "the end of the file is where the last cached write ends";
  back.resize(*n);
  EXPECT_EQ(back, expected);
  EXPECT_EQ(c->cache().reads_served, 0u) << "not a read the pages hold";

  ASSERT_TRUE(f.close());
  EXPECT_EQ(on_disk(path, 0, 30000), expected) << "close wrote the pages out";
  EXPECT_EQ(c->cache().cached_bytes, 0u);
}

// Above the soft limit the flusher writes out and drops the oldest pages on its own.
TEST_F(AioCache, TheSoftLimitIsRestoredWithoutAnFsync) {
  constexpr std::size_t soft = 256 * 1024;
  ASSERT_NO_FATAL_FAILURE(start(soft, 16 << 20, 60s));
  const auto data = pattern(2 << 20, 5);
  for (std::size_t at = 0; at < data.size(); at += 65536) {
    ASSERT_TRUE(f.write(at, std::span(data).subspan(at, 65536)).wait());
  }
  EXPECT_TRUE(eventually([&] { return c->cache().cached_bytes <= soft; }))
      << c->cache().cached_bytes << " bytes cached";
  EXPECT_GE(c->cache().bytes_written_out, data.size() - soft);
  // The oldest went first: the start of the file is on disk already.
  EXPECT_EQ(on_disk(path, 0, 65536), std::vector(data.begin(), data.begin() + 65536));
  ASSERT_TRUE(f.close());
  EXPECT_EQ(on_disk(path, 0, data.size()), data);
}

// 64 pages, each written and at once overwritten (so the cache keeps caching them).
std::vector<std::byte> write_and_overwrite_64_pages(file& f) {
  const auto data = pattern(64 * 4096, 11);
  for (std::size_t at = 0; at < data.size(); at += 4096) {
    for (int twice = 0; twice < 2; ++twice)
      EXPECT_TRUE(f.write(at, std::span(data).subspan(at, 4096)).wait());
  }
  return data;
}

// Write-behind: once twice `behind` bytes of a file are dirty, the flusher writes out all
// but the latest dirtied `behind` bytes of them, before any fsync, and (a buffered file: the
// kernel's page cache holds them) drops them. The overwrites still merged in memory.
TEST_F(AioCache, WritesBehindAllButTheLatestDirtiedPages) {
  constexpr std::size_t behind = 16 * 4096;
  ASSERT_NO_FATAL_FAILURE(start(64 << 20, 128 << 20, 60s, behind));
  const auto data = write_and_overwrite_64_pages(f);
  EXPECT_EQ(c->cache().writes_cached, 128u);
  // What was written out of a buffered file goes (the kernel's page cache holds it).
  EXPECT_TRUE(eventually([&] {
    const cache_stats st = c->cache();
    return st.dirty_bytes < 2 * behind && st.cached_bytes < 2 * behind;
  })) << c->cache().dirty_bytes
      << " bytes dirty, " << c->cache().cached_bytes << " cached";
  EXPECT_GE(c->cache().dirty_bytes, behind) << "the latest dirtied stay in memory";
  EXPECT_GE(c->cache().bytes_written_out, data.size() - 2 * behind);
  EXPECT_EQ(on_disk(path, 0, 4096), std::vector(data.begin(), data.begin() + 4096))
      << "the first page is on disk before any fsync";
  ASSERT_TRUE(f.close());
  EXPECT_EQ(on_disk(path, 0, data.size()), data);
}

// Write-behind while the caller keeps overwriting pages it is writing out (each such write
// goes into a copy of the page, and the original is freed when the write-out settles): a
// model of every byte, checked through keel as it goes and on disk at the end.
TEST_F(AioCache, WriteBehindUnderOverwritesOfPagesBeingWrittenKeepsEveryByte) {
  constexpr std::size_t pages = 96;
  ASSERT_NO_FATAL_FAILURE(start(64 << 20, 128 << 20, 60s, 8 * 4096));
  std::vector<std::byte> model(pages * 4096, std::byte{0});
  std::mt19937 rng(12);
  std::vector<std::byte> back;
  ASSERT_EQ(f.write(0, model).wait().value_or(0), model.size());  // the whole length first
  for (int i = 0; i < 4000; ++i) {
    const std::size_t at = rng() % pages * 4096 + rng() % 2 * (rng() % 4096);
    const std::size_t n = std::min<std::size_t>(model.size() - at, 1 + rng() % (3 * 4096));
    const auto bytes = pattern(n, static_cast<unsigned>(i));
    std::copy(bytes.begin(), bytes.end(), model.begin() + static_cast<std::ptrdiff_t>(at));
    ASSERT_EQ(f.write(at, bytes).wait().value_or(0), n) << i;
    if (i % 97 == 0) {
      back.assign(model.size(), std::byte{0xee});
      ASSERT_EQ(f.read(0, back).wait().value_or(0), back.size()) << i;
      ASSERT_EQ(back, model) << "read through keel after write " << i;
    }
  }
  EXPECT_GT(c->cache().bytes_written_out, 0u) << "write-behind ran";
  ASSERT_TRUE(f.close());
  EXPECT_EQ(on_disk(path, 0, model.size()), model);
}

// With write-behind off, dirty pages wait for the fsync.
TEST_F(AioCache, WithoutWriteBehindDirtyPagesWaitForTheFsync) {
  ASSERT_NO_FATAL_FAILURE(start(64 << 20, 128 << 20, 60s, 0));
  const auto data = write_and_overwrite_64_pages(f);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(c->cache().bytes_written_out, 0u);
  EXPECT_EQ(c->cache().dirty_bytes, data.size());
  ASSERT_TRUE(f.fsync().wait());
  EXPECT_EQ(c->cache().bytes_written_out, data.size()) << "each page once: the overwrites merged";
  EXPECT_EQ(on_disk(path, 0, data.size()), data);
}

// At the hard limit a write that touches no cached page goes straight to the file.
TEST_F(AioCache, TheHardLimitBypassesTheCache) {
  ASSERT_NO_FATAL_FAILURE(start(4096, 8192, 60s));
  const auto data = pattern(65536, 6);
  ASSERT_TRUE(f.write(0, data).wait());
  EXPECT_EQ(c->cache().writes_bypassed, 1u);
  EXPECT_EQ(c->cache().cached_bytes, 0u);
  EXPECT_EQ(on_disk(path, 0, data.size()), data) << "written through at once";
  std::vector<std::byte> back(data.size());
  EXPECT_EQ(f.read(0, back).wait().value_or(0), data.size());
  EXPECT_EQ(back, data);
}

// With no cached write for a round, each round writes out and drops half of what is cached.
TEST_F(AioCache, IdleRoundsHalveTheCache) {
  ASSERT_NO_FATAL_FAILURE(start(64 << 20, 64 << 20, 150ms));
  const auto data = pattern(64 * detail::page_size, 7);
  ASSERT_TRUE(f.write(0, data).wait());
  std::vector<std::size_t> seen{c->cache().cached_bytes};
  ASSERT_TRUE(eventually([&] {
    const std::size_t now = c->cache().cached_bytes;
    if (now != seen.back()) seen.push_back(now);
    return now == 0;
  }));
  // 64 pages: 32, 16, 8, 4, 2, 1, 0. Rounds are 150 ms apart, so this thread sees nearly
  // every step; one preempted for a while (a loaded machine: make test runs the torture and
  // kv tests beside this one) misses some. A round writes its half out page by page, so a
  // slow one (seen under ThreadSanitizer: 64 pages, then 38, then 32) shows values between
  // two halves too; and a round can come while the write is still being cached (seen: 15
  // pages, then 8, 4, 2, 1, 0): the values before the first half are not rounds' work. What
  // must hold: from the first half on, the cache only shrinks, and it rests at several of
  // the halves on its way to nothing (dropped at once: none).
  std::vector<std::size_t> halves;
  for (std::size_t pages = 64; pages != 0; pages /= 2)
    halves.push_back(pages * detail::page_size);
  halves.push_back(0);
  std::size_t from = 0;
  while (from < seen.size() && std::ranges::find(halves, seen[from]) == halves.end())
    ++from;
  ASSERT_LT(from, seen.size());
  std::size_t rests = 0;
  for (std::size_t i = from; i < seen.size(); ++i) {
    if (i > from) {
      EXPECT_LT(seen[i], seen[i - 1]) << "the cache grew while idle";
    }
    if (std::ranges::find(halves, seen[i]) != halves.end()) ++rests;
  }
  EXPECT_GE(rests, 4u) << "dropped at once, not halved round by round";
  EXPECT_EQ(on_disk(path, 0, data.size()), data);
}

// A write-out that fails (here: ENOSPC from /dev/full) is reported by the next fsync and,
// as the bytes are still not in the file, again by close.
TEST(AioCacheErrors, AFailedWriteOutIsReportedByFsyncAndClose) {
  if (::access("/dev/full", W_OK) != 0) GTEST_SKIP() << "no writable /dev/full here";
  auto c = start_cached(1 << 20, 4 << 20, 60s);
  ASSERT_TRUE(c);
  open_options how;
  how.write = true;
  how.cache = true;
  auto f = c->open("/dev/full", how);
  ASSERT_TRUE(f) << f.error().message();
  const auto data = pattern(5000, 8);
  EXPECT_TRUE(f->write(0, data).wait()) << "cached: no I/O yet";
  auto s = f->fsync().wait();
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), std::errc::no_space_on_device);
  auto closed = f->close();
  ASSERT_FALSE(closed);
  EXPECT_EQ(closed.error(), std::errc::no_space_on_device);
}

// Stopping the controller writes the cached bytes out (the file stays open).
TEST_F(AioCache, StopWritesEverythingOut) {
  ASSERT_NO_FATAL_FAILURE(start(1 << 20, 4 << 20, 60s));
  const auto data = pattern(30000, 9);
  ASSERT_TRUE(f.write(100, data).wait());
  c->stop();
  EXPECT_EQ(on_disk(path, 100, data.size()), data);
  EXPECT_TRUE(f.close());
}

// A task sees the cached bytes in the file: they are written out before it runs.
TEST_F(AioCache, TasksSeeCachedWritesInTheFile) {
  ASSERT_NO_FATAL_FAILURE(start(1 << 20, 4 << 20, 60s));
  const auto data = pattern(6000, 10);
  ASSERT_TRUE(f.write(0, data).wait());
  auto r = f.submit([&]() -> result<std::size_t> { return on_disk(path, 0, 6000).size(); });
  EXPECT_EQ(r.wait().value_or(0), data.size());
}

TEST(AioCacheErrors, BadSettingsAreRefused) {
  options o;
  o.cache_soft_limit = 2 << 20;
  o.cache_hard_limit = 1 << 20;
  auto c = controller::start(o);
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error(), std::errc::invalid_argument);
}

// A file written once, front to back, in writes of whole pages: nothing comes back to what
// the cache holds, so after 32 cached writes it steps aside; when the writes start to come
// back to what was just written (each overwritten at once), it takes them again within 32
// writes.
TEST_F(AioCache, StepsAsideWhereNothingIsMerged) {
  ASSERT_NO_FATAL_FAILURE(start(64 << 20, 64 << 20, 60s));
  const auto data = pattern(16384, 9);
  for (std::uint64_t i = 0; i < 320; ++i)
    ASSERT_TRUE(f.write(i * data.size(), data).wait());
  EXPECT_EQ(c->cache().writes_cached, 32u);
  EXPECT_EQ(c->cache().writes_bypassed, 288u);
  ASSERT_TRUE(f.fsync().wait());
  for (std::uint64_t i = 0; i < 320; i += 37)
    EXPECT_EQ(on_disk(path, i * data.size(), data.size()), data) << i;

  // Overwritten at once: half the writes come back.
  const auto again = pattern(16384, 10);
  const std::uint64_t base = 320 * data.size();
  for (std::uint64_t i = 0; i < 200; ++i) {
    ASSERT_TRUE(f.write(base + i * again.size(), again).wait());
    ASSERT_TRUE(f.write(base + i * again.size(), again).wait());
  }
  const cache_stats st = c->cache();
  EXPECT_GE(st.writes_cached, 32u + 400u - 32u) << "the overwrites are cached again";
  ASSERT_TRUE(f.close());
  for (std::uint64_t i = 0; i < 200; i += 23)
    EXPECT_EQ(on_disk(path, base + i * again.size(), again.size()), again) << i;
}

// Why O_DIRECT cannot be used in `dir` (tmpfs before Linux 6.6), or empty.
std::string no_direct_io(const temp_dir& dir) {
  const std::string path = dir.file("direct-probe");
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
  const int e = errno;
  ::unlink(path.c_str());
  if (fd >= 0) {
    ::close(fd);
    return {};
  }
  return std::string("O_DIRECT is refused here: ") + std::strerror(e);
}

// "Buffered direct I/O": the cache in front of an O_DIRECT file. A write and its overwrite
// merge in the pages (one write-out), reads of cached bytes come from memory, and the
// write-out goes straight from the pages, aligned (else O_DIRECT would refuse it: EINVAL),
// also for the smallest aligned write, which fills part of a page.
TEST(AioCacheDirect, OverwritesMergeAndGoOutAligned) {
  temp_dir dir;
  if (const auto why = no_direct_io(dir); !why.empty()) GTEST_SKIP() << why;
  for (const auto e : {engine_kind::io_uring, engine_kind::posix}) {
    options o;
    o.engine = e;
    o.cache_idle_round = 60s;
    auto started = controller::start(o);
    if (!started) continue;  // io_uring forbidden here: posix still runs
    auto& c = *started;
    const std::string path = dir.file(std::string("direct-") + std::string(to_string(e)));
    file f = open_cached(*c, path, true);
    ASSERT_TRUE(f.is_open());
    const std::size_t align = f.alignment();
    ASSERT_LE(align, detail::page_size);
    auto* raw = static_cast<std::byte*>(std::aligned_alloc(4096, 3 * 65536));
    ASSERT_NE(raw, nullptr);
    const std::unique_ptr<std::byte, decltype(&std::free)> hold(raw, &std::free);
    const std::span first(raw, 65536);
    const std::span second(raw + 65536, 65536);
    const std::span back(raw + 2 * 65536, 65536);
    const auto a = pattern(65536, 11);
    const auto b = pattern(65536, 12);
    std::memcpy(first.data(), a.data(), a.size());
    std::memcpy(second.data(), b.data(), b.size());
    ASSERT_EQ(f.write(0, first).wait().value_or(0), 65536u);
    ASSERT_EQ(f.write(0, second).wait().value_or(0), 65536u);  // overwrites it
    // The smallest aligned write, in a page of its own.
    ASSERT_EQ(f.write(65536 + align, std::span(second.data(), align)).wait().value_or(0), align);
    EXPECT_EQ(c->cache().writes_cached, 3u);
    ASSERT_EQ(f.read(0, back).wait().value_or(0), 65536u);
    EXPECT_EQ(std::memcmp(back.data(), b.data(), b.size()), 0);
    EXPECT_EQ(c->cache().reads_served, 1u);
    auto synced = f.fsync().wait();
    ASSERT_TRUE(synced) << synced.error().message();
    EXPECT_EQ(c->cache().bytes_written_out, 65536u + align) << "the overwrite merged";
    EXPECT_EQ(on_disk(path, 0, 65536), b);
    EXPECT_EQ(c->cache().cached_bytes, 65536u + detail::page_size)
        << "an O_DIRECT file's written pages stay, clean, for reads";
    ASSERT_EQ(f.read(0, back).wait().value_or(0), 65536u);
    EXPECT_EQ(std::memcmp(back.data(), b.data(), b.size()), 0);
    EXPECT_EQ(c->cache().reads_served, 2u) << "from the pages";
    EXPECT_EQ(on_disk(path, 65536 + align, align),
              std::vector<std::byte>(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(align)));
    EXPECT_EQ(on_disk(path, 65536, align), std::vector<std::byte>(align)) << "untouched: zeros";
    ASSERT_TRUE(f.close());
  }
}

// An O_DIRECT file's written pages stay, clean, for reads; over the soft limit a write's new
// pages reuse the oldest clean ones. Random aligned writes, reads and fsyncs through a cache
// far smaller than the file: every read sees exactly the earlier writes, and so does the file.
TEST(AioCacheDirect, ReusedPagesNeverLoseOrStaleAByte) {
  temp_dir dir;
  if (const auto why = no_direct_io(dir); !why.empty()) GTEST_SKIP() << why;
  auto c = start_cached(64 * 1024, 512 * 1024, 60s);
  ASSERT_TRUE(c);
  const std::string path = dir.file("direct-model");
  file f = open_cached(*c, path, true);
  ASSERT_TRUE(f.is_open());
  constexpr std::size_t size = 1 << 20;
  constexpr std::size_t unit = detail::page_size;  // a multiple of any O_DIRECT alignment
  ASSERT_EQ(size % f.alignment(), 0u);
  ASSERT_EQ(::truncate(path.c_str(), size), 0);
  std::vector<std::byte> model(size);
  auto* raw = static_cast<std::byte*>(std::aligned_alloc(unit, 16 * unit));
  ASSERT_NE(raw, nullptr);
  const std::unique_ptr<std::byte, decltype(&std::free)> hold(raw, &std::free);
  std::mt19937_64 rng(17);
  int bad_reads = 0;
  for (int i = 0; i < 3000; ++i) {
    const std::size_t len = unit * (1 + rng() % 16);
    const std::size_t off = unit * (rng() % ((size - len) / unit + 1));
    const unsigned what = static_cast<unsigned>(rng() % 10);
    const std::span buf(raw, len);
    if (what < 5) {
      for (auto& b : buf)
        b = static_cast<std::byte>(rng());
      std::memcpy(model.data() + off, raw, len);
      ASSERT_EQ(f.write(off, buf).wait().value_or(0), len);
    } else if (what < 9) {
      ASSERT_EQ(f.read(off, buf).wait().value_or(0), len);
      if (std::memcmp(raw, model.data() + off, len) != 0) ++bad_reads;
    } else {
      ASSERT_TRUE(f.fsync().wait());  // its pages clean: the next writes may reuse them
    }
  }
  EXPECT_EQ(bad_reads, 0);
  ASSERT_TRUE(f.close());
  EXPECT_EQ(on_disk(path, 0, size), model);
}

}  // namespace
}  // namespace keel::aio
