#pragma once
// keel-bench aiobench's parts (aiobench_command.cpp says what each measures): what they share,
// and the measurement each file makes. Each measurement prints its table and returns its rows
// for the report; a failure throws std::runtime_error naming the step.

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
#include "keel/result.hpp"

namespace keel::tools::aiobench {

using nlohmann::json;
using clock_type = std::chrono::steady_clock;

//! Seconds since `t0`.
double seconds_since(clock_type::time_point t0);

//! Says on stderr what is being measured now.
void progress(const std::string& what);

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

//! Throws std::runtime_error: `what` failed with `ec`.
[[noreturn]] void fail(const std::string& what, const std::error_code& ec);

template <class T>
T must(result<T> r, const std::string& what) {
  if (!r) fail(what, r.error());
  if constexpr (!std::is_void_v<T>) return std::move(*r);
}

//! Why keel's engine `e` cannot start here, or empty: io_uring forbidden (a container's
//! seccomp profile, kernel.io_uring_disabled) is a row not measured, not a failed run.
std::string engine_unavailable(aio::engine_kind e);
//! Runs `body(t)` on `n` threads at once: the seconds from their start until all ended. The
//! first error a thread threw is thrown here, named `what`.
double timed_threads(unsigned n, const std::string& what,
                     const std::function<void(unsigned)>& body);
//! Waits for glibc's POSIX AIO request `cb` (its error thrown, naming `what`).
void await_aio(aiocb& cb, const char* what);
//! Starts an fsync of `fd` through POSIX AIO in `cb`, first waiting for the one before
//! (`busy`).
void next_aio_fsync(int fd, aiocb& cb, bool& busy);

//! randread (aiobench_randread.cpp).
json measure_randread(const std::string& dir, std::uint64_t bytes, unsigned threads,
                      double seconds);

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

inline const workload_variant plain_workload{
    "workload", "compute + 64 KiB write per item", {1, 30, 300}, false, false};
inline const workload_variant overwrite_workload{
    "overwrite", "compute + 64 KiB write + its overwrite per item", {30, 300}, true, false};
inline const workload_variant direct_overwrite_workload{
    "overwrite_direct",
    "O_DIRECT: compute + 64 KiB write + its overwrite per item",
    {30, 300},
    true,
    true};

//! The workload's methods: the peers, then keel's engines without and with the cache.
std::vector<std::string> workload_methods();
//! The thesis workload in form `v` (aiobench_workload.cpp), by the methods `asked`.
json measure_workload(const std::string& dir, std::uint64_t items,
                      const std::vector<std::string>& asked, const workload_variant& v);

//! A directory of keel's own in /dev/shm when that is a tmpfs, else empty.
std::string memory_dir();
//! Many small requests (aiobench_small.cpp), in `dir`, said to be `where`.
json measure_small(const std::string& dir, const std::string& where, std::uint64_t items);

//! The null engine: the framework's own cost per request (aiobench_null.cpp).
json measure_null(const std::string& dir, double seconds);

}  // namespace keel::tools::aiobench
