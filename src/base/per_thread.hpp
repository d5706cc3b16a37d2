#pragma once
// Per-thread, per-instance state: an open file description of the thread's own (a lock's:
// OFD and flock locks belong to an open file description, so two threads locking through one
// descriptor would not exclude each other), or a thread's queue of requests on a file (aio).
// Found through a thread-local cache without any lock on the hot path. The instance owns the
// states; a thread's state is destroyed when the thread exits or the instance is destroyed,
// whichever comes first (or, with `keep_after_exit`, only with the instance: its requests
// may outlive the thread). After fork() the child starts afresh: descriptors inherited from
// the parent share the parent's locks and must not be reused, and each state closes them in
// the child (thread_state::close_in_child).

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "base/fork.hpp"
#include "base/thread_safety.hpp"
#include "keel/result.hpp"

namespace keel::base {

struct thread_state {
  thread_state() = default;
  thread_state(const thread_state&) = delete;
  thread_state& operator=(const thread_state&) = delete;
  virtual ~thread_state() = default;
  //! Called in a forked child, once, for every state its parent had (their threads are not in
  //! the child): closes what must not last there, such as a descriptor holding the parent's
  //! lock (the child's copy would hold it past the parent's death), and leaves the state
  //! destructible without them. Only the forking thread runs: no locks, no allocation.
  virtual void close_in_child() noexcept {}
};

struct thread_state_registry {
  base::mutex mutex;
  std::vector<thread_state*> live KEEL_GUARDED_BY(mutex);  // owned
  bool dead KEEL_GUARDED_BY(mutex) = false;
  bool keep_after_exit = false;  // set before the registry is shared
};

class per_thread_states {
 public:
  explicit per_thread_states(bool keep_after_exit = false);
  per_thread_states(const per_thread_states&) = delete;
  per_thread_states& operator=(const per_thread_states&) = delete;
  ~per_thread_states();

  //! This thread's state if it has one already (no allocation, no lock): the fast paths'.
  template <class T>
  [[nodiscard]] T* existing() noexcept {
    return static_cast<T*>(find());
  }

  //! This thread's state, made by `make()` (returning result<std::unique_ptr<T>>) on first use
  //! (a fork waits meanwhile: the descriptors it opens are the state's, closed in a child, from
  //! the start).
  template <class T, class Make>
  result<T*> get(Make&& make) noexcept {
    if (thread_state* s = find()) return static_cast<T*>(s);
    const making_descriptors making;
    auto made = make();
    if (!made) return std::unexpected(made.error());
    T* raw = made->release();
    add(raw);
    return raw;
  }

 private:
  thread_state* find() noexcept;
  void add(thread_state* s) noexcept;

  std::uint64_t id_;
  std::shared_ptr<thread_state_registry> registry_;
};

}  // namespace keel::base
