// keel-bench aiobench randread: 4 KiB random reads of one file, keel's engines against fio's.

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

}  // namespace

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

}  // namespace keel::tools::aiobench
