#pragma once
// The completions running on a thread, innermost first, and what a wait inside one lets go
// of (receipt.hpp states the promise).
//
// A completion runs before its request leaves its stream and its counts: a later request
// of the thread and file that must follow it waits for the callback to return, so that the
// callbacks of one thread's requests on one file run in their order. A callback that waits
// (for a receipt, for a file to close, for its controller to stop) would then wait for
// itself, directly or through requests between: a read that waits behind a write that waits
// behind the request completing. So a wait inside a completion first lets go of the
// requests completing on its thread: their streams hand on what waited for them, no close
// of their files counts them any more (a closer of one of them may be what the wait waits
// for, or be nested, on another thread, in a close this wait waits for), and a stop of the
// controller stopped here no longer counts them. finish() does for them only what is left.

#include "op.hpp"

namespace keel::aio::detail {

struct completion_frame {
  op* o;
  completion_frame* outer;
  bool followers_released = false;  // its stream has handed on what waited for it
  bool out_of_file = false;         // no longer counted in its file's requests in flight
  bool out_of_controller = false;   // nor in its controller's outstanding requests
};

//! The completions running on this thread, innermost first (null: none). The thread's own.
inline thread_local completion_frame* completing_here = nullptr;

//! Before a wait on this thread that may block: lets go of the requests whose completions
//! run here (see above); `stopping`, a controller being stopped here, stops counting those
//! of its own.
void let_go_of_completions(const void* stopping) noexcept;

}  // namespace keel::aio::detail
