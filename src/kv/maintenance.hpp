#pragma once
// This process's background maintenance of a store (doc/kv-format.md, "Checkpoints and
// recovery", "Compaction"): the thread a commit starts when a checkpoint or a compaction is
// due, and this process's claim on the maintenance byte (the checkpoint byte of `index`, which
// one checkpointer, compactor or verify of all the store's users holds at a time). Owns all
// of it: maintenance.cpp starts and joins the thread and takes and gives back the byte; the
// store's close sets `closing` (users.cpp), and the fork handlers there hold the mutex across
// a fork.

#include <atomic>
#include <cstdint>

#include "base/thread_safety.hpp"
#include "kv/process_thread.hpp"

namespace keel::kv {

struct process_maintenance {
  //! Taken before the users' mutex (the fork handlers' order).
  base::mutex mutex;
  //! The thread (a forked child's copy of its parent's does not run in the child).
  process_thread thread KEEL_GUARDED_BY(mutex);
  //! Whose thread is at work: fork generation + 1 (0: none). A commit claims it to start one;
  //! the thread gives it up when done, and may claim it back to go on.
  std::atomic<std::uint64_t> running{0};
  //! When the thread last found the maintenance byte taken: not again before then (steady
  //! clock, ms).
  std::atomic<std::uint64_t> busy_until{0};
  static constexpr std::uint64_t busy_backoff_ms = 20;
  //! Set when the store closes: the thread starts nothing further.
  std::atomic<bool> closing{false};
  //! Which fork generation of this process holds the maintenance byte, plus 1 (0: none).
  std::atomic<std::uint64_t> byte_holder{0};
};

}  // namespace keel::kv
