#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "keel/io/deadline.hpp"
#include "keel/result.hpp"

namespace keel::aio {

namespace detail {
struct op;
struct receipt_access;
}  // namespace detail

//! Where a request stands.
enum class status : std::uint8_t {
  pending,    //!< queued or running
  done,       //!< finished: bytes() tells how many were transferred
  failed,     //!< finished with an error (error())
  cancelled,  //!< never run: the controller stopped first
};

//! Called once when a request finishes, with the bytes transferred or the error: on one of
//! the controller's threads, or on a thread waiting on a receipt without a deadline (which
//! runs queued requests itself rather than wait, with the posix, stdio and null engines),
//! or on the submitting thread for a request the write-back cache finishes at once. Keep it
//! short: it runs where the next I/O would be issued.
//!
//! The callbacks of one thread's requests on one file run in their order: a later request
//! that must follow the one completing (file.hpp, Ordering) starts once this callback has
//! returned, or as soon as it waits. A callback may submit requests and wait for any of
//! them, also for those that must follow its own, directly or through requests between (a
//! read that waits behind a write that waits behind the request completing): waiting lets
//! them go first. It may close files, also its own request's (the close does not wait for
//! the callbacks running on its thread), and stop or destroy a controller other than the
//! one whose thread it runs on, also one whose callbacks wait for requests queued on
//! this very thread (the stop runs them while it waits). It must not throw (an exception escaping
//! it ends the process through std::terminate, as from any noexcept function), and must not stop or
//! destroy its own controller while it runs on one of that controller's threads: stopping joins
//! that thread, so the process aborts with a message saying so instead of hanging.
using completion = std::function<void(const result<std::size_t>&)>;

//! The claim on one submitted request. Copyable (all copies see the same request); the
//! request runs to its end whether or not a receipt is kept. Thread-safe.
class receipt {
 public:
  receipt() noexcept = default;
  receipt(const receipt& other) noexcept;
  receipt& operator=(const receipt& other) noexcept;
  receipt(receipt&& other) noexcept;
  receipt& operator=(receipt&& other) noexcept;
  ~receipt();

  //! Whether this receipt refers to a request.
  [[nodiscard]] bool valid() const noexcept { return op_ != nullptr; }
  [[nodiscard]] status state() const noexcept;
  [[nodiscard]] bool ready() const noexcept { return state() != status::pending; }

  //! Waits for the end of the request (its completion callback has run by then) and returns
  //! the bytes transferred: for a read, fewer than asked only at end of file; for a write,
  //! all of them; 0 for fsync. Errors: the request's own (the errno of the failed call, never
  //! retried for fsync), aio::errc::controller_stopped when it was cancelled.
  result<std::size_t> wait() const noexcept;
  //! The same, giving up at `d`: timed_out then (the request goes on).
  result<std::size_t> wait(io::deadline d) const noexcept;

 private:
  friend struct detail::receipt_access;
  explicit receipt(detail::op* o) noexcept : op_(o) {}
  detail::op* op_ = nullptr;
};

}  // namespace keel::aio
