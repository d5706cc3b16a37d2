// keel-bench aiobench: keel::aio measured against its peers in the same run, on the same files.
//
//   randread  4 KiB random reads at queue depth 32 of one file: keel's io_uring engine
//             against fio's io_uring engine, with O_DIRECT and buffered (file in the page
//             cache); keel's posix engine against fio's psync with as many threads.
//   workload  the TAI thesis's workload: per item a compute step on a 64 KiB buffer
//             (calibrated to cost about one buffered 64 KiB write), then a write of it, an
//             fsync every N items; for plain POSIX calls, cstdio, glibc POSIX AIO and keel
//             (each engine, with and without the write-back cache); 1 and 2 threads, each
//             on its own file.
//   overwrite the workload with every write overwritten at once (TAI section 3.4: where a
//             write-back cache can merge); fsync every 30 and 300 items.
//   overwrite_direct  the same with O_DIRECT (section 3.5: the cache in front of O_DIRECT).
//   small     4 KiB writes at random offsets from 2 threads, 64 in flight each, fsync every
//             30: glibc's POSIX AIO against keel where its global lock shows (section 2.3).
//   null      the null engine: nanoseconds per request of the framework alone, one request
//             at a time (submit, wait) and in batches of 64.

#include "aiobench_command.hpp"

#include <aio.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cli_util.hpp"
#include "keel/aio/controller.hpp"
#include "keel/io/filesystem.hpp"
#include "keel/io/fs_info.hpp"

namespace keel::tools {
namespace {

using nlohmann::json;
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

void progress(const std::string& what) {
  fmt::print(stderr, "aiobench: {}\n", what);
}

struct aligned_buffer {
  std::byte* data = nullptr;
  std::size_t size = 0;
  explicit aligned_buffer(std::size_t n) : size(n) {
    data = static_cast<std::byte*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
    if (data == nullptr) throw std::bad_alloc();
    std::memset(data, 0, n);
  }
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
  ~aligned_buffer() { std::free(data); }
};

[[noreturn]] void fail(const std::string& what, const std::error_code& ec) {
  throw std::runtime_error(what + ": " + ec.message());
}

template <class T>
T must(result<T> r, const std::string& what) {
  if (!r) fail(what, r.error());
  if constexpr (!std::is_void_v<T>) return std::move(*r);
}

// Why keel's engine `e` cannot start here, or empty: io_uring forbidden (a container's
// seccomp profile, kernel.io_uring_disabled) is a row not measured, not a failed run.
std::string engine_unavailable(aio::engine_kind e) {
  aio::options o;
  o.engine = e;
  o.workers = 1;
  auto c = aio::controller::start(o);
  return c ? std::string()
           : fmt::format("{} cannot start here: {}", aio::to_string(e), c.error().message());
}

// ---- randread ----

// The file to read: `bytes` of non-zero data, made once and kept if it is already there.
void make_read_file(const std::string& path, std::uint64_t bytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && static_cast<std::uint64_t>(st.st_size) == bytes) return;
  progress(fmt::format("writing a {} MiB file to read", bytes >> 20));
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("open " + path, std::error_code(errno, std::system_category()));
  std::vector<std::byte> chunk(1 << 20);
  std::mt19937_64 rng(1);
  for (auto& b : chunk)
    b = static_cast<std::byte>(rng() | 1);
  for (std::uint64_t off = 0; off < bytes; off += chunk.size()) {
    if (::pwrite(fd, chunk.data(), chunk.size(), static_cast<off_t>(off)) !=
        static_cast<ssize_t>(chunk.size())) {
      const int e = errno;
      ::close(fd);
      fail("write " + path, std::error_code(e, std::system_category()));
    }
  }
  ::fsync(fd);
  ::close(fd);
}

// Reads the whole file once, so buffered runs find it in the page cache.
void warm(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  std::vector<std::byte> chunk(1 << 20);
  while (::read(fd, chunk.data(), chunk.size()) > 0) {
  }
  ::close(fd);
}

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

// Runs fio and returns its read IOPS (all jobs together).
double run_fio(const std::string& path, std::uint64_t bytes, const std::string& engine, bool direct,
               unsigned depth, unsigned jobs, double seconds) {
  const std::string cmd = fmt::format(
      "fio --name=keel-aiobench --filename={} --rw=randread --bs=4k --size={} --ioengine={} "
      "--iodepth={} --direct={} --invalidate=0 --numjobs={} --thread --group_reporting "
      "--runtime={:.1f} --time_based --norandommap --randrepeat=0 --output-format=json "
      "2>/dev/null",
      quote(path), bytes, engine, depth, direct ? 1 : 0, jobs, seconds);
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) throw std::runtime_error("cannot run fio");
  std::string out;
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0)
    out.append(buf, n);
  const int status = ::pclose(p);
  if (status != 0) throw std::runtime_error(fmt::format("fio failed ({}): {}", status, cmd));
  // fio may print notes before the JSON.
  const auto brace = out.find('{');
  if (brace == std::string::npos) throw std::runtime_error("fio printed no JSON");
  const json doc = json::parse(out.substr(brace));
  return doc.at("jobs").at(0).at("read").at("iops").get<double>();
}

// keel: `depth` reads in flight from one submitting thread, each replaced as it completes.
double run_keel_randread(const std::string& path, std::uint64_t bytes, aio::engine_kind engine,
                         unsigned workers, bool direct, unsigned depth, double seconds) {
  aio::options o;
  o.engine = engine;
  o.workers = workers;
  auto ctl = must(aio::controller::start(o), "start the controller");
  aio::open_options how;
  how.direct = direct;
  aio::file f = must(ctl->open(path, how), "open " + path);
  aligned_buffer buf(std::size_t{depth} * 4096);
  const std::uint64_t blocks = bytes / 4096;
  std::mt19937_64 rng(7);
  std::vector<aio::receipt> ring(depth);
  const auto issue = [&](unsigned k) {
    ring[k] = f.read((rng() % blocks) * 4096, std::span(buf.data + std::size_t{k} * 4096, 4096));
  };
  for (unsigned k = 0; k < depth; ++k)
    issue(k);
  std::uint64_t done = 0;
  const auto t0 = clock_type::now();
  double elapsed = 0;
  for (unsigned k = 0;; k = (k + 1) % depth) {
    auto n = ring[k].wait();
    if (!n || *n != 4096)
      fail("keel read", n ? std::make_error_code(std::errc::io_error) : n.error().code());
    ++done;
    if ((done & 1023) == 0 && (elapsed = seconds_since(t0)) >= seconds) break;
    issue(k);
  }
  for (auto& r : ring)
    (void)r.wait();
  return static_cast<double>(done) / elapsed;
}

// Runs `body(t)` on `n` threads at once: the seconds from their start until all ended. The
// first error a thread threw is thrown here, named `what`.
double timed_threads(unsigned n, const std::string& what,
                     const std::function<void(unsigned)>& body) {
  std::vector<std::thread> pool;
  std::vector<std::string> errors(n);
  const auto t0 = clock_type::now();
  for (unsigned t = 0; t < n; ++t) {
    pool.emplace_back([&, t] {
      try {
        body(t);
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  }
  for (auto& th : pool)
    th.join();
  const double s = seconds_since(t0);
  for (const auto& e : errors) {
    if (!e.empty()) throw std::runtime_error(what + ": " + e);
  }
  return s;
}

// keel as fio's psync runs: `threads` threads, each reading one block at a time (submit,
// wait), on a controller with as many workers.
double run_keel_sync_randread(const std::string& path, std::uint64_t bytes, aio::engine_kind engine,
                              unsigned threads, double seconds) {
  aio::options o;
  o.engine = engine;
  o.workers = threads;
  auto ctl = must(aio::controller::start(o), "start the controller");
  aio::file f = must(ctl->open(path, aio::open_options{}), "open " + path);
  const std::uint64_t blocks = bytes / 4096;
  std::atomic<std::uint64_t> total{0};
  const auto t0 = clock_type::now();
  const double elapsed = timed_threads(threads, "keel posix", [&](unsigned t) {
    aligned_buffer buf(4096);
    std::mt19937_64 rng(11 + t);
    std::uint64_t done = 0;
    for (;;) {
      auto n = f.read((rng() % blocks) * 4096, std::span(buf.data, 4096)).wait();
      if (!n || *n != 4096) {
        fail("keel read", n ? std::make_error_code(std::errc::io_error) : n.error().code());
      }
      if ((++done & 1023) == 0 && seconds_since(t0) >= seconds) break;
    }
    total += done;
  });
  return static_cast<double>(total.load()) / elapsed;
}

json measure_randread(const std::string& dir, std::uint64_t bytes, unsigned threads,
                      double seconds) {
  json out;
  if (std::system("fio --version >/dev/null 2>&1") != 0) {
    out["skipped"] = "fio not found (Debian package fio)";
    return out;
  }
  // Two of its three comparisons are io_uring's (fio's too, which fails where it is denied).
  if (auto why = engine_unavailable(aio::engine_kind::io_uring); !why.empty()) {
    progress("randread skipped: " + why);
    out["skipped"] = why;
    return out;
  }
  const std::string path = dir + "/randread.dat";
  make_read_file(path, bytes);
  // (a) O_DIRECT: the device sets the pace.
  progress("randread O_DIRECT: fio io_uring, keel io_uring");
  const double fio_direct = run_fio(path, bytes, "io_uring", true, 32, 1, seconds);
  const double keel_direct =
      run_keel_randread(path, bytes, aio::engine_kind::io_uring, 1, true, 32, seconds);
  // (b) buffered, in the page cache: the library's own cost shows.
  warm(path);
  progress("randread buffered: fio io_uring, keel io_uring");
  const double fio_buffered = run_fio(path, bytes, "io_uring", false, 32, 1, seconds);
  const double keel_buffered =
      run_keel_randread(path, bytes, aio::engine_kind::io_uring, 1, false, 32, seconds);
  progress(fmt::format("randread buffered: fio psync, keel posix, {} threads", threads));
  const double fio_psync = run_fio(path, bytes, "psync", false, 1, threads, seconds);
  // keel keeps 32 requests queued for its `threads` workers (fio's threads each have one).
  const double keel_posix =
      run_keel_randread(path, bytes, aio::engine_kind::posix, threads, false, 32, seconds);
  // The same shape as fio's psync: each thread submits one read and waits for it.
  const double keel_posix_sync =
      run_keel_sync_randread(path, bytes, aio::engine_kind::posix, threads, seconds);
  out["file_bytes"] = bytes;
  out["direct"] = {{"fio_io_uring", fio_direct}, {"keel_io_uring", keel_direct}};
  out["buffered"] = {{"fio_io_uring", fio_buffered}, {"keel_io_uring", keel_buffered}};
  out["psync"] = {{"threads", threads},
                  {"fio_psync", fio_psync},
                  {"keel_posix", keel_posix},
                  {"keel_posix_one_at_a_time", keel_posix_sync}};
  fmt::print("randread 4 KiB, IOPS          fio        keel   ratio\n");
  fmt::print("  O_DIRECT, io_uring  {:>10.0f}  {:>10.0f}  {:.3f}\n", fio_direct, keel_direct,
             keel_direct / fio_direct);
  fmt::print("  buffered, io_uring  {:>10.0f}  {:>10.0f}  {:.3f}\n", fio_buffered, keel_buffered,
             keel_buffered / fio_buffered);
  fmt::print(
      "  buffered, {} threads psync/posix, keel 32 queued by one thread {:>10.0f}  {:>10.0f}  "
      "{:.3f}\n",
      threads, fio_psync, keel_posix, keel_posix / fio_psync);
  fmt::print(
      "  buffered, {} threads psync/posix, keel one at a time per thread {:>10.0f}  "
      "{:>10.0f}  {:.3f}\n",
      threads, fio_psync, keel_posix_sync, keel_posix_sync / fio_psync);
  return out;
}

// ---- the thesis workload ----

constexpr std::size_t item_bytes = 64 * 1024;
constexpr unsigned ring_size = 8;  // buffers in flight for the asynchronous methods

// The compute step: a deterministic transform of the buffer, `rounds` passes.
void compute(std::byte* buf, std::uint64_t item, unsigned rounds) {
  auto* w = reinterpret_cast<std::uint64_t*>(buf);
  std::uint64_t x = item * 0x9e3779b97f4a7c15ULL + 1;
  for (unsigned r = 0; r < rounds; ++r) {
    for (std::size_t i = 0; i < item_bytes / 8; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      w[i] = w[i] * 31 + x;
    }
  }
}

// Passes of `compute` that cost about one buffered 64 KiB write on this filesystem.
unsigned calibrate(const std::string& dir) {
  const std::string path = dir + "/calibrate.dat";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("open " + path, std::error_code(errno, std::system_category()));
  aligned_buffer buf(item_bytes);
  constexpr int n = 400;
  auto t0 = clock_type::now();
  for (int i = 0; i < n; ++i) {
    if (::pwrite(fd, buf.data, item_bytes, static_cast<off_t>(i) * item_bytes) < 0) break;
  }
  const double write_s = seconds_since(t0) / n;
  ::close(fd);
  ::unlink(path.c_str());
  t0 = clock_type::now();
  for (int i = 0; i < n; ++i)
    compute(buf.data, static_cast<std::uint64_t>(i), 1);
  const double pass_s = seconds_since(t0) / n;
  return std::max(1u, static_cast<unsigned>(write_s / pass_s + 0.5));
}

struct workload_params {
  std::uint64_t items = 0;
  unsigned fsync_every = 0;
  unsigned rounds = 1;
  bool overwrite = false;  // every write followed at once by a write of the same region
  bool direct = false;     // O_DIRECT (64 KiB items are aligned already)
};

int open_flags(const workload_params& p) {
  return O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | (p.direct ? O_DIRECT : 0);
}

void run_posix_items(const std::string& path, const workload_params& p) {
  const int fd = ::open(path.c_str(), open_flags(p), 0644);
  if (fd < 0) fail("open " + path, std::error_code(errno, std::system_category()));
  aligned_buffer buf(item_bytes);
  for (std::uint64_t i = 0; i < p.items; ++i) {
    compute(buf.data, i, p.rounds);
    for (int w = 0; w < (p.overwrite ? 2 : 1); ++w) {
      if (::pwrite(fd, buf.data, item_bytes, static_cast<off_t>(i * item_bytes)) !=
          static_cast<ssize_t>(item_bytes)) {
        fail("pwrite", std::error_code(errno, std::system_category()));
      }
    }
    if ((i + 1) % p.fsync_every == 0 && ::fsync(fd) != 0) {
      fail("fsync", std::error_code(errno, std::system_category()));
    }
  }
  if (::fsync(fd) != 0) fail("fsync", std::error_code(errno, std::system_category()));
  ::close(fd);
}

void run_stdio_items(const std::string& path, const workload_params& p) {
  std::FILE* f = std::fopen(path.c_str(), "wbe");
  if (f == nullptr) fail("fopen " + path, std::error_code(errno, std::system_category()));
  aligned_buffer buf(item_bytes);
  for (std::uint64_t i = 0; i < p.items; ++i) {
    compute(buf.data, i, p.rounds);
    if (std::fwrite(buf.data, 1, item_bytes, f) != item_bytes) {
      fail("fwrite", std::error_code(errno, std::system_category()));
    }
    if (p.overwrite && (::fseeko(f, -static_cast<off_t>(item_bytes), SEEK_CUR) != 0 ||
                        std::fwrite(buf.data, 1, item_bytes, f) != item_bytes)) {
      fail("fwrite", std::error_code(errno, std::system_category()));
    }
    if ((i + 1) % p.fsync_every == 0 && (std::fflush(f) != 0 || ::fsync(fileno(f)) != 0)) {
      fail("fsync", std::error_code(errno, std::system_category()));
    }
  }
  if (std::fflush(f) != 0 || ::fsync(fileno(f)) != 0) {
    fail("fsync", std::error_code(errno, std::system_category()));
  }
  std::fclose(f);
}

// Waits for a glibc POSIX AIO request; throws its error.
void await_aio(aiocb& cb, const char* what) {
  const aiocb* list[1] = {&cb};
  while (::aio_error(&cb) == EINPROGRESS)
    ::aio_suspend(list, 1, nullptr);
  if (::aio_return(&cb) < 0) fail(what, std::error_code(::aio_error(&cb), std::system_category()));
}

// Issues an aio_fsync of `fd` in `cb` once the one before it (if `busy`) has ended.
void next_aio_fsync(int fd, aiocb& cb, bool& busy) {
  if (busy) await_aio(cb, "aio_fsync");
  cb = aiocb{};
  cb.aio_fildes = fd;
  if (::aio_fsync(O_SYNC, &cb) != 0) {
    fail("aio_fsync", std::error_code(errno, std::system_category()));
  }
  busy = true;
}

// glibc POSIX AIO: aio_write from a ring of buffers, aio_fsync every N items (one at a
// time), each buffer reused once its write is done.
void run_posix_aio_items(const std::string& path, const workload_params& p) {
  const int fd = ::open(path.c_str(), open_flags(p), 0644);
  if (fd < 0) fail("open " + path, std::error_code(errno, std::system_category()));
  std::vector<std::unique_ptr<aligned_buffer>> bufs;
  // Per buffer: its write, and its overwrite.
  std::vector<aiocb> cbs(2 * ring_size);
  std::vector<bool> busy(2 * ring_size, false);
  for (unsigned k = 0; k < ring_size; ++k)
    bufs.push_back(std::make_unique<aligned_buffer>(item_bytes));
  aiocb sync_cb{};
  bool sync_busy = false;
  for (std::uint64_t i = 0; i < p.items; ++i) {
    const unsigned k = static_cast<unsigned>(i % ring_size);
    for (const unsigned c : {k, k + ring_size}) {
      if (busy[c]) await_aio(cbs[c], "aio_write");
      busy[c] = false;
    }
    compute(bufs[k]->data, i, p.rounds);
    for (const unsigned c : {k, k + ring_size}) {
      if (c != k && !p.overwrite) break;
      cbs[c] = aiocb{};
      cbs[c].aio_fildes = fd;
      cbs[c].aio_buf = bufs[k]->data;
      cbs[c].aio_nbytes = item_bytes;
      cbs[c].aio_offset = static_cast<off_t>(i * item_bytes);
      if (::aio_write(&cbs[c]) != 0)
        fail("aio_write", std::error_code(errno, std::system_category()));
      busy[c] = true;
    }
    if ((i + 1) % p.fsync_every == 0) {
      next_aio_fsync(fd, sync_cb, sync_busy);
    }
  }
  for (unsigned c = 0; c < 2 * ring_size; ++c) {
    if (busy[c]) await_aio(cbs[c], "aio_write");
  }
  if (sync_busy) await_aio(sync_cb, "aio_fsync");
  if (::fsync(fd) != 0) fail("fsync", std::error_code(errno, std::system_category()));
  ::close(fd);
}

// keel: a write per item from a ring of buffers, an fsync every N items, waiting only to
// reuse a buffer; the last fsync is waited for.
void run_keel_items(aio::controller& ctl, const std::string& path, const workload_params& p,
                    bool cache) {
  aio::open_options how;
  how.read = false;
  how.write = true;
  how.create = true;
  how.truncate = true;
  how.cache = cache;
  how.direct = p.direct;
  aio::file f = must(ctl.open(path, how), "open " + path);
  std::vector<std::unique_ptr<aligned_buffer>> bufs;
  // Per buffer: its write and its overwrite (which the thread's order puts after it).
  std::vector<aio::receipt> writes(ring_size);
  std::vector<aio::receipt> overwrites(ring_size);
  for (unsigned k = 0; k < ring_size; ++k)
    bufs.push_back(std::make_unique<aligned_buffer>(item_bytes));
  std::vector<aio::receipt> syncs;
  for (std::uint64_t i = 0; i < p.items; ++i) {
    const unsigned k = static_cast<unsigned>(i % ring_size);
    if (writes[k].valid()) must(writes[k].wait(), "keel write");
    if (overwrites[k].valid()) must(overwrites[k].wait(), "keel write");
    compute(bufs[k]->data, i, p.rounds);
    const std::span<const std::byte> item(bufs[k]->data, item_bytes);
    writes[k] = f.write(i * item_bytes, item);
    if (p.overwrite) overwrites[k] = f.write(i * item_bytes, item);
    if ((i + 1) % p.fsync_every == 0) syncs.push_back(f.fsync());
  }
  must(f.fsync().wait(), "keel fsync");
  for (auto* ws : {&writes, &overwrites}) {
    for (auto& w : *ws) {
      if (w.valid()) must(w.wait(), "keel write");
    }
  }
  for (auto& s : syncs)
    must(s.wait(), "keel fsync");
  must(f.close(), "close " + path);
}

// The workload's methods: the peers, then keel's engines without and with the cache.
std::vector<std::string> workload_methods() {
  std::vector<std::string> methods = {"posix", "cstdio", "posix_aio"};
  for (const char* suffix : {"", "_cache"}) {
    for (const char* e : {"io_uring", "posix", "stdio"})
      methods.push_back(fmt::format("keel_{}{}", e, suffix));
  }
  return methods;
}

// A form of the thesis workload: plain (section 3.3), every write overwritten at once (3.4),
// and that with O_DIRECT (3.5). With overwrites the rate counts each write and its
// overwrite as one item: scaled by the overwrite factor, as the thesis does, to reflect what
// reaches the disk.
struct workload_variant {
  const char* part;
  const char* title;
  std::vector<unsigned> fsync_every;
  bool overwrite;
  bool direct;
};

const workload_variant plain_workload{
    "workload", "compute + 64 KiB write per item", {1, 30, 300}, false, false};
const workload_variant overwrite_workload{
    "overwrite", "compute + 64 KiB write + its overwrite per item", {30, 300}, true, false};
const workload_variant direct_overwrite_workload{
    "overwrite_direct",
    "O_DIRECT: compute + 64 KiB write + its overwrite per item",
    {30, 300},
    true,
    true};

// Why O_DIRECT cannot be had in `dir`, or empty.
std::string direct_unavailable(const std::string& dir) {
  const std::string path = dir + "/direct-probe.dat";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
  const int e = errno;
  ::unlink(path.c_str());
  if (fd < 0) return "O_DIRECT cannot open files in " + dir + ": " + std::strerror(e);
  ::close(fd);
  return {};
}

json measure_workload(const std::string& dir, std::uint64_t items,
                      const std::vector<std::string>& asked, const workload_variant& v) {
  const std::string part = v.part;
  if (v.direct) {
    if (auto why = direct_unavailable(dir); !why.empty()) {
      progress(part + " skipped: " + why);
      fmt::print("{} skipped: {}\n", part, why);
      return {{"skipped_all", why}, {"rows", json::array()}, {"skipped", json::array()}};
    }
  }
  // keel's methods on an engine that cannot start here are reported as skipped, with why.
  std::vector<std::string> methods;
  json skipped = json::array();
  for (const auto& m : asked) {
    if (v.direct && (m == "cstdio" || m.starts_with("keel_stdio"))) {
      skipped.push_back({{"method", m}, {"reason", "cstdio has no O_DIRECT"}});
      continue;
    }
    if (m.starts_with("keel_")) {
      const bool cache = m.ends_with("_cache");
      const std::string engine = m.substr(5, m.size() - 5 - (cache ? 6 : 0));
      if (auto why = engine_unavailable(must(aio::engine_from_string(engine), "engine"));
          !why.empty()) {
        progress(fmt::format("{}: {} skipped: {}", part, m, why));
        fmt::print("{}: {} skipped: {}\n", part, m, why);
        skipped.push_back({{"method", m}, {"reason", why}});
        continue;
      }
    }
    methods.push_back(m);
  }
  progress(part + ": calibrating the compute step against a 64 KiB write");
  const unsigned rounds = calibrate(dir);
  json rows = json::array();
  fmt::print("\n{}: {}, fsync every N (items/s)\n", part, v.title);
  fmt::print("{:<20} {:>7} {:>5} {:>12}\n", "method", "threads", "N", "items/s");
  for (const unsigned threads : {1u, 2u}) {
    for (const unsigned every : v.fsync_every) {
      const workload_params p{items, every, rounds, v.overwrite, v.direct};
      for (const auto& m : methods) {
        progress(fmt::format("{}: {} with {} thread(s), fsync every {}", part, m, threads, every));
        std::unique_ptr<aio::controller> ctl;
        const bool cache = m.ends_with("_cache");
        if (m.starts_with("keel_")) {
          aio::options o;
          const std::string engine = m.substr(5, m.size() - 5 - (cache ? 6 : 0));
          o.engine = must(aio::engine_from_string(engine), "engine");
          o.workers = 2;
          ctl = must(aio::controller::start(o), "start the controller");
        }
        // Each run starts without the last run's files: deleting 128 MiB is not the
        // workload (O_TRUNC inside the timing cost every method alike and hid the ratios).
        for (unsigned t = 0; t < threads; ++t)
          ::unlink(fmt::format("{}/workload-{}.dat", dir, t).c_str());
        ::sync();
        const double s = timed_threads(threads, m, [&](unsigned t) {
          const std::string path = fmt::format("{}/workload-{}.dat", dir, t);
          if (m == "posix") {
            run_posix_items(path, p);
          } else if (m == "cstdio") {
            run_stdio_items(path, p);
          } else if (m == "posix_aio") {
            run_posix_aio_items(path, p);
          } else {
            run_keel_items(*ctl, path, p, cache);
          }
        });
        const double rate = static_cast<double>(items * threads) / s;
        rows.push_back({{"method", m},
                        {"threads", threads},
                        {"fsync_every", every},
                        {"items", items * threads},
                        {"seconds", s},
                        {"items_per_second", rate}});
        fmt::print("{:<20} {:>7} {:>5} {:>12.0f}\n", m, threads, every, rate);
      }
    }
  }
  for (unsigned t = 0; t < 2; ++t)
    ::unlink(fmt::format("{}/workload-{}.dat", dir, t).c_str());
  return {{"item_bytes", item_bytes},
          {"compute_rounds", rounds},
          {"overwrite", v.overwrite},
          {"direct", v.direct},
          {"rows", rows},
          {"skipped", skipped}};
}

// ---- many small requests ----

// 4 KiB writes at random offsets of one 64 MiB file from 2 threads, 64 in flight each, an
// fsync every 30 writes (the previous one waited for first): where glibc's POSIX AIO pays
// for its global lock (TAI section 2.3). Writes per second.
constexpr std::uint64_t small_file_bytes = std::uint64_t{64} << 20;
constexpr unsigned small_depth = 64;
constexpr unsigned small_threads = 2;
constexpr unsigned small_fsync_every = 30;

void run_small_posix_aio(int fd, std::uint64_t writes, unsigned seed) {
  std::vector<std::unique_ptr<aligned_buffer>> bufs;
  std::vector<aiocb> cbs(small_depth);
  std::vector<bool> busy(small_depth, false);
  for (unsigned k = 0; k < small_depth; ++k)
    bufs.push_back(std::make_unique<aligned_buffer>(4096));
  aiocb sync_cb{};
  bool sync_busy = false;
  std::mt19937_64 rng(seed);
  for (std::uint64_t i = 0; i < writes; ++i) {
    const unsigned k = static_cast<unsigned>(i % small_depth);
    if (busy[k]) await_aio(cbs[k], "aio_write");
    cbs[k] = aiocb{};
    cbs[k].aio_fildes = fd;
    cbs[k].aio_buf = bufs[k]->data;
    cbs[k].aio_nbytes = 4096;
    cbs[k].aio_offset = static_cast<off_t>(rng() % (small_file_bytes / 4096) * 4096);
    if (::aio_write(&cbs[k]) != 0)
      fail("aio_write", std::error_code(errno, std::system_category()));
    busy[k] = true;
    if ((i + 1) % small_fsync_every == 0) {
      next_aio_fsync(fd, sync_cb, sync_busy);
    }
  }
  for (unsigned k = 0; k < small_depth; ++k) {
    if (busy[k]) await_aio(cbs[k], "aio_write");
  }
  if (sync_busy) await_aio(sync_cb, "aio_fsync");
}

void run_small_keel(aio::file& f, std::uint64_t writes, unsigned seed) {
  std::vector<std::unique_ptr<aligned_buffer>> bufs;
  std::vector<aio::receipt> rs(small_depth);
  for (unsigned k = 0; k < small_depth; ++k)
    bufs.push_back(std::make_unique<aligned_buffer>(4096));
  aio::receipt sync;
  std::mt19937_64 rng(seed);
  for (std::uint64_t i = 0; i < writes; ++i) {
    const unsigned k = static_cast<unsigned>(i % small_depth);
    if (rs[k].valid()) must(rs[k].wait(), "keel write");
    rs[k] = f.write(rng() % (small_file_bytes / 4096) * 4096,
                    std::span<const std::byte>(bufs[k]->data, 4096));
    if ((i + 1) % small_fsync_every == 0) {
      if (sync.valid()) must(sync.wait(), "keel fsync");
      sync = f.fsync();
    }
  }
  for (auto& r : rs) {
    if (r.valid()) must(r.wait(), "keel write");
  }
  if (sync.valid()) must(sync.wait(), "keel fsync");
}

// A directory of keel's own in /dev/shm when that is a tmpfs, else empty.
std::string memory_dir() {
  const auto info = io::os().statfs("/dev/shm");
  if (!info || info->type != io::fs_type::tmpfs) return "";
  std::string t = "/dev/shm/keel-aiobench-XXXXXX";
  if (::mkdtemp(t.data()) == nullptr) return "";
  return t;
}

json measure_small(const std::string& dir, const std::string& where, std::uint64_t items) {
  const std::uint64_t writes = std::max<std::uint64_t>(items * 32, 1000);  // per thread
  const std::string path = dir + "/small.dat";
  // The file exists whole first: the writes overwrite, they do not extend it. Made afresh for
  // each method: a write into a block fallocate left unwritten costs ext4 an extent
  // conversion, so a method that ran on a file another had mostly written would have it easy.
  const auto make_file = [&] {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail("open " + path, std::error_code(errno, std::system_category()));
    const int r = ::posix_fallocate(fd, 0, static_cast<off_t>(small_file_bytes));
    ::close(fd);
    if (r != 0) fail("fallocate " + path, std::error_code(r, std::system_category()));
  };
  json rows = json::array();
  json skipped = json::array();
  fmt::print(
      "\nsmall: 4 KiB writes at random offsets, {} threads x {} in flight, fsync every {}, {} "
      "(writes/s)\n",
      small_threads, small_depth, small_fsync_every, where);
  for (const std::string m : {"posix_aio", "keel_io_uring", "keel_posix"}) {
    make_file();
    std::unique_ptr<aio::controller> ctl;
    std::optional<aio::file> f;
    int fd = -1;
    if (m == "posix_aio") {
      fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd < 0) fail("open " + path, std::error_code(errno, std::system_category()));
    } else {
      const auto engine = must(aio::engine_from_string(m.substr(5)), "engine");
      if (auto why = engine_unavailable(engine); !why.empty()) {
        progress(fmt::format("small: {} skipped: {}", m, why));
        skipped.push_back({{"method", m}, {"reason", why}});
        continue;
      }
      aio::options o;
      o.engine = engine;
      o.workers = 2;
      ctl = must(aio::controller::start(o), "start the controller");
      aio::open_options how;
      how.read = false;
      how.write = true;
      f = must(ctl->open(path, how), "open " + path);
    }
    progress(fmt::format("small: {}", m));
    ::sync();
    const double s = timed_threads(small_threads, m, [&](unsigned t) {
      if (fd >= 0) {
        run_small_posix_aio(fd, writes, 3 + t);
      } else {
        run_small_keel(*f, writes, 3 + t);
      }
    });
    if (fd >= 0) ::close(fd);
    if (f) must(f->close(), "close " + path);
    const double rate = static_cast<double>(writes * small_threads) / s;
    rows.push_back({{"method", m},
                    {"writes", writes * small_threads},
                    {"seconds", s},
                    {"writes_per_second", rate}});
    fmt::print("{:<20} {:>12.0f}\n", m, rate);
  }
  ::unlink(path.c_str());
  return {{"where", where},
          {"threads", small_threads},
          {"in_flight", small_depth},
          {"fsync_every", small_fsync_every},
          {"rows", rows},
          {"skipped", skipped}};
}

// ---- framework overhead ----

json measure_null(const std::string& dir, double seconds) {
  progress("null engine: framework overhead per request");
  aio::options o;
  o.engine = aio::engine_kind::null;
  o.workers = 1;
  auto ctl = must(aio::controller::start(o), "start the controller");
  aio::open_options how;
  how.write = true;
  how.create = true;
  aio::file f = must(ctl->open(dir + "/null.dat", how), "open");
  std::vector<std::byte> buf(4096);
  // One at a time: submit, wait.
  std::uint64_t n = 0;
  auto t0 = clock_type::now();
  double elapsed = 0;
  for (;;) {
    must(f.write(0, buf).wait(), "null write");
    if ((++n & 1023) == 0 && (elapsed = seconds_since(t0)) >= seconds) break;
  }
  const double single_ns = elapsed * 1e9 / static_cast<double>(n);
  // Batches of 64: one submission, then the waits.
  constexpr std::size_t batch = 64;
  std::vector<aio::request> reqs(batch);
  std::vector<aio::receipt> outs(batch);
  n = 0;
  t0 = clock_type::now();
  for (;;) {
    for (std::size_t k = 0; k < batch; ++k) {
      reqs[k].what = aio::request::kind::write;
      reqs[k].offset = k * buf.size();  // disjoint: nothing holds a request back
      reqs[k].buffer = buf;
    }
    f.submit(reqs, outs);
    for (auto& r : outs)
      must(r.wait(), "null write");
    n += batch;
    if ((n & 4095) == 0 && (elapsed = seconds_since(t0)) >= seconds) break;
  }
  const double batched_ns = elapsed * 1e9 / static_cast<double>(n);
  ::unlink((dir + "/null.dat").c_str());
  fmt::print("\nnull engine: {:.0f} ns per request one at a time, {:.0f} ns in batches of {}\n",
             single_ns, batched_ns, batch);
  return {{"single_ns", single_ns}, {"batched_ns", batched_ns}, {"batch", batch}};
}

}  // namespace

int run_aiobench_command(int argc, char** argv) {
  CLI::App app{
      "Measure keel::aio in the same run as its peers: fio (randread), plain POSIX calls, cstdio "
      "and glibc POSIX AIO (the TAI thesis workload), and the null engine's own cost",
      "keel-bench aiobench"};
  std::string dir = "build/aiobench";
  std::uint64_t size_mib = 1024;
  double seconds = 3;
  unsigned threads = 2;
  std::uint64_t items = 600;
  std::string parts = "randread,workload,overwrite,overwrite_direct,small,null";
  std::string methods_list;
  std::string json_path;
  app.add_option("--dir", dir,
                 "Directory for the files (a real device for O_DIRECT; the read file is kept "
                 "there for the next run)")
      ->capture_default_str();
  app.add_option("--size", size_mib, "MiB of the randread file")
      ->check(CLI::Range(std::uint64_t{16}, std::uint64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--seconds", seconds, "Seconds per randread and null measurement")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  app.add_option("--threads", threads, "Threads of fio psync and of keel's posix engine")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  app.add_option("--items", items, "Items per thread in the workload")
      ->check(CLI::Range(std::uint64_t{10}, std::uint64_t{1} << 24))
      ->capture_default_str();
  app.add_option("--parts", parts,
                 "Comma-separated: randread, workload, overwrite, overwrite_direct, small, null")
      ->capture_default_str();
  app.add_option("--methods", methods_list,
                 "Comma-separated workload methods to run (default: all): posix, cstdio, "
                 "posix_aio, keel_io_uring, keel_posix, keel_stdio, and each keel one with "
                 "_cache");
  app.add_option("--json", json_path, "Also write the results as JSON to this file ('-': stdout)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  std::vector<std::string> wanted;
  for (std::size_t at = 0; at <= parts.size();) {
    const auto comma = std::min(parts.find(',', at), parts.size());
    const std::string p = parts.substr(at, comma - at);
    if (p != "randread" && p != "workload" && p != "overwrite" && p != "overwrite_direct" &&
        p != "small" && p != "null") {
      fmt::print(stderr, "keel-bench aiobench: --parts: unknown part '{}'\n", p);
      return 2;
    }
    wanted.push_back(p);
    at = comma + 1;
  }
  const auto wants = [&](const char* part) {
    return std::find(wanted.begin(), wanted.end(), part) != wanted.end();
  };
  std::vector<std::string> methods = workload_methods();
  if (!methods_list.empty()) {
    std::vector<std::string> chosen;
    for (std::size_t at = 0; at <= methods_list.size();) {
      const auto comma = std::min(methods_list.find(',', at), methods_list.size());
      const std::string m = methods_list.substr(at, comma - at);
      if (std::find(methods.begin(), methods.end(), m) == methods.end()) {
        fmt::print(stderr, "keel-bench aiobench: --methods: unknown method '{}'\n", m);
        return 2;
      }
      chosen.push_back(m);
      at = comma + 1;
    }
    methods = chosen;
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    fmt::print(stderr, "keel-bench aiobench: {}: {}\n", dir, ec.message());
    return 1;
  }
  json doc;
  auto fs = io::stat_fs(dir.c_str());
  doc["filesystem"] = fs ? std::string(fs->type_name()) : "unknown";
  doc["dir"] = dir;
  {
    auto probe = aio::controller::start();
    doc["default_engine"] = probe ? std::string((*probe)->engine_name()) : "none";
    doc["fallback_reason"] = probe ? (*probe)->fallback_reason() : probe.error().message();
  }
  try {
    if (wants("randread")) {
      doc["randread"] = measure_randread(dir, size_mib << 20, threads, seconds);
    }
    for (const auto* v : {&plain_workload, &overwrite_workload, &direct_overwrite_workload}) {
      if (wants(v->part)) doc[v->part] = measure_workload(dir, items, methods, *v);
    }
    if (wants("small")) {
      doc["small"] = measure_small(dir, "on " + dir, items);
      // On the disk an fsync's wait sets the pace; in memory (tmpfs), what the libraries
      // themselves cost per request does, glibc's global lock among it (TAI 2.3).
      if (auto mem = memory_dir(); !mem.empty()) {
        doc["small_memory"] = measure_small(mem, "in memory (tmpfs)", items);
        std::filesystem::remove_all(mem, ec);
      } else {
        progress("small in memory skipped: /dev/shm is not a tmpfs here");
      }
    }
    if (wants("null")) doc["null"] = measure_null(dir, seconds);
  } catch (const std::exception& e) {
    fmt::print(stderr, "keel-bench aiobench: {}\n", e.what());
    return 1;
  }
  if (!json_path.empty() && !write_json("aiobench", json_path, doc)) return 1;
  return 0;
}

}  // namespace keel::tools
