// keel-bench aiobench: what its measurements share (aiobench.hpp).

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

#include "keel/io/filesystem.hpp"
#include "keel/io/fs_info.hpp"

namespace keel::tools::aiobench {

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

void progress(const std::string& what) {
  fmt::print(stderr, "aiobench: {}\n", what);
}

void fail(const std::string& what, const std::error_code& ec) {
  throw std::runtime_error(what + ": " + ec.message());
}

std::string engine_unavailable(aio::engine_kind e) {
  aio::options o;
  o.engine = e;
  o.workers = 1;
  auto c = aio::controller::start(o);
  return c ? std::string()
           : fmt::format("{} cannot start here: {}", aio::to_string(e), c.error().message());
}

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

}  // namespace keel::tools::aiobench
