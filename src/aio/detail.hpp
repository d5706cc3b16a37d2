#pragma once
// The controller's insides: its files and its own state, over the pieces they are made of
// (op.hpp: requests; stream.hpp: per-thread ordering; worker.hpp: the workers' inboxes;
// engine.hpp: engines; cache.hpp: the write-back cache).
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
#include "keel/aio/controller.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/result.hpp"
#include "op.hpp"
#include "stream.hpp"
#include "worker.hpp"

namespace keel::aio::detail {

struct file_cache;
class write_back_cache;

struct file_state {
  std::shared_ptr<controller::impl> owner;  // a file may outlive its controller object
  std::uint64_t id = 0;                     // never reused (io_uring's table of files)
  io::file_handle handle;                   // through the controller's filesystem (options::fs)
  bool readable = false;
  bool writable = false;
  bool direct = false;
  std::size_t align = 1;
  std::unique_ptr<engine_file> engine_data;  // goes before the descriptor closes
  std::unique_ptr<file_cache> cache;         // open_options::cache

  std::atomic<bool> closed{false};           // set by the first file::close
  std::atomic<std::uint32_t> close_done{0};  // 1 once it has closed; other closers wait for it
  base::sharded_count in_flight;             // file::close waits for zero (after setting `closed`)

  // Kept after their thread exits: its requests may still be running.
  base::per_thread_states streams{true};
  // Open file descriptions of the file that threads read through on their own
  // (stream::reader, options::reader_descriptions), closed with it.
  base::mutex readers_mutex;
  std::vector<std::unique_ptr<io::file_handle>> readers KEEL_GUARDED_BY(readers_mutex);

  ~file_state();
  //! The calling thread's stream on this file (made on first use: not_enough_memory).
  result<stream*> stream_of_this_thread() noexcept;
};

//! Whether `o` must meet the cache in a worker (before_engine) before its engine sees it: a
//! cached file's request the cache has not passed on yet (an fsync, whose cached bytes go
//! out first), unlike a write it stepped aside for or a read it does not hold.
inline bool for_the_cache(const op& o) noexcept {
  return o.file->cache != nullptr && !o.cache_checked;
}

//! How a request that reached a worker ends before its engine sees it (before_engine).
struct early_end {
  result<std::size_t> outcome;
  bool cancelled = false;
};

}  // namespace keel::aio::detail

namespace keel::aio {

struct controller::impl {
  options opts;  // without registered_buffers (the io_uring engine has them); fs set
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
