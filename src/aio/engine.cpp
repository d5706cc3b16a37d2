// Engines in general: their names, the choice of one when a controller starts, and the
// write path the write-back cache uses unless an engine has its own.

#include "engine.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "detail.hpp"
#include "keel/aio/errors.hpp"

namespace keel::aio {

std::string_view to_string(engine_kind k) noexcept {
  switch (k) {
    case engine_kind::io_uring:
      return "io_uring";
    case engine_kind::posix:
      return "posix";
    case engine_kind::stdio:
      return "stdio";
    case engine_kind::null:
      return "null";
  }
  return "unknown";
}

result<engine_kind> engine_from_string(std::string_view name) noexcept {
  for (const auto k :
       {engine_kind::io_uring, engine_kind::posix, engine_kind::stdio, engine_kind::null}) {
    if (name == to_string(k)) return k;
  }
  return errc_error(std::errc::invalid_argument);
}

}  // namespace keel::aio

namespace keel::aio::detail {
namespace {

std::unique_ptr<engine> make_engine(controller::impl& c, engine_kind k,
                                    std::vector<std::span<std::byte>>& buffers) noexcept {
  switch (k) {
    case engine_kind::io_uring:
      return make_uring_engine(c.context, std::move(buffers));
    case engine_kind::posix:
      return make_posix_engine(c.context);
    case engine_kind::stdio:
      return make_stdio_engine(c.context);
    case engine_kind::null:
      return make_null_engine(c.context);
  }
  return nullptr;
}

// Makes the engine of kind `k` and starts `n` workers of it into `c`; on failure stops those
// already started and leaves `c` without an engine.
result<void> start_workers(controller::impl& c, engine_kind k, unsigned n,
                           std::vector<std::span<std::byte>>& buffers) noexcept {
  c.engine = make_engine(c, k, buffers);
  if (!c.engine) return errc_error(std::errc::not_enough_memory);
  for (unsigned i = 0; i < n; ++i) {
    auto w = c.engine->make_worker(i);
    auto s = w ? w->start() : result<void>(errc_error(std::errc::not_enough_memory));
    if (!s) {
      c.stopping.store(true);
      for (auto& started : c.workers) {
        started->wake();
        started->join();
      }
      c.workers.clear();
      c.engine.reset();
      c.stopping.store(false);
      return s;
    }
    c.workers.push_back(std::move(w));
  }
  static std::atomic<std::uint64_t> ids{0};
  c.timed_callers = c.opts.submit_on == submitter::adaptive ? ids.fetch_add(1) + 1 : 0;
  return {};
}

// Why io_uring could not start, for fallback_reason.
std::string uring_failure(const error& e) {
  std::string why = "io_uring could not start: " + e.message();
  if (e == std::errc::operation_not_permitted) {
    if (std::FILE* f = std::fopen("/proc/sys/kernel/io_uring_disabled", "r")) {
      int v = 0;
      if (std::fscanf(f, "%d", &v) == 1 && v != 0) {
        why += " (kernel.io_uring_disabled=" + std::to_string(v) + ")";
      }
      std::fclose(f);
    }
  }
  return why;
}

}  // namespace

result<void> engine::write_out(file_state& f, std::uint64_t offset,
                               std::span<const iovec> data) noexcept {
  // Through the seam, as the posix engine writes: short writes continued, EINTR retried.
  return f.handle.write_at(static_cast<off_t>(offset), data);
}

result<void> start_engine(controller::impl& c, std::vector<std::span<std::byte>> buffers) noexcept {
  std::optional<engine_kind> wanted = c.opts.engine;
  if (const char* env = std::getenv("KEEL_AIO_ENGINE"); env != nullptr && *env != '\0') {
    auto k = engine_from_string(env);
    if (!k) return std::unexpected(k.error());
    wanted = *k;
  }
  if (const char* env = std::getenv("KEEL_AIO_SUBMIT_ON"); env != nullptr && *env != '\0') {
    const std::string_view v(env);
    if (v == "adaptive") {
      c.opts.submit_on = submitter::adaptive;
    } else if (v == "caller") {
      c.opts.submit_on = submitter::caller;
    } else if (v == "workers") {
      c.opts.submit_on = submitter::workers;
    } else {
      return errc_error(std::errc::invalid_argument);
    }
  }
  const unsigned n = c.opts.workers;
  if (c.opts.fs != &io::os()) {
    // Only the posix engine runs requests through the filesystem; io_uring and stdio would
    // go around it (and io_uring must not pay a virtual call per request).
    if (wanted && *wanted != engine_kind::posix && *wanted != engine_kind::null) {
      return std::unexpected(make_error_code(errc::not_supported_by_engine));
    }
    if (!wanted) {
      c.fallback_reason = "options::fs is not the OS's: only the posix engine goes through it";
      wanted = engine_kind::posix;
    }
  }
  if (wanted) return start_workers(c, *wanted, n, buffers);
  auto s = start_workers(c, engine_kind::io_uring, n, buffers);
  if (s) return {};
  try {
    c.fallback_reason = uring_failure(s.error());
  } catch (const std::bad_alloc&) {
    c.fallback_reason.clear();  // a reason is context, never worth failing for
  }
  return start_workers(c, engine_kind::posix, n, buffers);
}

}  // namespace keel::aio::detail
