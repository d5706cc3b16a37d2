// keel-bench aiobench workload, overwrite, overwrite_direct: the TAI thesis's workload, for
// plain POSIX calls, cstdio, glibc POSIX AIO and keel.

#include "aiobench.hpp"

#include <aio.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
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

#include "keel/aio/controller.hpp"
#include "keel/io/filesystem.hpp"
#include "keel/io/fs_info.hpp"

namespace keel::tools::aiobench {
namespace {

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

}  // namespace

// The workload's methods: the peers, then keel's engines without and with the cache.
std::vector<std::string> workload_methods() {
  std::vector<std::string> methods = {"posix", "cstdio", "posix_aio"};
  for (const char* suffix : {"", "_cache"}) {
    for (const char* e : {"io_uring", "posix", "stdio"})
      methods.push_back(fmt::format("keel_{}{}", e, suffix));
  }
  return methods;
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

}  // namespace keel::tools::aiobench
