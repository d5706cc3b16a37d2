#pragma once
// The controller's insides: its own state, over the pieces it is made of (op.hpp: requests;
// stream.hpp: per-thread ordering; file_state.hpp: open files; worker.hpp: the workers'
// inboxes; engine.hpp: engines; cache.hpp: the write-back cache). Only the controller's own
// files include it: engines and workers see the controller through engine_context.hpp.
//
// Life of a request (request.cpp): the submitting thread makes an op, appends it to its
// stream on the file (under the stream's mutex) and, if no earlier unfinished op of the
// stream conflicts with it, hands it to a worker (a lock-free inbox per worker). The worker
// runs it through its engine (or, for the one-at-a-time engines, a thread waiting on a
// receipt takes the inbox and runs it itself: worker::help) and calls finish(), which
// publishes the result, wakes waiters, removes the op from its stream and hands on the ops
// that were waiting for it (the io_uring engine keeps a batch's ops that must follow one
// another in its worker: chain). A file with the write-back cache finishes writes, and reads
// the cache holds, on the submitting thread. No lock is shared by two streams; the only
// shared counters are the controller's and the file's in-flight counts.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/futex.hpp"
#include "base/per_thread.hpp"
#include "base/planted.hpp"
#include "base/sharded_count.hpp"
#include "base/thread_safety.hpp"
#include "engine.hpp"
#include "engine_context.hpp"
#include "file_state.hpp"
#include "keel/aio/controller.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/result.hpp"
#include "op.hpp"
#include "stream.hpp"
#include "worker.hpp"

namespace keel::aio::detail {

class write_back_cache;

}  // namespace keel::aio::detail

namespace keel::aio {

struct controller::impl {
  options opts;  // without registered_buffers (the io_uring engine has them); fs set
  // All the engine and its workers see of this controller: made before them, so it outlives
  // them.
  detail::engine_context context{*this};
  std::unique_ptr<detail::engine> engine;
  std::string fallback_reason;
  std::vector<std::unique_ptr<detail::worker>> workers;
  std::atomic<bool> stopping{false};
  base::mutex stop_mutex;
  bool stopped KEEL_GUARDED_BY(stop_mutex) = false;
  // Requests submitted and not finished (stop waits for zero, after setting `stopping`;
  // workers exit at zero).
  base::sharded_count outstanding;
  std::unique_ptr<detail::write_back_cache> cache;  // null when the hard limit is zero
  // With submitter::adaptive, an id of this controller's, never reused (0: none): the
  // submitting threads' calls on it are timed (caller_clock.hpp). Set before it is shared.
  std::uint64_t timed_callers = 0;
  // Of options::reader_descriptions, the ones no file holds (set before it is shared).
  std::atomic<unsigned> readers_left{0};
  // The process's forks when it started: in a child forked since, the controller is the
  // parent's (its threads, their requests and locks stayed there) and nothing of it runs.
  const std::uint64_t forks_at_start = base::fork_generation();

  impl();
  ~impl();

  //! Whether this is a forked child's copy of the controller (errc::inherited_across_fork).
  [[nodiscard]] bool inherited() const noexcept {
    return base::fork_generation() != forks_at_start &&
           !base::is_planted(base::planted_bug::aio_child_uses_parents_controller);
  }
  [[nodiscard]] engine_kind kind() const noexcept { return engine->kind(); }
  //! Runs requests queued for the workers on the calling thread (worker::help): whether
  //! it ran any.
  bool help() noexcept;
  //! Hands a ready op to a worker (round robin per stream).
  void dispatch(detail::op* o, unsigned& next_worker) noexcept;
  //! What a worker does first with a request: nothing (the engine runs it), or end it here
  //! (cancelled while stopping; finished by the write-back cache).
  std::optional<detail::early_end> before_engine(detail::op& o) noexcept;
  //! The end of a request: publishes `outcome` (or cancellation), runs the completion,
  //! wakes waiters, and hands on the ops of its stream that waited for it.
  void finish(detail::op* o, result<std::size_t> outcome, bool cancelled = false) noexcept;
  //! Takes the finished (or completing) `o` out of its stream and hands on the requests of
  //! the stream that no earlier unfinished one holds back any more.
  void release_followers(detail::op* o) noexcept;
};

}  // namespace keel::aio
