// keel::aio::file: one request at a time, and close.

#include "keel/aio/file.hpp"

#include "base/abandon.hpp"
#include "base/futex.hpp"
#include "cache.hpp"
#include "completing.hpp"
#include "request.hpp"
#include "worker.hpp"

namespace keel::aio {
namespace {

// The files this thread is closing, innermost first: a wait inside a close runs queued
// requests here, whose completions may close files again.
struct closing_here {
  const detail::file_state* f;
  closing_here* outer;
};
thread_local closing_here* closes_here = nullptr;

}  // namespace

using detail::make_op;
using detail::op_kind;
using detail::submit_one;

file::file(file&& other) noexcept : state_(std::move(other.state_)) {}

file& file::operator=(file&& other) noexcept {
  if (this != &other) {
    (void)this->close();
    state_ = std::move(other.state_);
  }
  return *this;
}

file::~file() {
  (void)this->close();
}

bool file::is_open() const noexcept {
  return state_ != nullptr && !state_->closed.load(std::memory_order_relaxed);
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
  detail::op* o = make_op(op_kind::task, 0, nullptr, 0, std::move(on_done));
  o->task = std::move(task);
  return submit_one(state_, o);
}

result<void> file::close() noexcept {
  if (!state_) return {};
  // The state stays until the object goes (a call on another thread may be reading
  // state_). The first closer closes; any other waits until it has.
  detail::file_state& f = *state_;
  controller::impl& c = *f.owner;
  if (c.inherited()) {
    // A forked child's copy: the parent's threads may have held its locks, and its requests
    // and cached bytes are the parent's to finish. Nothing is run, written or freed here.
    base::abandon(std::move(state_));
    return std::unexpected(make_error_code(errc::inherited_across_fork));
  }
  // From a completion: the requests completing on this thread are not waited for.
  if (detail::completing_here != nullptr) detail::let_go_of_completions(nullptr);
  if (f.closed.exchange(true)) {
    // Called while a close further out on this thread waits for its file's requests (a
    // completion it ran closes again, this file or another): it returns at once. For this
    // file, that close ends when this call has returned; for another, its first closer may
    // itself be inside a close that waits for the one further out here.
    if (closes_here != nullptr) return {};
    // Another thread closes it, and waits for the file's requests: those this thread holds
    // (taken from an inbox by a wait it is inside of, on its ring) must run here meanwhile.
    f.in_flight.wait_for_zero([&] { return detail::worker::help_waiting(&c.context); },
                              detail::worker::longest_sleep());
    // The first closer may then wait for this thread: a worker's ring must let go of the
    // file, and the cache's bytes go out through the workers.
    while (f.close_done.load() == 0) {
      if (detail::worker::help_waiting(&c.context)) continue;
      base::futex_wait(base::detail::word_of(f.close_done), 0, detail::worker::longest_sleep());
    }
    return {};
  }
  // From a completion or a task, this thread may hold some of the file's requests itself.
  closing_here mine{&f, closes_here};
  closes_here = &mine;
  f.in_flight.wait_for_zero([&] { return detail::worker::help_waiting(&c.context); },
                            detail::worker::longest_sleep());
  closes_here = mine.outer;
  // The cache's bytes go out first, then the engine lets go (a ring that registered the
  // file holds it open in the kernel past close(2)), then the descriptor closes.
  result<void> r;
  if (f.cache) r = c.cache->detach(f);
  if (auto e = c.engine->closing(f); !e && r) r = e;
  {
    // Threads' own descriptions of it, read-only: closing them loses nothing to report.
    const base::lock_guard lock(f.readers_mutex);
    for (auto& h : f.readers)
      (void)h->close();
    c.readers_left.fetch_add(static_cast<unsigned>(f.readers.size()));
    f.readers.clear();
  }
  if (auto e = f.handle.close(); !e && r) r = e;
  f.close_done.store(1);
  base::futex_wake(f.close_done);
  return r;
}

}  // namespace keel::aio
