// keel::aio: the per-thread ordering promise checked against an in-memory model on every
// engine, the io_uring fallback, bad input, and stopping with work in flight.

#include "keel/aio/controller.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <csignal>

#include <atomic>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "aio_support.hpp"
#include "keel/aio/errors.hpp"
#include "support/process.hpp"
#include "support/seccomp.hpp"

namespace keel::aio {
namespace {

using namespace std::chrono_literals;
using test::temp_dir;
using test_support::descriptor_of;
using test_support::ends_on_its_own;
using test_support::expect_ends_in_a_child;
using test_support::hold_until;
using test_support::one_worker;
using test_support::open_rw;
using test_support::unavailable;
using test_support::workers_forced_away;

std::unique_ptr<controller> start_engine(engine_kind k, unsigned workers = 2) {
  options o;
  o.engine = k;
  o.workers = workers;
  auto c = controller::start(o);
  if (!c) {
    ADD_FAILURE() << "start " << to_string(k) << ": " << c.error().message();
    return nullptr;
  }
  EXPECT_EQ((*c)->engine(), k);
  return std::move(*c);
}

// The engine a test of behaviour every engine shares runs on: the one KEEL_AIO_ENGINE
// forces, else io_uring where it works, else posix.
engine_kind engine_here() {
  if (const char* env = std::getenv("KEEL_AIO_ENGINE"); env != nullptr && *env != '\0') {
    if (auto k = engine_from_string(env); k) return *k;
  }
  return unavailable(engine_kind::io_uring).empty() ? engine_kind::io_uring : engine_kind::posix;
}

std::vector<std::byte> read_whole(const std::string& path) {
  std::vector<std::byte> out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  std::byte buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  ::close(fd);
  return out;
}

// How the model test uses the write-back cache: not at all, with room for the whole file,
// or with limits so tight that writes bypass it and the flusher runs all the time.
enum class cache_mode { off, roomy, tight };
const char* to_string(cache_mode m) {
  return m == cache_mode::off ? "NoCache" : m == cache_mode::roomy ? "Cache" : "TightCache";
}

class EngineModel : public ::testing::TestWithParam<std::tuple<engine_kind, cache_mode>> {};

// Several threads, each in its own slice of one file, submit random overlapping reads and
// writes, fsyncs, batches and tasks without waiting (up to 48 in flight each). Each read must
// return exactly what the thread's model held when the read was submitted (every earlier
// write seen, no later one), each task sees the same through plain pread, and the final
// file is the union of the models.
TEST_P(EngineModel, EveryReadSeesExactlyTheEarlierWritesOfItsThread) {
  KEEL_NEED_ENGINE(std::get<0>(GetParam()));
  temp_dir dir;
  const std::string path = dir.file("model");
  const auto [engine, mode] = GetParam();
  options o;
  o.engine = engine;
  if (mode == cache_mode::tight) {
    o.cache_soft_limit = 16 * 1024;
    o.cache_hard_limit = 64 * 1024;
    o.cache_idle_round = 2ms;
  }
  auto started = controller::start(o);
  ASSERT_TRUE(started) << started.error().message();
  auto& c = *started;
  open_options how;
  how.write = true;
  how.create = true;
  how.cache = mode != cache_mode::off;
  auto opened = c->open(path, how);
  ASSERT_TRUE(opened) << opened.error().message();
  file f = std::move(*opened);

  constexpr int threads = 4;
  constexpr std::size_t slice = 64 * 1024;
  constexpr int ops_per_thread = 600;
  // The whole file exists from the start (zeros), as the models do.
  ASSERT_EQ(::truncate(path.c_str(), threads * slice), 0);
  std::atomic<int> bad_reads{0}, bad_tasks{0}, errors{0};
  std::vector<std::vector<std::byte>> models(threads, std::vector<std::byte>(slice));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::mt19937_64 rng(0x6b65656c + t);
      std::vector<std::byte>& model = models[t];
      const std::uint64_t base = static_cast<std::uint64_t>(t) * slice;
      struct pending {
        receipt r;
        std::vector<std::byte> buf;       // what a write writes / where a read reads into
        std::vector<std::byte> expected;  // a read's model snapshot
        bool is_read = false;
      };
      std::deque<pending> window;
      const auto retire = [&](pending& p) {
        auto n = p.r.wait();
        if (!n) {
          ++errors;
          return;
        }
        if (p.is_read &&
            (*n != p.expected.size() || std::memcmp(p.buf.data(), p.expected.data(), *n) != 0)) {
          ++bad_reads;
        }
      };
      for (int i = 0; i < ops_per_thread; ++i) {
        const auto off = static_cast<std::size_t>(rng() % (slice - 1));
        const auto len =
            static_cast<std::size_t>(1 + rng() % std::min<std::size_t>(8192, slice - off));
        const unsigned what = static_cast<unsigned>(rng() % 20);
        pending p;
        if (what < 9) {  // write
          p.buf.resize(len);
          for (auto& b : p.buf)
            b = static_cast<std::byte>(rng());
          std::memcpy(model.data() + off, p.buf.data(), len);
          p.r = f.write(base + off, p.buf);
        } else if (what < 17) {  // read
          p.is_read = true;
          p.buf.resize(len);
          p.expected.assign(model.begin() + static_cast<std::ptrdiff_t>(off),
                            model.begin() + static_cast<std::ptrdiff_t>(off + len));
          p.r = f.read(base + off, p.buf);
        } else if (what < 18) {
          p.r = i % 2 ? f.fsync() : f.fdatasync();
        } else if (what < 19) {  // a task: runs between the earlier and the later requests
          std::vector<std::byte> snapshot(model.begin(), model.end());
          const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
          p.r = f.submit(
              [&bad_tasks, fd, base, snapshot = std::move(snapshot)]() -> result<std::size_t> {
                std::vector<std::byte> now(snapshot.size());
                const ssize_t n = ::pread(fd, now.data(), now.size(), static_cast<off_t>(base));
                ::close(fd);
                if (n != static_cast<ssize_t>(now.size()) || now != snapshot) ++bad_tasks;
                return 0;
              });
        } else {  // a batch: a write, then a read of what it wrote, then maybe an fsync
          pending w;
          w.buf.resize(len);
          for (auto& b : w.buf)
            b = static_cast<std::byte>(rng());
          std::memcpy(model.data() + off, w.buf.data(), len);
          p.is_read = true;
          p.buf.resize(len);
          p.expected = w.buf;
          request reqs[3];
          reqs[0].what = request::kind::write;
          reqs[0].offset = base + off;
          reqs[0].buffer = w.buf;
          reqs[1].what = request::kind::read;
          reqs[1].offset = base + off;
          reqs[1].buffer = p.buf;
          reqs[2].what = request::kind::fdatasync;
          const std::size_t n = rng() % 2 == 0 ? 2 : 3;
          receipt out[3];
          f.submit(std::span(reqs, n), std::span(out, n));
          w.r = out[0];
          p.r = out[1];
          window.push_back(std::move(w));
          if (n == 3) window.push_back(pending{out[2], {}, {}, false});
        }
        window.push_back(std::move(p));
        while (window.size() > 48) {
          retire(window.front());
          window.pop_front();
        }
      }
      for (auto& p : window)
        retire(p);
    });
  }
  for (auto& t : pool)
    t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(bad_reads.load(), 0);
  EXPECT_EQ(bad_tasks.load(), 0);
  // The cache did take part: it served reads, and at tight limits it was bypassed and wrote
  // out pages on its own.
  const cache_stats st = c->cache();
  if (mode != cache_mode::off) {
    EXPECT_GT(st.writes_cached, 0u);
    EXPECT_GT(st.reads_served, 0u);
    EXPECT_GT(st.bytes_written_out, 0u);
  }
  if (mode == cache_mode::tight) {
    EXPECT_GT(st.writes_bypassed, 0u);
  }
  // io_uring ordered the batches' reads and fsyncs after their writes in its workers
  // (cached files submit a batch one by one).
  if (engine == engine_kind::io_uring && mode == cache_mode::off) {
    EXPECT_GT(c->engine_counts().requests_ordered_in_ring, 0u);
  }
  ASSERT_TRUE(f.close());
  EXPECT_EQ(c->cache().cached_bytes, 0u);
  const auto whole = read_whole(path);
  ASSERT_EQ(whole.size(), threads * slice);
  for (int t = 0; t < threads; ++t) {
    EXPECT_EQ(std::memcmp(whole.data() + t * slice, models[t].data(), slice), 0)
        << "slice of thread " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Engines, EngineModel,
    ::testing::Combine(::testing::Values(engine_kind::io_uring, engine_kind::posix,
                                         engine_kind::stdio),
                       ::testing::Values(cache_mode::off, cache_mode::roomy, cache_mode::tight)),
    [](const auto& p) {
      return std::string(to_string(std::get<0>(p.param))) + to_string(std::get<1>(p.param));
    });

// A batch longer than the ring (queue depth 4), each read following the write before it:
// the reads wait in the worker, the ring fills and empties many times. Every read still
// sees the write before it, the fsync comes last, and the engine says it ordered them.
TEST(AioChains, AChainLongerThanTheRingKeepsItsOrder) {
  KEEL_NEED_ENGINE(engine_kind::io_uring);
  temp_dir dir;
  const std::string path = dir.file("long-chain");
  options o;
  o.engine = engine_kind::io_uring;
  o.queue_depth = 4;
  auto started = controller::start(o);
  ASSERT_TRUE(started) << started.error().message();
  auto& c = *started;
  file f = open_rw(*c, path);
  constexpr int rounds = 20;
  constexpr std::size_t len = 4096;
  std::vector<std::vector<std::byte>> written(rounds, std::vector<std::byte>(len));
  std::vector<std::vector<std::byte>> read_back(rounds, std::vector<std::byte>(len));
  std::vector<request> reqs;
  for (int i = 0; i < rounds; ++i) {  // the same range over and over: each read its write
    std::memset(written[i].data(), i + 1, len);
    reqs.push_back({request::kind::write, 0, written[i], {}});
    reqs.push_back({request::kind::read, 0, read_back[i], {}});
  }
  reqs.push_back({request::kind::fsync, 0, {}, {}});
  std::vector<receipt> out(reqs.size());
  f.submit(reqs, out);
  for (std::size_t i = 0; i < out.size(); ++i) {
    auto n = out[i].wait();
    ASSERT_TRUE(n) << "request " << i << ": " << n.error().message();
  }
  for (int i = 0; i < rounds; ++i)
    EXPECT_EQ(read_back[i], written[i]) << "read " << i;
  EXPECT_EQ(read_whole(path), written.back());
  EXPECT_EQ(c->engine_counts().requests_ordered_in_ring, static_cast<std::uint64_t>(2 * rounds));
}

// A write of a chain comes back short (the file size limit) and its rest fails: the
// requests waiting for it in the worker still run when it has ended, as held-back ones
// would: the later write lands, the fsync reports its own result. In a child: the size
// limit is the process's.
TEST(AioChains, AFailedWriteLetsTheRequestsWaitingForItRun) {
  KEEL_NEED_ENGINE(engine_kind::io_uring);
  temp_dir dir;
  const std::string path = dir.file("broken-chain");
  const pid_t child = test::fork_child([&] {
    ::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{6000, 6000};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return test::cannot_set_up;
    options o;
    o.engine = engine_kind::io_uring;
    auto c = controller::start(o);
    if (!c) return 2;
    open_options how;
    how.write = true;
    how.create = true;
    auto f = (*c)->open(path, how);
    if (!f) return 3;
    std::vector<std::byte> a(4096, std::byte{'a'}), b(4096, std::byte{'b'}), z(100, std::byte{'z'});
    request reqs[] = {{request::kind::write, 0, a, {}},
                      {request::kind::write, 4096, b, {}},  // crosses the limit: short
                      {request::kind::write, 0, z, {}},     // must follow the first
                      {request::kind::fsync, 0, {}, {}}};
    receipt out[4];
    f->submit(reqs, out);
    if (out[0].wait().value_or(0) != 4096) return 4;
    auto big = out[1].wait();
    if (big || big.error() != std::errc::file_too_large) return 5;
    if (out[2].wait().value_or(0) != 100) return 6;
    if (!out[3].wait()) return 7;
    if ((*c)->engine_counts().requests_ordered_in_ring != 2) return 8;
    const auto whole = read_whole(path);
    if (whole.size() != 6000) return 9;
    for (std::size_t i = 0; i < whole.size(); ++i) {
      const char want = i < 100 ? 'z' : i < 4096 ? 'a' : 'b';
      if (whole[i] != static_cast<std::byte>(want)) return 10;
    }
    return 0;
  });
  const int code = test::wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot set a file size limit here";
  EXPECT_EQ(code, 0);
}

// io_uring requests go by the ring's table of registered files, and close lets go of the
// file: a flock taken on its descriptor is gone after close, as it would be without the
// ring (a ring still holding the file would keep the lock).
TEST(AioRegisteredFiles, RequestsUseThemAndCloseReallyCloses) {
  KEEL_NEED_ENGINE(engine_kind::io_uring);
  temp_dir dir;
  const std::string path = dir.file("registered");
  auto c = start_engine(engine_kind::io_uring);
  ASSERT_TRUE(c);
  file f = open_rw(*c, path);
  const std::byte data[4] = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  std::byte back[4] = {};
  ASSERT_EQ(f.write(0, data).wait().value_or(0), 4u);
  ASSERT_EQ(f.read(0, back).wait().value_or(0), 4u);
  EXPECT_EQ(std::memcmp(data, back, 4), 0);
  // The write may not go to the ring: a thread of keel's writes it where the kernel would
  // hand it to a thread of its own (ext4, tmpfs).
  const engine_stats st = c->engine_counts();
  EXPECT_GE(st.requests_on_registered_files, 1u);
  EXPECT_GE(st.requests_on_registered_files + st.buffered_writes_by_threads, 2u);
  const int fd = descriptor_of(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  ASSERT_TRUE(f.close());
  const int other = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(other, 0);
  EXPECT_EQ(::flock(other, LOCK_EX | LOCK_NB), 0) << "the lock outlived close: " << errno;
  ::close(other);
}

// More files open than the table has room for (a small RLIMIT_NOFILE at start makes it
// small), and indexes reused as files close: every request still reaches its own file.
TEST(AioRegisteredFiles, MoreFilesThanTheTableAndReusedIndexes) {
  KEEL_NEED_ENGINE(engine_kind::io_uring);
  temp_dir dir;
  const pid_t child = test::fork_child([&] {
    rlimit nofile{};
    if (::getrlimit(RLIMIT_NOFILE, &nofile) != 0 || nofile.rlim_max < 256) {
      return test::cannot_set_up;
    }
    const rlimit small{32, nofile.rlim_max};
    if (::setrlimit(RLIMIT_NOFILE, &small) != 0) return test::cannot_set_up;
    options o;
    o.engine = engine_kind::io_uring;
    auto c = controller::start(o);
    if (!c) return 2;
    const rlimit roomy{256, nofile.rlim_max};
    if (::setrlimit(RLIMIT_NOFILE, &roomy) != 0) return test::cannot_set_up;
    for (int round = 0; round < 3; ++round) {
      std::vector<file> files;
      for (int i = 0; i < 100; ++i) {  // the table holds fewer than 32
        open_options how;
        how.write = true;
        how.create = true;
        auto f = (*c)->open(dir.file("f" + std::to_string(i)), how);
        if (!f) return 3;
        files.push_back(std::move(*f));
      }
      for (int i = 0; i < 100; ++i) {
        const auto tag = static_cast<std::byte>(round * 100 + i);
        if (files[i]
                .write(static_cast<std::uint64_t>(round), std::span(&tag, 1))
                .wait()
                .value_or(0) != 1) {
          return 4;
        }
      }
      for (int i = 0; i < 100; ++i) {
        std::byte back{};
        if (files[i].read(static_cast<std::uint64_t>(round), std::span(&back, 1))
                    .wait()
                    .value_or(0) != 1 ||
            back != static_cast<std::byte>(round * 100 + i)) {
          return 5;
        }
      }
      for (auto& f : files) {
        if (!f.close()) return 6;
      }
    }
    const engine_stats st = (*c)->engine_counts();
    if (st.requests_on_registered_files == 0) return 7;
    return 0;
  });
  const int code = test::wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot change RLIMIT_NOFILE here";
  EXPECT_EQ(code, 0);
}

// A task on the worker that registered a file closes that file: the worker lets go of it
// on the spot (no waiting for itself), so the file is closed when close returns.
TEST(AioRegisteredFiles, ATaskOnTheWorkerMayCloseARegisteredFile) {
  KEEL_NEED_ENGINE(engine_kind::io_uring);
  temp_dir dir;
  auto c = start_engine(engine_kind::io_uring, 1);
  ASSERT_TRUE(c);
  file a = open_rw(*c, dir.file("a"));
  const std::string b_path = dir.file("b");
  file b = open_rw(*c, b_path);
  const std::byte one{1};
  ASSERT_EQ(b.write(0, std::span(&one, 1)).wait().value_or(0), 1u);
  const int fd = descriptor_of(b_path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  auto closed = a.submit([&b, &b_path]() -> result<std::size_t> {
    if (auto r = b.close(); !r) return std::unexpected(r.error());
    const int other = ::open(b_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (other < 0) return last_errno_error();
    const bool free = ::flock(other, LOCK_EX | LOCK_NB) == 0;
    ::close(other);
    return free ? 1 : 2;
  });
  auto r = closed.wait(10s);
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_EQ(*r, 1u);
  EXPECT_FALSE(b.is_open());
}

// Reads and writes whose buffers lie wholly inside a registered region go as
// READ_FIXED/WRITE_FIXED (counted exactly); one reaching past the region, or outside it,
// goes as a plain read; every byte lands where it should.
TEST(AioRegisteredBuffers, RequestsInsideARegionUseIt) {
  KEEL_NEED_ENGINE(engine_kind::io_uring);
  temp_dir dir;
  std::vector<std::byte> arena(64 * 1024);
  std::vector<std::byte> outside(4096);
  options o;
  o.engine = engine_kind::io_uring;
  o.registered_buffers = {std::span(arena).subspan(0, 32 * 1024)};
  auto started = controller::start(o);
  ASSERT_TRUE(started) << started.error().message();
  auto& c = *started;
  file f = open_rw(*c, dir.file("fixed"));
  for (std::size_t i = 0; i < 8192; ++i)
    arena[i] = static_cast<std::byte>(i * 7);
  ASSERT_EQ(f.write(0, std::span(arena).subspan(0, 8192)).wait().value_or(0), 8192u);
  ASSERT_EQ(f.read(0, std::span(arena).subspan(8192, 8192)).wait().value_or(0), 8192u);
  ASSERT_EQ(f.read(0, std::span(outside)).wait().value_or(0), 4096u);
  // Half inside the registered 32 KiB, half past its end.
  ASSERT_EQ(f.read(0, std::span(arena).subspan(28 * 1024, 8192)).wait().value_or(0), 8192u);
  EXPECT_EQ(c->engine_counts().requests_on_registered_buffers, 2u);
  EXPECT_EQ(std::memcmp(arena.data(), arena.data() + 8192, 8192), 0);
  EXPECT_EQ(std::memcmp(arena.data(), outside.data(), 4096), 0);
  EXPECT_EQ(std::memcmp(arena.data(), arena.data() + 28 * 1024, 8192), 0);
}

TEST(AioRegisteredBuffers, BadRegionsAreRefused) {
  KEEL_NEED_ENGINE(engine_kind::io_uring);
  std::vector<std::byte> arena(8192);
  options o;
  o.engine = engine_kind::io_uring;
  o.registered_buffers = {std::span(arena).subspan(0, 0)};
  EXPECT_EQ(controller::start(o).error(), std::errc::invalid_argument) << "empty";
  o.registered_buffers = {std::span(arena).subspan(0, 4096), std::span(arena).subspan(2048)};
  EXPECT_EQ(controller::start(o).error(), std::errc::invalid_argument) << "overlapping";
  const std::size_t big = (std::size_t{1} << 30) + 4096;  // address space only
  void* m = ::mmap(nullptr, big, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  o.registered_buffers = {std::span(static_cast<std::byte*>(m), big)};
  EXPECT_EQ(controller::start(o).error(), std::errc::invalid_argument) << "over 1 GiB";
  ::munmap(m, big);
}

// Where the rings cannot register the memory (over RLIMIT_MEMLOCK, without CAP_IPC_LOCK):
// io_uring asked for by name fails with the kernel's error, the default falls back to
// posix and says why, and works. In a child: the limit and capabilities are the process's.
TEST(AioRegisteredBuffers, MemoryThatCannotBeLockedFallsBackToPosix) {
  temp_dir dir;
  const std::string path = dir.file("memlock");
  const pid_t child = test::fork_child([&] {
    __user_cap_header_struct head{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct caps[2] = {};
    if (::syscall(SYS_capget, &head, caps) != 0) return test::cannot_set_up;
    caps[0].effective &= ~(1u << CAP_IPC_LOCK);
    caps[0].permitted &= ~(1u << CAP_IPC_LOCK);
    if (::syscall(SYS_capset, &head, caps) != 0) return test::cannot_set_up;
    const rlimit small{64 * 1024, 64 * 1024};
    if (::setrlimit(RLIMIT_MEMLOCK, &small) != 0) return test::cannot_set_up;
    ::unsetenv("KEEL_AIO_ENGINE");  // the defaults are what is tested
    std::vector<std::byte> arena(8 << 20);
    options o;
    o.registered_buffers = {std::span(arena)};
    o.engine = engine_kind::io_uring;
    auto forced = controller::start(o);
    if (forced) return 2;
    o.engine.reset();
    auto c = controller::start(o);
    if (!c || (*c)->engine() != engine_kind::posix) return 3;
    if ((*c)->fallback_reason().find("io_uring") == std::string::npos) return 4;
    file f = open_rw(**c, path);
    if (f.write(0, std::span(arena).subspan(0, 100)).wait().value_or(0) != 100) return 5;
    return 0;
  });
  const int code = test::wait_exit(child);
  if (code == test::cannot_set_up)
    GTEST_SKIP() << "cannot drop CAP_IPC_LOCK or lower RLIMIT_MEMLOCK";
  EXPECT_EQ(code, 0);
}

// The null engine does no I/O: every request completes at once with its length.
TEST(AioNull, CompletesEveryRequestWithItsLength) {
  KEEL_NEED_ENGINE(engine_kind::null);
  temp_dir dir;
  auto c = start_engine(engine_kind::null);
  ASSERT_TRUE(c);
  file f = open_rw(*c, dir.file("null"));
  std::vector<std::byte> buf(4096);
  std::vector<receipt> rs;
  for (int i = 0; i < 1000; ++i)
    rs.push_back(i % 2 ? f.write(static_cast<std::uint64_t>(i) * 4096, buf) : f.read(0, buf));
  for (auto& r : rs)
    EXPECT_EQ(r.wait().value_or(0), 4096u);
  EXPECT_EQ(f.fsync().wait().value_or(1), 0u);
}

TEST(Aio, EnvironmentVariableForcesTheEngine) {
  // The run's own setting (ctest under KEEL_AIO_ENGINE=...) is put back for the other tests.
  const char* run = std::getenv("KEEL_AIO_ENGINE");
  const std::string before = run != nullptr ? run : "";
  const auto restore = [&] {
    if (run != nullptr) {
      ::setenv("KEEL_AIO_ENGINE", before.c_str(), 1);
    } else {
      ::unsetenv("KEEL_AIO_ENGINE");
    }
  };
  ::setenv("KEEL_AIO_ENGINE", "posix", 1);
  auto c = controller::start();
  restore();
  ASSERT_TRUE(c);
  EXPECT_EQ((*c)->engine_name(), "posix");
  ::setenv("KEEL_AIO_ENGINE", "bogus", 1);
  auto bad = controller::start();
  restore();
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error(), std::errc::invalid_argument);
}

// io_uring forbidden the way seccomp forbids it: the default controller falls back to posix,
// says why, and works; asking for io_uring by name is an error.
TEST(Aio, FallsBackToPosixWhenIoUringIsForbidden) {
  temp_dir dir;
  const std::string path = dir.file("fallback");
  const pid_t child = test::fork_child([&] {
    if (!test::deny_io_uring()) return test::cannot_set_up;
    ::unsetenv("KEEL_AIO_ENGINE");  // the defaults are what is tested
    options forced;
    forced.engine = engine_kind::io_uring;
    auto no = controller::start(forced);
    if (no || no.error() != std::errc::operation_not_permitted) return 2;
    auto c = controller::start();
    if (!c || (*c)->engine() != engine_kind::posix) return 3;
    if ((*c)->fallback_reason().find("io_uring") == std::string::npos) return 4;
    open_options how;
    how.write = true;
    how.create = true;
    auto f = (*c)->open(path, how);
    if (!f) return 5;
    const std::byte data[3] = {std::byte{1}, std::byte{2}, std::byte{3}};
    std::byte back[3] = {};
    auto w = f->write(10, data);
    auto r = f->read(10, back);
    if (w.wait().value_or(0) != 3 || r.wait().value_or(0) != 3) return 6;
    return std::memcmp(data, back, 3) == 0 ? 0 : 7;
  });
  const int code = test::wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot install a seccomp filter here";
  EXPECT_EQ(code, 0);
}

TEST(Aio, ReadsPastTheEndReportWhatIsThere) {
  temp_dir dir;
  auto c = start_engine(engine_here());
  ASSERT_TRUE(c);
  file f = open_rw(*c, dir.file("short"));
  const std::vector<std::byte> data(100, std::byte{7});
  ASSERT_EQ(f.write(0, data).wait().value_or(0), 100u);
  std::vector<std::byte> back(4096);
  EXPECT_EQ(f.read(50, back).wait().value_or(999), 50u);
  EXPECT_EQ(f.read(500, back).wait().value_or(999), 0u);
}

TEST(Aio, BadRequestsAreRefusedWithClearErrors) {
  temp_dir dir;
  auto c = start_engine(engine_kind::posix);
  ASSERT_TRUE(c);
  file f = open_rw(*c, dir.file("bad"));
  std::vector<std::byte> buf(16);
  auto far = f.write(std::numeric_limits<std::uint64_t>::max() - 4, buf).wait();
  ASSERT_FALSE(far);
  EXPECT_EQ(far.error(), errc::bad_request);
  EXPECT_EQ(far.error(), std::errc::invalid_argument);
  auto null_buf = f.read(0, std::span<std::byte>(static_cast<std::byte*>(nullptr), 8)).wait();
  ASSERT_FALSE(null_buf);
  EXPECT_EQ(null_buf.error(), errc::bad_request);

  open_options ro;
  auto r = c->open(dir.file("bad"), ro);
  ASSERT_TRUE(r);
  auto w = r->write(0, buf).wait();
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error(), errc::not_opened_for);

  open_options nonsense;
  nonsense.create = true;  // without write
  EXPECT_EQ(c->open(dir.file("x"), nonsense).error(), std::errc::invalid_argument);
  EXPECT_EQ(c->open(dir.file("missing/file"), ro).error(), std::errc::no_such_file_or_directory);

  ASSERT_TRUE(f.close());
  auto after = f.read(0, buf).wait();
  ASSERT_FALSE(after);
  EXPECT_EQ(after.error(), errc::file_closed);
  EXPECT_NE(after.error().message().find("closed"), std::string::npos);
}

TEST(Aio, MisalignedDirectIoIsRefusedBeforeTheKernelSeesIt) {
  const engine_kind k = engine_here();
  if (k != engine_kind::io_uring && k != engine_kind::posix) {
    GTEST_SKIP() << "KEEL_AIO_ENGINE=" << to_string(k) << ": an engine without O_DIRECT";
  }
  temp_dir dir;
  auto c = start_engine(k);
  ASSERT_TRUE(c);
  open_options how;
  how.write = true;
  how.create = true;
  how.direct = true;
  auto f = c->open(dir.file("direct"), how);
  if (!f && f.error() == std::errc::invalid_argument) {
    GTEST_SKIP() << "the temporary directory's filesystem refuses O_DIRECT";
  }
  ASSERT_TRUE(f) << f.error().message();
  const std::size_t a = f->alignment();
  ASSERT_GE(a, 512u);
  auto* raw = static_cast<std::byte*>(std::aligned_alloc(a, 4 * a));
  ASSERT_NE(raw, nullptr);
  std::memset(raw, 0x5a, 4 * a);
  EXPECT_EQ(f->write(0, std::span(raw, a)).wait().value_or(0), a);  // aligned: fine
  const auto misaligned = [&](receipt r) {
    auto res = r.wait();
    return !res && res.error() == errc::misaligned_direct_io;
  };
  EXPECT_TRUE(misaligned(f->write(1, std::span(raw, a))));      // offset
  EXPECT_TRUE(misaligned(f->write(0, std::span(raw, a - 1))));  // length
  EXPECT_TRUE(misaligned(f->write(0, std::span(raw + 1, a))));  // address
  EXPECT_TRUE(misaligned(f->read(a / 2, std::span(raw, a))));
  std::free(raw);
  if (!unavailable(engine_kind::stdio).empty()) return;  // KEEL_AIO_ENGINE forces another
  options st;
  st.engine = engine_kind::stdio;
  auto s = controller::start(st);
  ASSERT_TRUE(s);
  EXPECT_EQ((*s)->open(dir.file("direct"), how).error(), errc::not_supported_by_engine);
}

// Stopping with work in flight: the running task finishes, what waits behind it is
// cancelled, every receipt is ready, the completion of each ran exactly once, and the
// controller refuses new work.
TEST(Aio, StopCompletesOrCancelsEveryReceipt) {
  for (const auto k : {engine_kind::io_uring, engine_kind::posix}) {
    if (!unavailable(k).empty()) continue;  // the other one still runs
    temp_dir dir;
    auto c = start_engine(k);
    ASSERT_TRUE(c);
    file f = open_rw(*c, dir.file("stop"));
    std::atomic<bool> task_started{false};
    std::atomic<int> completions{0};
    auto slow = f.submit([&]() -> result<std::size_t> {
      task_started = true;
      std::this_thread::sleep_for(300ms);
      return 42;
    });
    std::vector<std::byte> buf(4096);
    std::vector<receipt> behind;
    for (int i = 0; i < 200; ++i) {
      behind.push_back(f.write(static_cast<std::uint64_t>(i) * 4096, buf,
                               [&](const result<std::size_t>&) { ++completions; }));
    }
    while (!task_started)
      std::this_thread::yield();
    EXPECT_EQ(behind.back().wait(10ms).error(), std::errc::timed_out);
    c->stop();
    EXPECT_EQ(slow.wait().value_or(0), 42u);
    for (auto& r : behind) {
      ASSERT_TRUE(r.ready());
      EXPECT_EQ(r.state(), status::cancelled);
      EXPECT_EQ(r.wait().error(), errc::controller_stopped);
    }
    EXPECT_EQ(completions.load(), 200);
    auto late = f.write(0, buf).wait();
    ASSERT_FALSE(late);
    EXPECT_EQ(late.error(), errc::controller_stopped);
    c.reset();  // the file outlives its controller: still safe
    EXPECT_EQ(f.read(0, buf).wait().error(), errc::controller_stopped);
  }
}

TEST(Aio, CompletionRunsOnceBeforeWaitReturns) {
  temp_dir dir;
  auto c = start_engine(engine_here());
  ASSERT_TRUE(c);
  file f = open_rw(*c, dir.file("cb"));
  std::vector<std::byte> buf(1000, std::byte{1});
  for (int i = 0; i < 100; ++i) {
    auto calls = std::make_shared<std::atomic<int>>(0);
    auto got = std::make_shared<std::atomic<std::size_t>>(0);
    auto r = f.write(0, buf, [calls, got](const result<std::size_t>& n) {
      ++*calls;
      *got = n.value_or(0);
    });
    ASSERT_EQ(r.wait().value_or(0), 1000u);
    EXPECT_EQ(calls->load(), 1);
    EXPECT_EQ(got->load(), 1000u);
  }
}

// Every member of a file is thread-safe (file.hpp), close too: requests submitted while
// other threads close the file run or fail with file_closed, and each closer returns only
// once the descriptor is closed. (Under TSan, a race on the file's state fails it too.)
TEST(Aio, CloseRacesWithRequestsAndAnotherClose) {
  temp_dir dir;
  auto c = start_engine(engine_here());
  ASSERT_TRUE(c);
  const std::string path = dir.file("f");
  for (int round = 0; round < 40; ++round) {
    file f = open_rw(*c, path);
    std::atomic<bool> go{false};
    std::atomic<int> bad{0};
    std::atomic<int> left_open{0};
    const auto closer = [&] {
      while (!go.load())
        std::this_thread::yield();
      if (!f.close()) ++bad;
      if (!test_support::descriptors_on(path).empty()) ++left_open;
    };
    std::vector<std::thread> ts;
    for (int t = 0; t < 2; ++t) {
      ts.emplace_back([&, t] {
        std::vector<std::byte> b(512, std::byte{1});
        while (!go.load())
          std::this_thread::yield();
        for (int i = 0; i < 100; ++i) {
          const auto r = f.write(512 * static_cast<unsigned>(t), b).wait();
          if (r) continue;
          if (r.error() != make_error_code(errc::file_closed)) ++bad;
          break;
        }
      });
    }
    ts.emplace_back(closer);
    go = true;
    closer();
    for (auto& t : ts)
      t.join();
    EXPECT_EQ(bad.load(), 0) << "round " << round;
    EXPECT_EQ(left_open.load(), 0) << "round " << round << ": a close returned first";
    EXPECT_FALSE(f.is_open());
  }
}

// Completions may wait for other requests (receipt.hpp), also for one that the thread
// running the completion took from an inbox together with its own request: that wait must
// not leave it waiting for itself. Each engine, in a child with a time limit, since the
// failure is a hang: the only worker is held by a task while both writes queue behind it.
class CompletionWaits : public ::testing::TestWithParam<engine_kind> {
 protected:
  void SetUp() override {
    KEEL_NEED_ENGINE(GetParam());
    if (const std::string why = workers_forced_away(); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(CompletionWaits, ForARequestQueuedBehindItsOwn) {
  const engine_kind k = GetParam();
  temp_dir dir;
  expect_ends_in_a_child([&] {
    options o;
    o.engine = k;
    o.workers = 1;
    o.submit_on = submitter::workers;
    auto c = controller::start(o);
    if (!c) return 1;
    file g = open_rw(**c, dir.file("held"));
    file f = open_rw(**c, dir.file("a"));
    file h = open_rw(**c, dir.file("b"));
    std::atomic<bool> go{false};
    receipt hold = hold_until(g, go);
    std::vector<std::byte> buf(4096, std::byte{7});
    receipt second;
    std::atomic<bool> second_known{false};
    std::atomic<int> seen{-1};
    receipt first = f.write(0, buf, [&](const result<std::size_t>&) {
      while (!second_known.load())
        std::this_thread::sleep_for(1ms);
      seen = static_cast<int>(second.wait().value_or(0));
    });
    second = h.write(0, buf);
    second_known = true;
    go = true;
    if (!hold.wait() || !first.wait() || !second.wait()) return 2;
    return seen.load() == 4096 ? 0 : 3;
  });
}

// The same on the submitting thread: requests of one batch that ended inside their
// submission on the thread's own ring are settled there, and the first one's completion
// waits for the second, which only this thread holds.
TEST(CompletionWaits, OnTheSubmittingThreadForTheNextOfItsBatch) {
  KEEL_NEED_ENGINE(engine_kind::io_uring);
  if (const char* env = std::getenv("KEEL_AIO_SUBMIT_ON");
      env != nullptr && *env != '\0' && std::string_view(env) != "caller") {
    GTEST_SKIP() << "KEEL_AIO_SUBMIT_ON=" << env
                 << " forces where requests start: this needs them on the submitting thread";
  }
  temp_dir dir;
  expect_ends_in_a_child([&] {
    options o;
    o.engine = engine_kind::io_uring;
    o.workers = 1;
    o.submit_on = submitter::caller;
    auto c = controller::start(o);
    if (!c) return 1;
    file f = open_rw(**c, dir.file("a"));
    std::vector<std::byte> buf(8192, std::byte{7});
    std::array<receipt, 2> out;
    std::atomic<int> seen{-1};
    std::array<request, 2> batch{
        request{request::kind::write, 0, std::span(buf).first(4096),
                [&](const result<std::size_t>&) {
                  seen = static_cast<int>(out[1].wait().value_or(0));
                }},
        request{request::kind::write, 4096, std::span(buf).last(4096), {}}};
    f.submit(batch, out);
    if (!out[0].wait() || !out[1].wait()) return 2;
    return seen.load() == 4096 ? 0 : 3;
  });
}

INSTANTIATE_TEST_SUITE_P(Engines, CompletionWaits,
                         ::testing::Values(engine_kind::io_uring, engine_kind::posix,
                                           engine_kind::stdio, engine_kind::null),
                         [](const auto& p) { return std::string(to_string(p.param)); });

// A completion, and a task, on the only worker of their controller wait for a task (which
// runs on the controller's threads only: that worker's, here).
TEST_P(CompletionWaits, ForATaskOnItsOwnWorker) {
  const engine_kind k = GetParam();
  temp_dir dir;
  expect_ends_in_a_child([&] {
    auto c = one_worker(k);
    if (!c) return 1;
    file f = open_rw(*c, dir.file("a"));
    file g = open_rw(*c, dir.file("b"));
    std::vector<std::byte> buf(4096, std::byte{7});
    std::atomic<int> seen{-1};
    receipt first = f.write(0, buf, [&](const result<std::size_t>&) {
      seen =
          static_cast<int>(g.submit([]() -> result<std::size_t> { return 7; }).wait().value_or(0));
    });
    if (!ends_on_its_own(first, 10) || seen.load() != 7) return 2;
    receipt outer = f.submit([&]() -> result<std::size_t> {
      return g.submit([]() -> result<std::size_t> { return 8; }).wait();
    });
    if (!ends_on_its_own(outer, 10)) return 3;
    return outer.wait().value_or(0) == 8 ? 0 : 4;
  });
}

// A completion closes a file one of whose requests its own thread holds (queued behind it
// in the worker's inbox, or on the worker's ring): the close runs it rather than wait for it.
TEST_P(CompletionWaits, ToCloseAFileWhoseRequestItsThreadHolds) {
  const engine_kind k = GetParam();
  temp_dir dir;
  expect_ends_in_a_child([&] {
    auto c = one_worker(k);
    if (!c) return 1;
    file h = open_rw(*c, dir.file("held"));
    file f = open_rw(*c, dir.file("a"));
    file g = open_rw(*c, dir.file("b"));
    std::atomic<bool> go{false};
    receipt hold = hold_until(h, go);
    std::vector<std::byte> buf(4096, std::byte{7});
    std::atomic<int> closed{-1};
    receipt first =
        f.write(0, buf, [&](const result<std::size_t>&) { closed = g.close() ? 1 : 0; });
    receipt second = g.write(0, buf);
    go = true;
    if (!ends_on_its_own(first, 10) || !ends_on_its_own(second, 1)) return 2;
    if (second.wait().value_or(0) != 4096) return 3;
    return closed.load() == 1 ? 0 : 4;
  });
}

// Two controllers: a completion on the first's worker waits for a request of the second,
// whose completion waits for a new request of the first. Each worker's thread, waiting,
// runs what reaches its own inbox or ring, whichever controller it waits on.
TEST_P(CompletionWaits, AcrossTwoControllers) {
  const engine_kind k = GetParam();
  temp_dir dir;
  expect_ends_in_a_child([&] {
    auto c1 = one_worker(k);
    auto c2 = one_worker(k);
    if (!c1 || !c2) return 1;
    file f1 = open_rw(*c1, dir.file("a"));
    file f2 = open_rw(*c2, dir.file("b"));
    std::vector<std::byte> buf(4096, std::byte{7});
    std::atomic<int> inner{-1};
    std::atomic<int> outer{-1};
    receipt x = f1.write(0, buf, [&](const result<std::size_t>&) {
      receipt r = f2.write(0, buf, [&](const result<std::size_t>&) {
        inner = static_cast<int>(f1.write(4096, buf).wait().value_or(0));
      });
      outer = static_cast<int>(r.wait().value_or(0));
    });
    if (!ends_on_its_own(x, 10)) return 2;
    return inner.load() == 4096 && outer.load() == 4096 ? 0 : 3;
  });
}

}  // namespace
}  // namespace keel::aio
