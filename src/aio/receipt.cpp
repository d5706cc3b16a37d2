// Receipts: the claim on a request, and waiting for it.

#include "keel/aio/receipt.hpp"

#include "caller_clock.hpp"
#include "completing.hpp"
#include "detail.hpp"
#include "keel/aio/errors.hpp"
#include "worker.hpp"

namespace keel::aio {
namespace {

thread_local base::adaptive_spin waiter_spin;  // this thread's waits on receipts

}  // namespace

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
  return static_cast<status>(detail::status_of(op_->state.load(std::memory_order_acquire)));
}

result<std::size_t> receipt::wait() const noexcept {
  return wait(io::deadline::never());
}

result<std::size_t> receipt::wait(io::deadline d) const noexcept {
  if (op_ == nullptr) return errc_error(std::errc::invalid_argument);
  // A wait that finds its request ended takes no time worth counting (caller_clock.hpp):
  // its time goes to the time outside, as does the few instructions' of the check.
  const bool ended = detail::status_of(op_->state.load(std::memory_order_acquire)) !=
                     static_cast<std::uint32_t>(status::pending);
  controller::impl* c = !ended && op_->file ? op_->file->owner.get() : nullptr;
  const detail::timed_call timed(!ended && c != nullptr ? c->timed_callers : 0);
  if (c != nullptr && c->inherited()) {
    // A forked child's copy of a request the parent had not finished: it ends (or ended)
    // there, never here.
    return std::unexpected(make_error_code(errc::inherited_across_fork));
  }
  // Inside a completion: what waits for the request completing here must not wait for
  // this wait too (completing.hpp).
  if (!ended && detail::completing_here != nullptr) detail::let_go_of_completions(nullptr);
  const io::countdown cd = d.start();
  bool spun = false;
  for (;;) {
    std::uint32_t s = op_->state.load(std::memory_order_acquire);
    switch (static_cast<status>(detail::status_of(s))) {
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
    // Inside a completion, also with a deadline: what it lets go of may be queued for this
    // very thread, which nobody else runs (the wait may then end later than its deadline).
    const bool helps = cd.is_infinite() || detail::completing_here != nullptr;
    if (helps && detail::worker::help_waiting(c != nullptr ? &c->context : nullptr)) continue;
    // A request started on this thread's own ring: reap it here (rather than sleep until a
    // worker does).
    if (cd.is_infinite() && op_->ring != nullptr && c->engine->wait_here(*op_)) continue;
    if (!spun && cd.is_infinite()) {
      // Requests that end within microseconds are caught without a sleep (see adaptive_spin).
      spun = true;
      if (waiter_spin.spin([&] {
            return detail::status_of(op_->state.load(std::memory_order_acquire)) !=
                   static_cast<std::uint32_t>(status::pending);
          })) {
        continue;
      }
    }
    if ((s & detail::op::has_waiters) == 0) {
      if (!op_->state.compare_exchange_weak(s, s | detail::op::has_waiters)) continue;
      s |= detail::op::has_waiters;
    }
    // On a worker's thread (in a completion or task), a limited sleep: it looks again.
    if (const auto most = detail::worker::longest_sleep(); cd.is_infinite() && most.count() >= 0) {
      const io::countdown tick = io::deadline(most).start();
      base::futex_wait(op_->state, s, &tick);
      continue;
    }
    base::futex_wait(op_->state, s, &cd);
  }
}

}  // namespace keel::aio
