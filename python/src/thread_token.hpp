#pragma once
// A thread's identity to what it holds: alive while the thread runs, marked ended as it exits.
// (Not std::thread::id: a new thread may get an ended one's id, and with it, by that id, the
// ended thread's holds.)

#include <atomic>
#include <memory>

namespace keel::python {

struct thread_token {
  std::atomic<bool> ended{false};
};

namespace detail {
struct token_holder {
  std::shared_ptr<thread_token> token = std::make_shared<thread_token>();
  token_holder() = default;
  token_holder(const token_holder&) = delete;
  token_holder& operator=(const token_holder&) = delete;
  ~token_holder() { token->ended.store(true); }  // (no Python here: the thread is ending)
};
inline thread_local token_holder this_thread;
}  // namespace detail

//! The calling thread's token.
inline const std::shared_ptr<thread_token>& this_thread_token() {
  return detail::this_thread.token;
}

}  // namespace keel::python
