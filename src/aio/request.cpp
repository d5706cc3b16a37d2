// The life of a request (detail.hpp): submission, the worker's first look, and its end.

#include "request.hpp"

#include <sys/types.h>

#include <limits>

#include "cache.hpp"
#include "caller_clock.hpp"
#include "completing.hpp"
#include "keel/aio/errors.hpp"

namespace keel::aio::detail {

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

error refusal(const file_state* f, const op& o) noexcept {
  if (f == nullptr) return make_error_code(errc::file_closed);
  if (f->owner->inherited()) return make_error_code(errc::inherited_across_fork);
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

receipt refuse(op* o, const error& why) noexcept {
  receipt r = receipt_access::make(o);
  const bool ranged = o->kind == op_kind::read || o->kind == op_kind::write;
  o->error = o->file ? why.about(o->file->handle.shared_path(),
                                 ranged ? o->offset : keel::error::no_offset)
                     : why;
  if (o->on_done) o->on_done(std::unexpected(o->error));
  o->state.store(static_cast<std::uint32_t>(status::failed), std::memory_order_release);
  o->unref();  // the controller's reference: the receipt keeps the op
  return r;
}

bool finished_as_shut(controller::impl& c, file_state& f, op* o) noexcept {
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

receipt submit_one(const std::shared_ptr<file_state>& f, op* o) noexcept {
  o->file = f;
  if (const error why = refusal(f.get(), *o)) return refuse(o, why);
  controller::impl& c = *f->owner;
  const timed_call timed(c.timed_callers);
  // Counted in before the flags are read; close() and stop() set their flag before they
  // wait for the counts: either we see the flag, or they see us.
  o->shard = base::sharded_count::shard_of_this_thread();
  f->in_flight.add(o->shard, 1);
  c.outstanding.add(o->shard, 1);
  receipt r = receipt_access::make(o);
  if (finished_as_shut(c, *f, o)) return r;
  const auto mine = f->stream_of_this_thread();
  if (!mine) {
    c.finish(o, std::unexpected(mine.error()));
    return r;
  }
  stream& s = **mine;
  o->owner = &s;
  bool ready = true;
  unsigned worker_index = 0;
  {
    const base::lock_guard lock(s.mutex);
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
      if (auto done = c.cache->on_submit(*o)) {
        c.finish(o, *done);
        return r;
      }
    }
    if (c.engine->submit_here(std::span(&o, 1)) == 0) c.dispatch(o, worker_index);
    c.engine->settle_here();
  }
  return r;
}

}  // namespace keel::aio::detail

namespace keel::aio {

std::optional<detail::early_end> controller::impl::before_engine(detail::op& o) noexcept {
  if (stopping.load(std::memory_order_relaxed)) return detail::early_end{0, true};
  if (o.file->cache) {
    if (auto done = cache->on_worker(o)) return detail::early_end{std::move(*done), false};
  }
  return std::nullopt;
}

void controller::impl::finish(detail::op* o, result<std::size_t> outcome, bool cancelled) noexcept {
  status st = status::done;
  if (cancelled) outcome = std::unexpected(make_error_code(errc::controller_stopped));
  if (o->reads_file) cache->read_finished(*o, outcome);
  if (o->passed_cache) cache->passed_write_finished(*o, outcome);
  if (cancelled) {
    st = status::cancelled;
  } else if (!outcome) {
    st = status::failed;
    // Whatever the engine: the error names its file (and where, for a read or write).
    if (outcome.error().path().empty()) {
      const bool ranged = o->kind == detail::op_kind::read || o->kind == detail::op_kind::write;
      outcome = std::unexpected(outcome.error().about(o->file->handle.shared_path(),
                                                      ranged ? o->offset : keel::error::no_offset));
    }
  }
  if (outcome) {
    o->done = *outcome;
  } else {
    o->error = outcome.error();
  }
  detail::completion_frame frame{o, detail::completing_here};
  if (o->on_done) {
    detail::completing_here = &frame;
    o->on_done(outcome);
    detail::completing_here = frame.outer;
  }
  const std::uint32_t before =
      o->state.exchange(static_cast<std::uint32_t>(st), std::memory_order_acq_rel);
  if ((before & detail::op::has_waiters) != 0) base::futex_wake(o->state);

  if (!frame.followers_released) release_followers(o);
  detail::file_state& f = *o->file;
  if (!frame.out_of_file && f.in_flight.take(o->shard, 1) && f.closed.load()) f.in_flight.wake();
  if (!frame.out_of_controller && outstanding.take(o->shard, 1) && stopping.load()) {
    outstanding.wake();
    for (auto& w : workers)
      w->wake();
  }
  o->unref();
}

void controller::impl::release_followers(detail::op* o) noexcept {
  detail::stream* s = o->owner;
  if (s == nullptr) return;
  detail::stream::released ready;
  s->finished(*o, ready);
  for (std::size_t i = 0; i < ready.n_few; ++i)
    dispatch(ready.few[i], ready.first_worker);
  for (detail::op* y : ready.more)
    dispatch(y, ready.first_worker);
}

}  // namespace keel::aio

namespace keel::aio::detail {

void let_go_of_completions(const void* stopping) noexcept {
  for (completion_frame* fr = completing_here; fr != nullptr; fr = fr->outer) {
    op* o = fr->o;
    controller::impl& c = *o->file->owner;
    if (!fr->followers_released) {
      fr->followers_released = true;
      c.release_followers(o);
    }
    if (!fr->out_of_file) {
      // Its file's closers no longer wait for it: a closer of that file may be what this
      // wait waits for, directly or through a close nested in it on another thread.
      fr->out_of_file = true;
      file_state& f = *o->file;
      if (f.in_flight.take(o->shard, 1) && f.closed.load()) f.in_flight.wake();
    }
    if (stopping != nullptr && &c == stopping && !fr->out_of_controller) {
      fr->out_of_controller = true;
      if (c.outstanding.take(o->shard, 1)) c.outstanding.wake();  // as above
    }
  }
}

}  // namespace keel::aio::detail
