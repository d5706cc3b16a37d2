#pragma once
// This process's supplier of fresh log pages (doc/kv-format.md, "Segments"): a thread that
// faults in the next chunk of the log a writer has asked for, so that the kernel's zeroing of
// fresh pages (on tmpfs, a third of a put's time at a million 1 KiB puts) is off the writers'
// path. A hint only: a chunk not supplied in time faults in at the writers' first touch, as
// without it. Owns the thread, the request word and the wake word:
// supplier.cpp starts and joins the thread and serves the requests; the store's close ends it
// (users.cpp), and the fork handlers there hold the mutex across a fork.

#include <atomic>
#include <cstdint>

#include "base/thread_safety.hpp"
#include "kv/process_thread.hpp"

namespace keel::kv {

struct log_supplier {
  //! Taken only to start or join the thread, and by the fork handlers, first of the store's
  //! mutexes: nothing is held while it is taken, and its holder may wait for the thread,
  //! which takes the segment map's (a close joining it under the mapped mutex's fork order
  //! deadlocked with a fork and the thread).
  base::mutex mutex;
  //! The thread (a forked child's copy of its parent's does not run in the child).
  process_thread thread KEEL_GUARDED_BY(mutex);
  //! Whose thread serves requests: fork generation + 1 (0: none, or it could not start).
  std::atomic<std::uint64_t> serving{0};
  //! The newest request: a log location whose chunk (store::impl::prefault_chunk) to fault
  //! in, 0 when none is waiting. A request not served before the next replaces it.
  std::atomic<std::uint64_t> wanted{0};
  //! Bumped with every request and at close; the thread sleeps on it (a futex word).
  std::atomic<std::uint32_t> asks{0};
  //! Set when the store closes: the thread ends.
  std::atomic<bool> closing{false};
};

}  // namespace keel::kv
