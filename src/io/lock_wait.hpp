#pragma once
// How a lock request that must wait does wait: the one strategy of byte-range locks
// (byte_lock.cpp) and of whole-file flock(2) (file_lock.cpp). Owns nothing: the deadline
// signal's handler is installed once per process (`deadline_signal`, byte_lock.hpp).

#include "keel/io/deadline.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/result.hpp"

namespace keel::io::detail {

//! One request of the lock, as the caller makes it: `wait` false asks without waiting (the
//! kernel's "held" is operation_would_block, EINTR is asked again); `wait` true sleeps in the
//! kernel until granted or a signal interrupts it (interrupted).
using lock_attempt = result<void> (*)(void* context, bool wait) noexcept;

//! Waits for the lock `attempt` asks for on `file`, which a first try found held, until the
//! countdown ends (timed_out; a zero one is operation_would_block). On a filesystem only this
//! machine uses, the wait sleeps in the kernel, with a per-thread timer signal to end it at
//! the deadline (polling where no signal can be had); elsewhere it polls, backing off from
//! 50 µs to 10 ms (io/byte_lock.hpp says why). A wait for ever goes on through the
//! application's signals.
[[nodiscard]] result<void> wait_for_lock(const file_handle& file, const countdown& cd,
                                         lock_attempt attempt, void* context) noexcept;

//! The same for a callable `attempt(bool wait) noexcept -> result<void>`.
template <class Attempt>
[[nodiscard]] result<void> wait_for_lock(const file_handle& file, const countdown& cd,
                                         Attempt& attempt) noexcept {
  return wait_for_lock(
      file, cd,
      [](void* c, bool w) noexcept -> result<void> { return (*static_cast<Attempt*>(c))(w); },
      &attempt);
}

}  // namespace keel::io::detail
