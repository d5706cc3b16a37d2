// The engines that run one request at a time per thread: posix (pread/pwrite/fsync), stdio
// (<cstdio>) and null (no I/O at all, to measure the framework).

#include <unistd.h>

#include <system_error>

#include "cache.hpp"
#include "detail.hpp"

namespace keel::aio::detail {
namespace {

result<std::size_t> run_stdio(op& o) noexcept {
  file_state& f = *o.file;
  const std::scoped_lock lock(f.stdio_mutex);
  std::FILE* s = f.stdio;
  // A positioning call between reads and writes, as C requires, before every request.
  const auto seek = [&]() -> result<void> {
    if (::fseeko(s, static_cast<off_t>(o.offset), SEEK_SET) != 0) return last_errno_error();
    return {};
  };
  switch (o.kind) {
    case op_kind::read: {
      if (auto r = seek(); !r) return std::unexpected(r.error());
      const std::size_t n = std::fread(o.buffer, 1, o.length, s);
      if (n < o.length && std::ferror(s) != 0) {
        std::clearerr(s);
        return errc_error(std::errc::io_error);
      }
      std::clearerr(s);  // end of file is not sticky for the next request
      return n;
    }
    case op_kind::write: {
      if (auto r = seek(); !r) return std::unexpected(r.error());
      const std::size_t n = std::fwrite(o.buffer, 1, o.length, s);
      if (n < o.length) {
        const int e = errno != 0 ? errno : EIO;
        std::clearerr(s);
        return errno_error(e);
      }
      return n;
    }
    case op_kind::fsync:
    case op_kind::fdatasync:
      if (std::fflush(s) != 0) return last_errno_error();
      if ((o.kind == op_kind::fsync ? ::fsync(fileno(s)) : ::fdatasync(fileno(s))) != 0) {
        return last_errno_error();
      }
      return 0;
    case op_kind::task:
      break;  // below, without the lock
  }
  return errc_error(std::errc::invalid_argument);
}

// A task sees the file as the thread's earlier requests left it: what they wrote through
// the stdio buffer is flushed first.
result<std::size_t> run_stdio_task(op& o) noexcept {
  {
    const std::scoped_lock lock(o.file->stdio_mutex);
    if (std::fflush(o.file->stdio) != 0) return last_errno_error();
  }
  return o.task();
}

class sync_worker final : public worker {
 public:
  sync_worker(controller::impl& c, engine_kind k) : worker(c), kind_(k) {}
  ~sync_worker() override { join(); }

  void wake() noexcept override {
    signal_.fetch_add(1);
    base::futex_wake(signal_, 1);
  }

  bool help() noexcept override {
    op* list = take_all();
    bool ran = false;
    while (list != nullptr) {
      op* o = list;
      list = o->next;
      if (o->kind == op_kind::task) {
        push(o, o);  // tasks run on the controller's threads only
      } else {
        execute(*o);
        ran = true;
      }
    }
    return ran;
  }

  result<void> start() noexcept override {
    try {
      thread_ = std::thread([this] { run(); });
    } catch (const std::system_error& e) {
      return std::unexpected(e.code());
    }
    return {};
  }

 private:
  void run() noexcept {
    for (;;) {
      op* list = take_all();
      if (list == nullptr) {
        if (may_exit()) return;
        if (spin_for_work() && !inbox_empty()) continue;
        const std::uint32_t seen = signal_.load();
        sleeping_.store(true);
        if (inbox_empty() && !may_exit()) {
          base::futex_wait(signal_, seen, nullptr);
        }
        sleeping_.store(false);
        continue;
      }
      while (list != nullptr) {
        op* o = list;
        list = o->next;
        execute(*o);
      }
    }
  }

  void execute(op& o) noexcept {
    if (ctl_.stopping.load(std::memory_order_relaxed)) {
      ctl_.finish(&o, 0, true);
      return;
    }
    if (o.file->cache) {
      if (auto done = cache_handle(ctl_, o, true)) {
        ctl_.finish(&o, *done);
        return;
      }
    }
    switch (kind_) {
      case engine_kind::null:
        ctl_.finish(&o, o.kind == op_kind::task                               ? o.task()
                        : o.kind == op_kind::read || o.kind == op_kind::write ? o.length
                                                                              : 0);
        return;
      case engine_kind::stdio:
        ctl_.finish(&o, o.kind == op_kind::task ? run_stdio_task(o) : run_stdio(o));
        return;
      default:
        ctl_.finish(&o, controller::impl::run_posix(o));
        return;
    }
  }

  engine_kind kind_;
  std::atomic<std::uint32_t> signal_{0};  // futex word: bumped by wake()
};

}  // namespace

std::unique_ptr<worker> make_sync_worker(controller::impl& c, engine_kind k) {
  return std::make_unique<sync_worker>(c, k);
}

}  // namespace keel::aio::detail
