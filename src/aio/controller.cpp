#include "keel/aio/controller.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <new>

#include "cache.hpp"
#include "detail.hpp"

namespace keel::aio {
namespace {

using detail::op;
using detail::op_kind;

constexpr std::uint32_t status_of(std::uint32_t state) noexcept {
  return state & 0xff;
}

// A request refused before it ran: finished on the submitting thread, never counted.
receipt refuse(op* o, const error& why) noexcept {
  receipt r = detail::receipt_access::make(o);
  o->error = why;
  if (o->on_done) o->on_done(std::unexpected(why));
  o->state.store(static_cast<std::uint32_t>(status::failed), std::memory_order_release);
  o->unref();  // the controller's reference: the receipt keeps the op
  return r;
}

thread_local base::adaptive_spin waiter_spin;  // this thread's waits on receipts
std::atomic<std::uint64_t> next_file_id{1};    // process-wide: io_uring's table entries of
                                               // closed files (of any controller) never match

}  // namespace

// ---- ordering ----

bool detail::must_follow(const op& earlier, const op& later) noexcept {
  if (earlier.kind == op_kind::task || later.kind == op_kind::task) return true;
  const auto is_sync = [](op_kind k) { return k == op_kind::fsync || k == op_kind::fdatasync; };
  if (is_sync(later.kind)) return earlier.kind == op_kind::write && earlier.length != 0;
  if (is_sync(earlier.kind)) return false;
  if (earlier.kind == op_kind::read && later.kind == op_kind::read) return false;
  if (earlier.length == 0 || later.length == 0) return false;  // sees nothing, changes nothing
  return earlier.offset < later.offset + later.length &&
         later.offset < earlier.offset + earlier.length;
}

bool detail::stream::may_wait(const op& later) const noexcept {
  if (later.kind == op_kind::task) return !unfinished.empty();
  if (tasks_ != 0) return true;
  const auto overlaps = [&](std::uint64_t lo, std::uint64_t hi) {
    return lo < later.offset + later.length && later.offset < hi;
  };
  switch (later.kind) {
    case op_kind::fsync:
    case op_kind::fdatasync:
      return writes_ != 0;
    case op_kind::read:
      return overlaps(written_lo_, written_hi_);
    case op_kind::write:
      return overlaps(touched_lo_, touched_hi_);
    case op_kind::task:
      break;
  }
  return true;
}

bool detail::stream::append(op& o) noexcept {
  bool ready = true;
  if (may_wait(o)) {
    for (const op* earlier : unfinished) {
      if (must_follow(*earlier, o)) {
        ready = false;
        break;
      }
    }
  }
  unfinished.push_back(&o);
  const std::uint64_t end = o.offset + o.length;
  switch (o.kind) {
    case op_kind::task:
      ++tasks_;
      break;
    case op_kind::write:
      ++writes_;
      written_lo_ = std::min(written_lo_, o.offset);
      written_hi_ = std::max(written_hi_, end);
      [[fallthrough]];
    case op_kind::read:
      touched_lo_ = std::min(touched_lo_, o.offset);
      touched_hi_ = std::max(touched_hi_, end);
      break;
    case op_kind::fsync:
    case op_kind::fdatasync:
      break;
  }
  return ready;
}

bool detail::stream::chainable(std::size_t first) noexcept {
  op& later = *unfinished.back();
  const std::size_t n = unfinished.size() - 1;
  for (std::size_t i = 0; i < n; ++i) {
    const op& earlier = *unfinished[i];
    if (must_follow(earlier, later) && (i < first || !earlier.dispatched)) return false;
  }
  for (std::size_t i = first; i < n; ++i) {
    if (must_follow(*unfinished[i], later)) unfinished[i]->chained = true;
  }
  later.chained = true;
  return true;
}

void detail::stream::remove(op& o) noexcept {
  if (!unfinished.empty() && unfinished.front() == &o) {
    unfinished.pop_front();  // the usual case: requests end in order
  } else {
    for (auto it = unfinished.begin(); it != unfinished.end(); ++it) {
      if (*it == &o) {
        unfinished.erase(it);
        break;
      }
    }
  }
  if (o.kind == op_kind::task) --tasks_;
  if (o.kind == op_kind::write) --writes_;
  if (unfinished.empty()) {
    written_lo_ = touched_lo_ = UINT64_MAX;
    written_hi_ = touched_hi_ = 0;
  }
}

detail::file_state::~file_state() {
  if (slot >= 0) owner->release_slot(*this);  // opened, then failed before it was used
  if (stdio != nullptr) std::fclose(stdio);
  if (fd >= 0) ::close(fd);
}

result<detail::stream*> detail::file_state::stream_of_this_thread() noexcept {
  return streams.get<stream>([]() -> result<std::unique_ptr<stream>> {
    std::unique_ptr<stream> s(new (std::nothrow) stream);
    if (!s) return errc_error(std::errc::not_enough_memory);
    return s;
  });
}

// ---- workers' inboxes ----

void detail::worker::push(op* first, op* last) noexcept {
  // The inbox is a stack (newest first); the chain arrives oldest first: reverse it so that
  // take_all, which reverses the whole stack, gives everything back oldest first.
  op* reversed = nullptr;
  for (op* o = first;;) {
    op* next = o->next;
    o->next = reversed;
    reversed = o;
    if (o == last) break;
    o = next;
  }
  op* head = inbox_.load(std::memory_order_relaxed);
  do {
    first->next = head;  // `first` is the tail of the reversed chain
  } while (!inbox_.compare_exchange_weak(head, reversed, std::memory_order_seq_cst,
                                         std::memory_order_relaxed));
  if (sleeping_.load(std::memory_order_seq_cst)) wake();
}

detail::op* detail::worker::take_all() noexcept {
  op* o = inbox_.exchange(nullptr, std::memory_order_seq_cst);
  op* fifo = nullptr;
  while (o != nullptr) {
    op* next = o->next;
    o->next = fifo;
    fifo = o;
    o = next;
  }
  return fifo;
}

bool detail::worker::spin_for_work() noexcept {
  return idle_spin_.spin(
      [&] { return !inbox_empty() || ctl_.stopping.load(std::memory_order_relaxed); });
}

bool detail::worker::may_exit() const noexcept {
  return ctl_.stopping.load() && ctl_.outstanding.load() == 0;
}

// ---- the controller ----

bool controller::impl::help() noexcept {
  for (auto& w : workers) {
    if (w->help()) return true;
  }
  return false;
}

void controller::impl::dispatch(op* o, unsigned& next_worker) noexcept {
  detail::worker& w = *workers[next_worker++ % workers.size()];
  o->next = nullptr;
  w.push(o, o);
}

int controller::impl::buffer_index(const std::byte* p, std::size_t n) const noexcept {
  // The last region starting at or before p.
  auto it = std::upper_bound(buffers.begin(), buffers.end(), p,
                             [](const std::byte* q, const auto& b) { return q < b.data(); });
  if (it == buffers.begin()) return -1;
  --it;
  const auto offset = static_cast<std::size_t>(p - it->data());
  if (offset > it->size() || n > it->size() - offset) return -1;
  return static_cast<int>(it - buffers.begin());
}

int controller::impl::take_slot() noexcept {
  if (kind != engine_kind::io_uring) return -1;
  const std::scoped_lock lock(slots_mutex);
  if (!free_slots.empty()) {
    const int slot = free_slots.back();
    free_slots.pop_back();
    return slot;
  }
  return next_slot < static_cast<int>(file_slots) ? next_slot++ : -1;
}

void controller::impl::release_slot(detail::file_state& f) noexcept {
  const std::uint64_t rings = f.registered_in.load();
  for (std::size_t i = 0; i < workers.size(); ++i) {
    if ((rings & (std::uint64_t{1} << (i % 64))) != 0) workers[i]->forget(f.slot, f.id);
  }
  const std::scoped_lock lock(slots_mutex);
  free_slots.push_back(f.slot);  // reserved for every slot at start
  f.slot = -1;
}

controller::impl::impl() = default;
controller::impl::~impl() = default;

void controller::impl::finish(op* o, result<std::size_t> outcome, bool cancelled) noexcept {
  status st = status::done;
  if (cancelled) outcome = std::unexpected(make_error_code(errc::controller_stopped));
  if (o->reads_file) detail::cache_read_finished(*o, outcome);
  if (cancelled) {
    st = status::cancelled;
  } else if (!outcome) {
    st = status::failed;
  }
  if (outcome) {
    o->done = *outcome;
  } else {
    o->error = outcome.error();
  }
  if (o->on_done) o->on_done(outcome);
  const std::uint32_t before =
      o->state.exchange(static_cast<std::uint32_t>(st), std::memory_order_acq_rel);
  if ((before & op::has_waiters) != 0) base::futex_wake(o->state);

  if (detail::stream* s = o->owner; s != nullptr) {
    // Hand on the ops of the stream that no earlier unfinished op holds back any more.
    std::array<op*, 16> ready{};
    std::size_t n_ready = 0;
    std::vector<op*> more;
    unsigned first_worker = 0;
    {
      const std::scoped_lock lock(s->mutex);
      s->remove(*o);
      for (std::size_t i = 0; s->held_back != 0 && i < s->unfinished.size(); ++i) {
        op* y = s->unfinished[i];
        if (y->dispatched) continue;
        bool held_back = false;
        for (std::size_t j = 0; j < i && !held_back; ++j)
          held_back = detail::must_follow(*s->unfinished[j], *y);
        if (held_back) continue;
        y->dispatched = true;
        --s->held_back;
        if (n_ready < ready.size()) {
          ready[n_ready++] = y;
        } else {
          more.push_back(y);
        }
      }
      first_worker = s->next_worker;
      s->next_worker += static_cast<unsigned>(n_ready + more.size());
    }
    for (std::size_t i = 0; i < n_ready; ++i)
      dispatch(ready[i], first_worker);
    for (op* y : more)
      dispatch(y, first_worker);
  }

  detail::file_state& f = *o->file;
  if (f.in_flight.fetch_sub(1) == 1 && f.closed.load()) base::futex_wake(f.in_flight);
  if (outstanding.fetch_sub(1) == 1 && stopping.load()) {
    outstanding.notify_all();
    for (auto& w : workers)
      w->wake();
  }
  o->unref();
}

result<std::size_t> controller::impl::run_posix(op& o) noexcept {
  const int fd = o.file->fd;
  switch (o.kind) {
    case op_kind::read:
      while (o.done < o.length) {
        const ssize_t n = ::pread(fd, o.buffer + o.done, o.length - o.done,
                                  static_cast<off_t>(o.offset + o.done));
        if (n < 0) {
          if (errno == EINTR) continue;
          return last_errno_error();
        }
        if (n == 0) break;  // end of file
        o.done += static_cast<std::size_t>(n);
      }
      return o.done;
    case op_kind::write:
      while (o.done < o.length) {
        const ssize_t n = ::pwrite(fd, o.buffer + o.done, o.length - o.done,
                                   static_cast<off_t>(o.offset + o.done));
        if (n < 0) {
          if (errno == EINTR) continue;
          return last_errno_error();
        }
        if (n == 0) return errc_error(std::errc::io_error);  // no progress: never spin
        o.done += static_cast<std::size_t>(n);
      }
      return o.done;
    case op_kind::fsync:
      if (::fsync(fd) != 0) return last_errno_error();  // never retried: the error is the news
      return 0;
    case op_kind::fdatasync:
      if (::fdatasync(fd) != 0) return last_errno_error();
      return 0;
    case op_kind::task:
      return o.task();
  }
  return errc_error(std::errc::invalid_argument);
}

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

controller::controller(std::shared_ptr<impl> p) noexcept : impl_(std::move(p)) {}

controller::~controller() {
  stop();
}

namespace {

// Starts `n` workers of kind `k` into `c`; on failure stops those already started.
result<void> start_workers(controller::impl& c, engine_kind k, unsigned n) noexcept {
  for (unsigned i = 0; i < n; ++i) {
    auto w = k == engine_kind::io_uring ? detail::make_uring_worker(c, i)
                                        : detail::make_sync_worker(c, k);
    if (auto s = w->start(); !s) {
      c.stopping.store(true);
      for (auto& started : c.workers) {
        started->wake();
        started->join();
      }
      c.workers.clear();
      c.stopping.store(false);
      return s;
    }
    c.workers.push_back(std::move(w));
  }
  return {};
}

}  // namespace

result<std::unique_ptr<controller>> controller::start(options opts) noexcept {
  if (opts.workers == 0 || opts.queue_depth == 0 || opts.cache_soft_limit > opts.cache_hard_limit) {
    return errc_error(std::errc::invalid_argument);
  }
  std::optional<engine_kind> wanted = opts.engine;
  if (const char* env = std::getenv("KEEL_AIO_ENGINE"); env != nullptr && *env != '\0') {
    auto k = engine_from_string(env);
    if (!k) return std::unexpected(k.error());
    wanted = *k;
  }
  auto p = std::make_shared<impl>();
  p->buffers = std::move(opts.registered_buffers);  // opts is copied next: without them
  p->opts = opts;
  std::sort(p->buffers.begin(), p->buffers.end(),
            [](const auto& a, const auto& b) { return a.data() < b.data(); });
  for (std::size_t i = 0; i < p->buffers.size(); ++i) {
    const auto& b = p->buffers[i];
    const bool overlaps = i > 0 && p->buffers[i - 1].data() + p->buffers[i - 1].size() > b.data();
    if (b.empty() || b.size() > (std::size_t{1} << 30) || overlaps) {
      return errc_error(std::errc::invalid_argument);
    }
  }
  if (opts.register_files) {
    // The kernel refuses a table larger than RLIMIT_NOFILE.
    rlimit nofile{};
    p->file_slots = 1024;
    if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < p->file_slots) {
      p->file_slots = static_cast<unsigned>(nofile.rlim_cur);
    }
    try {
      p->free_slots.reserve(p->file_slots);
    } catch (const std::bad_alloc&) {
      return errc_error(std::errc::not_enough_memory);
    }
  }
  if (opts.cache_hard_limit != 0) {
    p->cache = std::make_unique<detail::cache_control>();
    p->cache->soft = opts.cache_soft_limit;
    p->cache->hard = opts.cache_hard_limit;
    p->cache->idle = std::max(opts.cache_idle_round, std::chrono::milliseconds(1));
  }
  if (wanted) {
    p->kind = *wanted;
    if (auto s = start_workers(*p, *wanted, opts.workers); !s) {
      return std::unexpected(s.error());
    }
  } else {
    p->kind = engine_kind::io_uring;
    if (auto s = start_workers(*p, engine_kind::io_uring, opts.workers); !s) {
      p->fallback_reason = "io_uring could not start: " + s.error().message();
      if (s.error() == std::errc::operation_not_permitted) {
        if (std::FILE* f = std::fopen("/proc/sys/kernel/io_uring_disabled", "r")) {
          int v = 0;
          if (std::fscanf(f, "%d", &v) == 1 && v != 0) {
            p->fallback_reason += " (kernel.io_uring_disabled=" + std::to_string(v) + ")";
          }
          std::fclose(f);
        }
      }
      p->kind = engine_kind::posix;
      if (auto t = start_workers(*p, engine_kind::posix, opts.workers); !t) {
        return std::unexpected(t.error());
      }
    }
  }
  if (p->cache) {
    if (auto s = detail::cache_start(*p); !s) {
      controller stopping(std::move(p));  // its destructor stops the workers
      return std::unexpected(s.error());
    }
  }
  return std::unique_ptr<controller>(new controller(std::move(p)));
}

void controller::stop() noexcept {
  impl& c = *impl_;
  const std::scoped_lock lock(c.stop_mutex);
  if (c.stopped) return;
  c.stopping.store(true);
  for (auto& w : c.workers)
    w->wake();
  // Every request still queued or held back is cancelled by the workers; running ones end.
  for (std::uint64_t n = c.outstanding.load(); n != 0; n = c.outstanding.load())
    c.outstanding.wait(n);
  for (auto& w : c.workers) {
    w->wake();
    w->join();
  }
  // Cached writes finished: their bytes go to the files now (an error waits for close).
  if (c.cache) detail::cache_stop(c);
  c.stopped = true;
}

engine_kind controller::engine() const noexcept {
  return impl_->kind;
}
const std::string& controller::fallback_reason() const noexcept {
  return impl_->fallback_reason;
}
unsigned controller::workers() const noexcept {
  return static_cast<unsigned>(impl_->workers.size());
}

cache_stats controller::cache() const noexcept {
  cache_stats s;
  if (const detail::cache_control* cc = impl_->cache.get(); cc != nullptr) {
    s.cached_bytes = cc->bytes.load();
    s.dirty_bytes = cc->dirty_pages.load() * detail::page_size;
    s.writes_cached = cc->writes.load();
    s.writes_bypassed = cc->bypassed.load();
    s.reads_served = cc->read_hits.load();
    s.bytes_written_out = cc->written_out.load();
  }
  return s;
}

engine_stats controller::engine_counts() const noexcept {
  engine_stats s;
  for (const auto& w : impl_->workers)
    w->add_counts(s);
  return s;
}

result<file> controller::open(const std::string& path, open_options how) noexcept {
  if (!how.read && !how.write) return errc_error(std::errc::invalid_argument);
  if ((how.create || how.truncate) && !how.write) return errc_error(std::errc::invalid_argument);
  if (how.direct && impl_->kind == engine_kind::stdio) {
    return std::unexpected(make_error_code(errc::not_supported_by_engine));
  }
  if (how.direct && how.cache)
    return std::unexpected(make_error_code(errc::cache_needs_buffered_io));
  int flags = O_CLOEXEC | (how.read && how.write ? O_RDWR : how.write ? O_WRONLY : O_RDONLY);
  if (how.create) flags |= O_CREAT;
  if (how.truncate) flags |= O_TRUNC;
  if (how.direct) flags |= O_DIRECT;
  const int fd = ::open(path.c_str(), flags, 0644);
  if (fd < 0) return last_errno_error();
  auto s = std::make_shared<detail::file_state>();
  s->fd = fd;
  s->owner = impl_;
  s->id = next_file_id.fetch_add(1);
  s->readable = how.read;
  s->writable = how.write;
  s->direct = how.direct;
  s->slot = impl_->take_slot();
  if (how.direct) {
    // The kernel says what O_DIRECT needs (Linux 6.1+); else the logical block size is the
    // safe bet.
    struct statx sx {};
    std::size_t align = 0;
#ifdef STATX_DIOALIGN
    if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
        (sx.stx_mask & STATX_DIOALIGN) != 0 && sx.stx_dio_offset_align != 0) {
      align = std::max<std::size_t>(sx.stx_dio_offset_align, sx.stx_dio_mem_align);
    }
#endif
    if (align == 0) align = 4096;
    s->align = align;
  }
  if (impl_->kind == engine_kind::stdio) {
    const int dup_fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup_fd < 0) return last_errno_error();
    s->stdio = ::fdopen(dup_fd, how.read && how.write ? "r+" : how.write ? "w" : "r");
    if (s->stdio == nullptr) {
      const int e = errno;
      ::close(dup_fd);
      return errno_error(e);
    }
  }
  if (how.cache && impl_->cache) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return last_errno_error();
    try {
      s->cache = std::make_unique<detail::file_cache>();
      s->cache->logical_size = static_cast<std::uint64_t>(st.st_size);
      const std::scoped_lock lock(impl_->cache->files_mutex);
      impl_->cache->files.push_back(s);
    } catch (const std::bad_alloc&) {
      return errc_error(std::errc::not_enough_memory);
    }
  }
  return file(std::move(s));
}

// ---- files ----

namespace {

// Why keel refuses `o` on `f` before running it, or nothing.
error refusal(const detail::file_state* f, const op& o) noexcept {
  if (f == nullptr) return make_error_code(errc::file_closed);
  if ((o.kind == op_kind::read && !f->readable) || (o.kind == op_kind::write && !f->writable)) {
    return make_error_code(errc::not_opened_for);
  }
  if (o.kind == op_kind::read || o.kind == op_kind::write) {
    if (o.buffer == nullptr && o.length != 0) return make_error_code(errc::bad_request);
    constexpr auto max_offset = static_cast<std::uint64_t>(std::numeric_limits<off_t>::max());
    if (o.offset > max_offset || o.length > max_offset - o.offset) {
      return make_error_code(errc::bad_request);
    }
    if (f->direct && (o.offset % f->align != 0 || o.length % f->align != 0 ||
                      reinterpret_cast<std::uintptr_t>(o.buffer) % f->align != 0)) {
      return make_error_code(errc::misaligned_direct_io);
    }
  }
  return {};
}

// Finishes a counted-in `o` at once if its file is closed (file_closed) or the controller
// is stopping (cancelled); whether it did.
bool finished_as_shut(controller::impl& c, detail::file_state& f, op* o) noexcept {
  if (f.closed.load()) {
    o->error = make_error_code(errc::file_closed);
    c.finish(o, std::unexpected(o->error));
    return true;
  }
  if (c.stopping.load()) {
    c.finish(o, 0, true);
    return true;
  }
  return false;
}

receipt submit_one(const std::shared_ptr<detail::file_state>& f, op* o) noexcept {
  o->file = f;
  if (const error why = refusal(f.get(), *o)) return refuse(o, why);
  controller::impl& c = *f->owner;
  // Counted in before the flags are read; close() and stop() set their flag before they
  // wait for the counts: either we see the flag, or they see us.
  f->in_flight.fetch_add(1);
  c.outstanding.fetch_add(1);
  receipt r = detail::receipt_access::make(o);
  if (finished_as_shut(c, *f, o)) return r;
  const auto mine = f->stream_of_this_thread();
  if (!mine) {
    c.finish(o, std::unexpected(mine.error()));
    return r;
  }
  detail::stream& s = **mine;
  o->owner = &s;
  bool ready = true;
  unsigned worker_index = 0;
  {
    const std::scoped_lock lock(s.mutex);
    ready = s.append(*o);
    if (ready) {
      o->dispatched = true;
      worker_index = s.next_worker++;
    } else {
      ++s.held_back;
    }
  }
  if (ready) {
    // The cache finishes a write, or a read it holds, here and now.
    if (f->cache) {
      if (auto done = detail::cache_handle(c, *o, false)) {
        c.finish(o, *done);
        return r;
      }
    }
    c.dispatch(o, worker_index);
  }
  return r;
}

op* make_op(op_kind k, std::uint64_t offset, std::byte* buffer, std::size_t length,
            completion on_done) noexcept {
  op* o = new op;
  o->kind = k;
  o->offset = offset;
  o->buffer = buffer;
  o->length = length;
  o->on_done = std::move(on_done);
  o->ref();  // one for the receipt
  return o;
}

}  // namespace

file::file(file&& other) noexcept : state_(std::move(other.state_)) {}

file& file::operator=(file&& other) noexcept {
  if (this != &other) {
    (void)close();
    state_ = std::move(other.state_);
  }
  return *this;
}

file::~file() {
  (void)close();
}

bool file::is_open() const noexcept {
  return state_ != nullptr;
}
bool file::is_direct() const noexcept {
  return state_ && state_->direct;
}
std::size_t file::alignment() const noexcept {
  return state_ ? state_->align : 1;
}

receipt file::read(std::uint64_t offset, std::span<std::byte> into, completion on_done) noexcept {
  return submit_one(state_,
                    make_op(op_kind::read, offset, into.data(), into.size(), std::move(on_done)));
}

receipt file::write(std::uint64_t offset, std::span<const std::byte> data,
                    completion on_done) noexcept {
  // The engines only read from a write's buffer.
  return submit_one(state_, make_op(op_kind::write, offset, const_cast<std::byte*>(data.data()),
                                    data.size(), std::move(on_done)));
}

receipt file::fsync(completion on_done) noexcept {
  return submit_one(state_, make_op(op_kind::fsync, 0, nullptr, 0, std::move(on_done)));
}

receipt file::fdatasync(completion on_done) noexcept {
  return submit_one(state_, make_op(op_kind::fdatasync, 0, nullptr, 0, std::move(on_done)));
}

receipt file::submit(std::function<result<std::size_t>()> task, completion on_done) noexcept {
  op* o = make_op(op_kind::task, 0, nullptr, 0, std::move(on_done));
  o->task = std::move(task);
  return submit_one(state_, o);
}

void file::submit(std::span<request> requests, std::span<receipt> out) noexcept {
  const auto make = [](request& q) {
    const op_kind k = q.what == request::kind::read    ? op_kind::read
                      : q.what == request::kind::write ? op_kind::write
                      : q.what == request::kind::fsync ? op_kind::fsync
                                                       : op_kind::fdatasync;
    return make_op(k, q.offset, q.buffer.data(), q.buffer.size(), std::move(q.on_done));
  };
  const auto give = [&](std::size_t i, receipt r) {
    if (i < out.size()) out[i] = std::move(r);
  };
  // A cached file finishes requests one by one as they come (cache_handle).
  if (!state_ || state_->cache || requests.size() < 2) {
    for (std::size_t i = 0; i < requests.size(); ++i)
      give(i, submit_one(state_, make(requests[i])));
    return;
  }
  // The batch in one piece: one count, one turn of the stream's lock, one hand-over per
  // worker.
  detail::file_state& f = *state_;
  controller::impl& c = *f.owner;
  // Local, not thread_local: a completion run here (a refusal, a shut file) may submit a
  // batch of its own on this thread.
  std::vector<op*> accepted;
  std::vector<op*> ready;
  detail::chain* ch = nullptr;  // io_uring: requests that wait for one another in a worker
  op* chain_head = nullptr;
  op* chain_tail = nullptr;
  try {
    accepted.reserve(requests.size());
    ready.reserve(requests.size());
  } catch (const std::bad_alloc&) {
    for (std::size_t i = 0; i < requests.size(); ++i)
      give(i, submit_one(state_, make(requests[i])));
    return;
  }
  for (std::size_t i = 0; i < requests.size(); ++i) {
    op* o = make(requests[i]);
    o->file = state_;
    if (const error why = refusal(&f, *o)) {
      give(i, refuse(o, why));
      continue;
    }
    give(i, detail::receipt_access::make(o));
    accepted.push_back(o);
  }
  if (accepted.empty()) return;
  f.in_flight.fetch_add(static_cast<std::uint32_t>(accepted.size()));
  c.outstanding.fetch_add(accepted.size());
  if (f.closed.load() || c.stopping.load()) {
    for (op* o : accepted)
      (void)finished_as_shut(c, f, o);
    return;
  }
  const auto mine = f.stream_of_this_thread();
  if (!mine) {
    for (op* o : accepted)
      c.finish(o, std::unexpected(mine.error()));
    return;
  }
  detail::stream& s = **mine;
  // With io_uring, a request that must follow only earlier ones of this batch waits for
  // them in their worker (one chain, one ring), where the other engines hold it back here
  // until they have finished and hand it over then.
  const bool may_chain = c.kind == engine_kind::io_uring;
  unsigned first_worker = 0;
  {
    const std::scoped_lock lock(s.mutex);
    const std::size_t first = s.unfinished.size();
    bool chained = false;
    for (op* o : accepted) {
      o->owner = &s;
      if (s.append(*o)) {
        o->dispatched = true;
        ready.push_back(o);
      } else if (may_chain && (ch != nullptr || (ch = new (std::nothrow) detail::chain)) &&
                 s.chainable(first)) {
        o->dispatched = true;
        o->barrier = true;
        ready.push_back(o);
        chained = true;
      } else {
        ++s.held_back;
      }
    }
    if (chained) {
      // The chain: every request marked, in submission order; the rest of `ready` goes
      // round robin.
      std::size_t kept = 0;
      for (op* o : ready) {
        if (o->chained) {
          o->chained = false;
          o->in_chain = ch;
          ++ch->refs;
          o->next = nullptr;
          (chain_tail != nullptr ? chain_tail->next : chain_head) = o;
          chain_tail = o;
        } else {
          ready[kept++] = o;
        }
      }
      ready.resize(kept);
    }
    first_worker = s.next_worker;
    s.next_worker += static_cast<unsigned>(ready.size() + (chain_head != nullptr ? 1 : 0));
  }
  if (ch != nullptr && ch->refs == 0) delete ch;
  const std::size_t n_workers = c.workers.size();
  if (chain_head != nullptr) c.workers[first_worker++ % n_workers]->push(chain_head, chain_tail);
  // Round robin as one by one would, as one chain per worker.
  for (std::size_t w = 0; w < n_workers; ++w) {
    const std::size_t start = (w + n_workers - first_worker % n_workers) % n_workers;
    op* head = nullptr;
    op* tail = nullptr;
    for (std::size_t j = start; j < ready.size(); j += n_workers) {
      ready[j]->next = nullptr;
      (tail != nullptr ? tail->next : head) = ready[j];
      tail = ready[j];
    }
    if (head != nullptr) c.workers[w]->push(head, tail);
  }
}

result<void> file::close() noexcept {
  if (!state_) return {};
  detail::file_state& f = *state_;
  f.closed.store(true);
  for (std::uint32_t n = f.in_flight.load(); n != 0; n = f.in_flight.load())
    base::futex_wait(f.in_flight, n, nullptr);
  result<void> r;
  if (f.cache) r = detail::cache_close_file(f, f.owner->kind);
  // A ring that registered the file holds it open in the kernel past close(2).
  if (f.slot >= 0) f.owner->release_slot(f);
  if (f.stdio != nullptr) {
    if (std::fclose(f.stdio) != 0 && r) r = last_errno_error();
    f.stdio = nullptr;
  }
  if (::close(f.fd) != 0 && r) r = last_errno_error();
  f.fd = -1;
  state_.reset();
  return r;
}

// ---- receipts ----

receipt::receipt(const receipt& other) noexcept : op_(other.op_) {
  if (op_ != nullptr) op_->ref();
}

receipt& receipt::operator=(const receipt& other) noexcept {
  if (this != &other) {
    if (other.op_ != nullptr) other.op_->ref();
    if (op_ != nullptr) op_->unref();
    op_ = other.op_;
  }
  return *this;
}

receipt::receipt(receipt&& other) noexcept : op_(other.op_) {
  other.op_ = nullptr;
}

receipt& receipt::operator=(receipt&& other) noexcept {
  if (this != &other) {
    if (op_ != nullptr) op_->unref();
    op_ = other.op_;
    other.op_ = nullptr;
  }
  return *this;
}

receipt::~receipt() {
  if (op_ != nullptr) op_->unref();
}

status receipt::state() const noexcept {
  if (op_ == nullptr) return status::failed;
  return static_cast<status>(status_of(op_->state.load(std::memory_order_acquire)));
}

result<std::size_t> receipt::wait() const noexcept {
  return wait(io::deadline::never());
}

result<std::size_t> receipt::wait(io::deadline d) const noexcept {
  if (op_ == nullptr) return errc_error(std::errc::invalid_argument);
  const io::countdown cd = d.start();
  bool spun = false;
  for (;;) {
    std::uint32_t s = op_->state.load(std::memory_order_acquire);
    switch (static_cast<status>(status_of(s))) {
      case status::done:
        return op_->done;
      case status::failed:
        return std::unexpected(op_->error);
      case status::cancelled:
        return std::unexpected(make_error_code(errc::controller_stopped));
      case status::pending:
        break;
    }
    if (cd.expired()) return errc_error(std::errc::timed_out);
    // Rather than wait for a worker, run what the workers have not started (when waiting
    // without a deadline: a request run here could outlast it).
    if (cd.is_infinite() && op_->file && op_->file->owner->help()) continue;
    if (!spun && cd.is_infinite()) {
      // Requests that end within microseconds are caught without a sleep (see adaptive_spin).
      spun = true;
      if (waiter_spin.spin([&] {
            return status_of(op_->state.load(std::memory_order_acquire)) !=
                   static_cast<std::uint32_t>(status::pending);
          })) {
        continue;
      }
    }
    if ((s & op::has_waiters) == 0) {
      if (!op_->state.compare_exchange_weak(s, s | op::has_waiters)) continue;
      s |= op::has_waiters;
    }
    base::futex_wait(op_->state, s, &cd);
  }
}

}  // namespace keel::aio
