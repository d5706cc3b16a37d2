// keel::aio through the seam: with options::fs a fault_filesystem, the posix engine's reads,
// writes and fsyncs and the write-back cache's write-outs go through it, so the faults it
// injects come back in the receipts, fsyncs and closes they belong to, once, never lost.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "keel/aio/controller.hpp"
#include "keel/aio/errors.hpp"
#include "keel/io/fault_filesystem.hpp"
#include "keel/io/file_handle.hpp"
#include "support/process.hpp"

namespace keel::aio {
namespace {

using namespace std::chrono_literals;
using fault = io::fault_filesystem::fault;
using io::fs_op;
using test::temp_dir;

// KEEL_AIO_ENGINE overrides every choice: an engine that cannot go through the seam makes
// these tests meaningless (and the controller refuses to start).
bool engine_forced_around_the_seam() {
  const char* env = std::getenv("KEEL_AIO_ENGINE");
  if (env == nullptr || *env == '\0') return false;
  return std::string(env) != "posix";
}

#define SKIP_IF_ENGINE_FORCED()                                                         \
  if (engine_forced_around_the_seam()) {                                                \
    GTEST_SKIP() << "KEEL_AIO_ENGINE=" << std::getenv("KEEL_AIO_ENGINE")                \
                 << " forces an engine that does not run requests through options::fs"; \
  }

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<std::byte>((i * 131 + seed * 17) & 0xff);
  return v;
}

std::vector<std::byte> on_disk(const std::string& path) {
  auto h = io::file_handle::open(path.c_str(), io::open_flags::read);
  if (!h) return {};
  std::vector<std::byte> out(static_cast<std::size_t>(h->size().value_or(0)));
  if (!h->read_at(0, out)) return {};
  return out;
}

struct through_faults {
  temp_dir dir;
  std::string path = dir.file("data");
  io::fault_filesystem fs;
  std::unique_ptr<controller> c;
  file f;

  // A controller with `fs` as its filesystem and one worker (requests run one at a time,
  // so "the n-th write" is a request the test can name), and `path` opened through it.
  void start(bool cache = false, std::size_t soft = 1 << 20, std::chrono::milliseconds idle = 60s) {
    options o;
    o.fs = &fs;
    o.workers = 1;
    o.cache_soft_limit = soft;
    o.cache_hard_limit = 4 << 20;
    o.cache_idle_round = idle;
    auto started = controller::start(o);
    ASSERT_TRUE(started) << started.error().message();
    c = std::move(*started);
    ASSERT_EQ(c->engine(), engine_kind::posix);
    open_options how;
    how.write = true;
    how.create = true;
    how.cache = cache;
    auto opened = c->open(path, how);
    ASSERT_TRUE(opened) << opened.error().message();
    f = std::move(*opened);
  }
};

class AioFaults : public ::testing::Test, protected through_faults {
 protected:
  void SetUp() override { SKIP_IF_ENGINE_FORCED(); }
};

// Any filesystem but the OS's makes posix the default (io_uring would go around it) and
// says why; io_uring and stdio are refused outright rather than silently bypassing it.
TEST_F(AioFaults, AnotherFilesystemMeansThePosixEngine) {
  if (std::getenv("KEEL_AIO_ENGINE") != nullptr) GTEST_SKIP() << "KEEL_AIO_ENGINE is set";
  options o;
  o.fs = &fs;
  auto c1 = controller::start(o);
  ASSERT_TRUE(c1) << c1.error().message();
  EXPECT_EQ((*c1)->engine(), engine_kind::posix);
  EXPECT_NE((*c1)->fallback_reason().find("options::fs"), std::string::npos)
      << (*c1)->fallback_reason();
  for (const auto k : {engine_kind::io_uring, engine_kind::stdio}) {
    o.engine = k;
    auto refused = controller::start(o);
    ASSERT_FALSE(refused) << to_string(k);
    EXPECT_EQ(refused.error(), errc::not_supported_by_engine) << to_string(k);
  }
  o.engine = engine_kind::posix;
  EXPECT_TRUE(controller::start(o));
  o.fs = &io::os();
  o.engine.reset();
  auto plain = controller::start(o);
  ASSERT_TRUE(plain);
  EXPECT_TRUE((*plain)->fallback_reason().find("options::fs") == std::string::npos);
}

// Files are opened through the filesystem: a failed open is controller::open's error.
TEST_F(AioFaults, AFailedOpenIsOpensError) {
  ASSERT_NO_FATAL_FAILURE(start());
  fs.inject({.on = fs_op::open, .nth = 1, .error = EACCES});
  open_options how;
  how.write = true;
  how.create = true;
  auto g = c->open(dir.file("other"), how);
  ASSERT_FALSE(g);
  EXPECT_EQ(g.error(), std::errc::permission_denied);
}

// The third write fails with EIO: that request's receipt (and completion) says so and names
// the file; the others succeed and their bytes are in the file.
TEST_F(AioFaults, TheThirdWriteFailsInItsOwnReceipt) {
  ASSERT_NO_FATAL_FAILURE(start());
  fs.inject({.on = fs_op::write, .nth = 3, .error = EIO});
  constexpr std::size_t block = 4096;
  std::vector<std::vector<std::byte>> data;
  std::vector<receipt> rs;
  std::vector<int> seen(5, 0);
  for (unsigned i = 0; i < 5; ++i) {
    data.push_back(pattern(block, i + 1));
    // One at a time: the n-th write of the filesystem is the n-th request.
    rs.push_back(f.write(i * block, data.back(), [&seen, i](const result<std::size_t>& r) {
      seen[i] = r ? 1 : -r.error().value();
    }));
    (void)rs.back().wait();
  }
  for (unsigned i = 0; i < 5; ++i) {
    auto r = rs[i].wait();
    if (i == 2) {
      ASSERT_FALSE(r);
      EXPECT_EQ(r.error(), std::errc::io_error);
      EXPECT_EQ(r.error().path(), path) << r.error().message();
      EXPECT_EQ(seen[i], -EIO);
    } else {
      ASSERT_TRUE(r) << i << ": " << r.error().message();
      EXPECT_EQ(*r, block);
      EXPECT_EQ(seen[i], 1);
    }
  }
  const auto disk = on_disk(path);
  ASSERT_EQ(disk.size(), 5 * block);
  for (unsigned i = 0; i < 5; ++i) {
    const std::vector<std::byte> got(disk.begin() + i * block, disk.begin() + (i + 1) * block);
    if (i == 2) {
      EXPECT_EQ(got, std::vector<std::byte>(block)) << "the failed write left a hole";
    } else {
      EXPECT_EQ(got, data[i]) << "block " << i;
    }
  }
  EXPECT_EQ(fs.injected(), 1u);
}

// In a batch of overlapping writes (run in order, one after another), the third fails and
// only its receipt says so; the fourth and fifth still run, and the last one wins.
TEST_F(AioFaults, AFailedWriteInABatchFailsOnlyItsReceipt) {
  ASSERT_NO_FATAL_FAILURE(start());
  fs.inject({.on = fs_op::write, .nth = 3, .error = EIO});
  std::vector<std::vector<std::byte>> data;
  std::vector<request> batch(5);
  for (unsigned i = 0; i < 5; ++i) {
    data.push_back(pattern(8192, 10 + i));
    batch[i].what = request::kind::write;
    batch[i].offset = 0;
    batch[i].buffer = data.back();
  }
  std::vector<receipt> out(5);
  f.submit(batch, out);
  for (unsigned i = 0; i < 5; ++i) {
    auto r = out[i].wait();
    EXPECT_EQ(static_cast<bool>(r), i != 2) << i;
    if (!r) {
      EXPECT_EQ(r.error(), std::errc::io_error);
    }
  }
  EXPECT_EQ(on_disk(path), data[4]);
}

// A write the device takes only part of before it fills up: ENOSPC in the receipt (never a
// success), and no more than the part in the file.
TEST_F(AioFaults, AShortWriteOnAFullDeviceReportsEnospc) {
  ASSERT_NO_FATAL_FAILURE(start());
  fs.inject({.on = fs_op::write, .nth = 1, .error = ENOSPC, .partial = true});
  const auto data = pattern(64 * 1024, 3);
  auto r = f.write(0, data).wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), std::errc::no_space_on_device);
  const auto disk = on_disk(path);
  EXPECT_LT(disk.size(), data.size());
  EXPECT_TRUE(std::equal(disk.begin(), disk.end(), data.begin())) << "a prefix, if anything";
  fs.clear_faults();
  EXPECT_TRUE(f.write(0, data).wait()) << "the device has room again";
  EXPECT_EQ(on_disk(path), data);
}

// Short transfers without an error are continued until done: every byte written and read.
TEST_F(AioFaults, ShortTransfersAreContinued) {
  ASSERT_NO_FATAL_FAILURE(start());
  fs.inject({.on = io::fs_ops(fs_op::write) | fs_op::read,
             .nth = 1,
             .repeat = fault::repeat::forever,
             .error = 0,
             .partial = true});
  const auto data = pattern(100 * 1000, 4);
  auto w = f.write(0, data).wait();
  ASSERT_TRUE(w) << w.error().message();
  EXPECT_EQ(*w, data.size());
  std::vector<std::byte> back(data.size());
  auto r = f.read(0, back).wait();
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_EQ(*r, data.size());
  EXPECT_EQ(back, data);
  EXPECT_GT(fs.count(io::fs_ops(fs_op::write) | fs_op::read), 4u) << "it took several calls";
}

TEST_F(AioFaults, AFailedReadIsItsReceiptsError) {
  ASSERT_NO_FATAL_FAILURE(start());
  const auto data = pattern(4096, 5);
  ASSERT_TRUE(f.write(0, data).wait());
  fs.inject({.on = fs_op::read, .nth = 1, .error = EIO});
  std::vector<std::byte> back(4096);
  auto r = f.read(0, back).wait();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), std::errc::io_error);
  EXPECT_TRUE(f.read(0, back).wait()) << "once";
  EXPECT_EQ(back, data);
}

// The second fsync fails: reported by that fsync, once, and never retried (the filesystem
// saw exactly one sync per request).
TEST_F(AioFaults, AFailedFsyncIsReportedOnceAndNeverRetried) {
  ASSERT_NO_FATAL_FAILURE(start());
  fs.inject({.on = fs_op::sync, .nth = 2, .error = EIO});
  const auto data = pattern(4096, 6);
  ASSERT_TRUE(f.write(0, data).wait());
  EXPECT_TRUE(f.fsync().wait());
  ASSERT_TRUE(f.write(4096, data).wait());
  auto failed = f.fdatasync().wait();
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error(), std::errc::io_error);
  EXPECT_TRUE(f.fsync().wait()) << "reported once";
  EXPECT_EQ(fs.count(fs_op::sync), 3u) << "one sync per request: none retried";
  EXPECT_TRUE(f.close());
}

// ---- the write-back cache writes out through the same seam ----

// A write-out that fails is the next fsync's error, once: the bytes stay cached and dirty,
// so the fsync after writes them out and succeeds.
TEST_F(AioFaults, ACacheWriteOutThatFailsIsTheNextFsyncsError) {
  ASSERT_NO_FATAL_FAILURE(start(true));
  const auto data = pattern(20000, 7);
  ASSERT_TRUE(f.write(0, data).wait()) << "cached: nothing written yet";
  EXPECT_EQ(fs.count(fs_op::write), 0u);
  fs.inject({.on = fs_op::write, .nth = 1, .error = EIO});
  auto s = f.fsync().wait();
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), std::errc::io_error);
  EXPECT_EQ(fs.count(fs_op::sync), 0u) << "no fsync after a failed write-out";
  EXPECT_TRUE(f.fsync().wait()) << "reported once; the pages went out this time";
  EXPECT_EQ(on_disk(path), data);
  EXPECT_TRUE(f.close());
}

// At the hard limit the cache stops growing, also under appends that each begin in the page
// the previous one ended in (a write that touches a cached page stayed in the cache whole,
// so these never left it), with every write to the file failing: past the limit the appends
// go to the file, where they fail in their own receipts.
TEST_F(AioFaults, TheHardLimitHoldsForAppendsThatTouchTheLastPage) {
  ASSERT_NO_FATAL_FAILURE(start(true, 1 << 20, 60s));
  fs.inject({.on = fs_op::write, .nth = 1, .repeat = fault::repeat::forever, .error = EIO});
  const auto data = pattern(4095, 9);
  std::size_t most = 0;
  std::size_t failed = 0;
  for (std::uint64_t at = 0; at < (std::uint64_t{12} << 20); at += data.size()) {
    const auto w = f.write(at, data).wait();
    if (!w) {
      EXPECT_EQ(w.error(), std::errc::io_error);
      ++failed;
    }
    most = std::max(most, c->cache().cached_bytes);
  }
  EXPECT_LE(most, (std::size_t{4} << 20) + 2 * 4096) << "the hard limit is 4 MiB";
  EXPECT_GT(failed, 0u) << "past the limit, appends reach the (failing) file";
  EXPECT_FALSE(f.fsync().wait()) << "the cached pages could not go out either";
}

// The flusher's write-out fails in the background (the soft limit is tiny): nobody waits for
// it, so the next fsync reports it, even though a later write-out got the bytes there.
TEST_F(AioFaults, AFlushersFailedWriteOutWaitsForTheNextFsync) {
  ASSERT_NO_FATAL_FAILURE(start(true, 4096, 5ms));
  fs.inject({.on = fs_op::write, .nth = 1, .error = EIO});
  const auto data = pattern(64 * 1024, 8);
  ASSERT_TRUE(f.write(0, data).wait());
  for (int i = 0; i < 500 && fs.injected() == 0; ++i)
    std::this_thread::sleep_for(10ms);
  ASSERT_EQ(fs.injected(), 1u) << "the flusher never wrote out";
  auto s = f.fsync().wait();
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), std::errc::io_error);
  EXPECT_TRUE(f.fsync().wait()) << "once";
  EXPECT_EQ(on_disk(path), data);
}

// A write-out that keeps failing is close's error: close never drops cached bytes silently.
TEST_F(AioFaults, ACacheWriteOutThatFailsIsClosesError) {
  ASSERT_NO_FATAL_FAILURE(start(true));
  ASSERT_TRUE(f.write(0, pattern(5000, 9)).wait());
  fs.inject({.on = fs_op::write, .nth = 1, .repeat = fault::repeat::forever, .error = EIO});
  auto closed = f.close();
  ASSERT_FALSE(closed);
  EXPECT_EQ(closed.error(), std::errc::io_error);
  EXPECT_FALSE(f.is_open());
}

// With the cache, a failed fsync (after a good write-out) is reported once, not retried.
TEST_F(AioFaults, ACachedFilesFailedFsyncIsReportedOnce) {
  ASSERT_NO_FATAL_FAILURE(start(true));
  fs.inject({.on = fs_op::sync, .nth = 1, .error = EIO});
  ASSERT_TRUE(f.write(0, pattern(5000, 10)).wait());
  auto s = f.fsync().wait();
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), std::errc::io_error);
  EXPECT_EQ(fs.count(fs_op::write), 1u) << "the write-out went through the seam";
  EXPECT_TRUE(f.fsync().wait());
  EXPECT_EQ(fs.count(fs_op::sync), 2u);
}

}  // namespace
}  // namespace keel::aio
