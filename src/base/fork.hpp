#pragma once
// What fork(2) does to keel's state: one owner, base/fork.cpp, of the one set of atfork
// handlers. A child holds none of its parent's locks, and must not keep the descriptors that
// hold them: a copy shares the parent's open file description, and with it the lock, past the
// parent's death. So every such descriptor is known to this file from the moment it is made
// (a maker holds a `making_descriptors` from the open until the descriptor is where the
// child's handler finds it), and the child closes them all.

#include <atomic>
#include <cstdint>

namespace keel::base {

namespace detail {
extern std::atomic<std::uint64_t> fork_count;  // the atfork handler is registered at start-up
}

//! Incremented in the child after every fork(): cached per-thread state from before is stale.
//! One relaxed load.
inline std::uint64_t fork_generation() noexcept {
  return detail::fork_count.load(std::memory_order_relaxed);
}

//! While one lives, fork(2) waits (and it waits for a fork under way): a descriptor a child
//! must not keep is opened and stored where the child's handler finds it (a thread state,
//! close_in_children) in one step to a fork. Nests. Hold it only for that: a fork waits.
class making_descriptors {
 public:
  making_descriptors() noexcept;
  ~making_descriptors();
  making_descriptors(const making_descriptors&) = delete;
  making_descriptors& operator=(const making_descriptors&) = delete;
};

//! Notes `fd` (made under a making_descriptors): a forked child closes its copy, until
//! keep_in_children(fd), which is called, under a making_descriptors, before `fd` is closed
//! (its number then names another file, which a child keeps).
void close_in_children(int fd) noexcept;
void keep_in_children(int fd) noexcept;

//! The thread states' part of a fork (base/per_thread.cpp): called with the gate held, in the
//! handlers' order. Set once, while the program starts.
struct fork_hooks {
  void (*prepare)() = nullptr;
  void (*parent)() = nullptr;
  void (*child)() = nullptr;
};
void set_thread_state_fork_hooks(fork_hooks h) noexcept;

}  // namespace keel::base
