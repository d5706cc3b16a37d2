// keel-bench aiobench small: many small writes in flight, glibc's POSIX AIO against keel.

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

}  // namespace

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

}  // namespace keel::tools::aiobench
