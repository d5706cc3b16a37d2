#pragma once
// A worker thread of the controller: a lock-free inbox any thread pushes requests to, drained
// by the loop of the thread's engine (sync_engine.cpp, uring_engine.cpp).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "base/spin.hpp"
#include "engine_context.hpp"
#include "keel/aio/controller.hpp"
#include "keel/result.hpp"
#include "op.hpp"

namespace keel::aio::detail {

class worker {
 public:
  explicit worker(engine_context& c) : ctx_(c) {}
  worker(const worker&) = delete;
  worker& operator=(const worker&) = delete;
  virtual ~worker() = default;

  //! Queues ops [first .. last] (linked by `next`), waking the thread if it sleeps.
  void push(op* first, op* last) noexcept;
  //! Wakes the thread (to notice a stop).
  virtual void wake() noexcept = 0;
  //! Runs, on the calling thread, the requests waiting in the inbox (not tasks), if the
  //! engine runs one request at a time; whether it ran any. A thread that would otherwise
  //! wait for a request helps this way: no hand-over, no wake-up.
  virtual bool help() noexcept { return false; }
  //! Starts the thread; returns once the engine is ready or failed to start.
  virtual result<void> start() noexcept = 0;
  //! Adds what this worker's engine did to `s`.
  virtual void add_counts(engine_stats& s) const noexcept { (void)s; }
  [[nodiscard]] engine_context& owner() const noexcept { return ctx_; }

  //! The worker whose thread the calling thread is (of any controller), or null.
  [[nodiscard]] static worker* of_this_thread() noexcept { return this_threads_; }
  //! For a wait on the calling thread (a request's end, a file's last request): runs what
  //! `c`'s workers have queued (c may be null) and, on a worker's thread, what that worker
  //! holds, which no other thread would run (completions and tasks may wait). Whether it
  //! ran anything.
  static bool help_waiting(engine_context* c) noexcept;
  //! How long such a wait may sleep at a time: a millisecond on a worker's thread (the only
  //! one that runs what reaches its inbox or ring), else without a limit (negative).
  [[nodiscard]] static std::chrono::nanoseconds longest_sleep() noexcept {
    return this_threads_ != nullptr ? std::chrono::nanoseconds(1'000'000)
                                    : std::chrono::nanoseconds(-1);
  }
  void join() noexcept {
    if (thread_.joinable()) thread_.join();
  }

 protected:
  //! Everything pushed so far, oldest first.
  op* take_all() noexcept;
  [[nodiscard]] bool inbox_empty() const noexcept {
    return inbox_.load(std::memory_order_acquire) == nullptr;
  }
  //! Spins (for at most `budget`) until the inbox has something: a request that follows
  //! closely is picked up without a sleep and a wake-up (two context switches).
  bool spin_for_work() noexcept;
  //! Whether the thread may end: stopping, and no request is left anywhere that could still
  //! be handed to it.
  [[nodiscard]] bool may_exit() const noexcept;

  //! Called first on the worker's thread.
  void this_thread_is_mine() noexcept { this_threads_ = this; }

  engine_context& ctx_;
  std::thread thread_;
  base::adaptive_spin idle_spin_;
  // Set (seq_cst) before the thread checks its inbox for the last time and sleeps; a pusher
  // that finds it set wakes the thread. One of the two always sees the other.
  std::atomic<bool> sleeping_{false};

 private:
  std::atomic<op*> inbox_{nullptr};
  static thread_local worker* this_threads_;
};

}  // namespace keel::aio::detail
