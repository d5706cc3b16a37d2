#pragma once
// Which side of a fork this process is: state made before a fork is its parent's, and a child
// forgets it (its threads are not in the child, nor are their holds).

#include <pthread.h>

#include <atomic>
#include <cstdint>

namespace keel::python {

namespace detail {
inline std::atomic<std::uint64_t> forks{0};
}  // namespace detail

//! Counts the forks this process's line has been through: a state that noted another number
//! than now's was made in a parent. Registered once, at import (register_fork_generation).
inline std::uint64_t fork_generation() noexcept {
  return detail::forks.load(std::memory_order_relaxed);
}

//! Counts every fork from now on (called once, as the module loads).
inline void register_fork_generation() noexcept {
  ::pthread_atfork(nullptr, nullptr, [] { detail::forks.fetch_add(1, std::memory_order_relaxed); });
}

}  // namespace keel::python
