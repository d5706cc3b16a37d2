#pragma once
// A thread of this process's own for a store's background work (the maintenance thread, the
// log supplier's): the thread and the fork generation it was started in. A forked child
// inherits its parent's object but not the thread, which it forgets, never joins. Not
// thread-safe: its owner guards it with a mutex the fork handlers hold across a fork.

#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "base/fork.hpp"

namespace keel::kv {

class process_thread {
 public:
  //! Runs `body` on a new thread (this one's, if any, joined first). Throws what
  //! std::thread's constructor and the allocation throw; nothing is started then.
  template <class F>
  void start(F&& body) {
    join();
    thread_ = std::make_unique<std::thread>(std::forward<F>(body));
    generation_ = base::fork_generation();
  }
  //! Waits for this process's thread to end, if it has one.
  void join() noexcept {
    forget_parents();
    if (!thread_) return;
    thread_->join();
    thread_.reset();
  }

 private:
  void forget_parents() noexcept {
    // (Its std::thread's destructor would end the process: it is leaked.)
    if (thread_ && generation_ != base::fork_generation()) (void)thread_.release();
  }
  std::unique_ptr<std::thread> thread_;
  std::uint64_t generation_ = 0;
};

}  // namespace keel::kv
