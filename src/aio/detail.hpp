#pragma once
// The controller's insides: requests (ops), per-thread ordering streams, files, and the
// worker threads that run the engines.
//
// Life of a request: the submitting thread makes an op, appends it to its stream on the file
// (under the stream's mutex) and, if no earlier unfinished op of the stream conflicts with
// it, hands it to a worker (a lock-free inbox per worker). The worker runs it through its
// engine (or, for the one-at-a-time engines, a thread waiting on a receipt takes the inbox
// and runs it itself: worker::help) and calls finish(), which publishes the result, wakes
// waiters, removes the op from its stream and hands on the ops that were waiting for it (the
// io_uring engine keeps a batch's ops that must follow one another in its worker: chain). A
// file with the write-back cache finishes writes, and reads the cache holds, on the
// submitting thread (cache.hpp). No lock is shared by two streams; the only shared counters
// are the controller's and the file's in-flight counts.

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "base/futex.hpp"
#include "base/per_thread.hpp"
#include "base/spin.hpp"
#include "keel/aio/controller.hpp"
#include "keel/aio/errors.hpp"
#include "keel/aio/receipt.hpp"
#include "keel/io/deadline.hpp"
#include "keel/result.hpp"

namespace keel::aio::detail {

enum class op_kind : std::uint8_t { read, write, fsync, fdatasync, task };

struct stream;
struct file_state;
struct file_cache;
struct cache_control;
struct op;

//! The requests of one batch that must follow one another, on one io_uring worker; used by
//! that worker's thread only once handed over.
struct chain {
  unsigned refs = 0;      // requests that point to it
  unsigned running = 0;   // requests started and not ended
  op* waiting = nullptr;  // from the first barrier that could not start on, in order
  op* waiting_tail = nullptr;
};

//! One request, shared by the receipts and the controller (reference counted).
struct op {
  op_kind kind = op_kind::read;
  std::uint64_t offset = 0;
  std::byte* buffer = nullptr;
  std::size_t length = 0;
  std::size_t done = 0;  // bytes transferred so far (the running worker's)
  completion on_done;
  std::function<result<std::size_t>()> task;
  std::shared_ptr<file_state> file;
  stream* owner = nullptr;
  bool dispatched = false;     // under owner->mutex
  bool cache_checked = false;  // the cache decided it goes to the engine
  bool reads_file = false;     // a read of a cached file at the engine (see cache.hpp)
  op* next = nullptr;          // inbox and worker-local queues

  // A batch's requests that must follow one another go to one io_uring worker as a chain,
  // and wait there instead of in the stream (file::submit, uring_worker).
  chain* in_chain = nullptr;  // its chain (holds a reference)
  bool barrier = false;       // starts only when the chain's earlier requests have ended
  bool counted = false;       // worker-local: counted in in_chain->running
  bool chained = false;       // under owner->mutex, while the batch is handed over

  // The outcome: `state` is the futex word waiters sleep on (a status, plus has_waiters once
  // someone sleeps); `error` and `done` are valid once it is not pending (published with
  // release, read with acquire).
  static constexpr std::uint32_t has_waiters = 0x100;
  std::atomic<std::uint32_t> state{static_cast<std::uint32_t>(status::pending)};
  keel::error error;
  std::atomic<std::uint32_t> refs{1};

  void ref() noexcept { refs.fetch_add(1, std::memory_order_relaxed); }
  void unref() noexcept {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }
};

//! The requests one thread submitted on one file that have not finished, in submission
//! order. Its mutex is taken by that thread to append and by workers to remove.
struct stream final : base::thread_state {
  std::mutex mutex;
  std::deque<op*> unfinished;
  std::size_t held_back = 0;  // of them, not yet handed to a worker (no scan when zero)
  unsigned next_worker = 0;

  //! Appends `o`; whether it is ready (no earlier unfinished request holds it back).
  bool append(op& o) noexcept;
  //! Removes `o` (finished).
  void remove(op& o) noexcept;
  //! Whether the last appended request, not ready, is held back only by requests from
  //! position `first` on that are handed over now (a batch's): it can wait for them in
  //! their worker. Marks it and them `chained`.
  bool chainable(std::size_t first) noexcept;

 private:
  // Whether a scan could find an earlier request `later` must follow: false is certain, so
  // a stream of requests that do not touch each other never scans (see must_follow).
  [[nodiscard]] bool may_wait(const op& later) const noexcept;

  // A summary of `unfinished`: counts, and the hulls of the ranges of its writes and of its
  // reads and writes (reset when it empties).
  std::size_t writes_ = 0;
  std::size_t tasks_ = 0;
  std::uint64_t written_lo_ = UINT64_MAX;
  std::uint64_t written_hi_ = 0;
  std::uint64_t touched_lo_ = UINT64_MAX;
  std::uint64_t touched_hi_ = 0;
};

//! Makes the receipt of an op (taking over one reference).
struct receipt_access {
  static receipt make(op* o) noexcept { return receipt(o); }
};

//! Whether `later` must wait for `earlier` (both of one stream; see file.hpp).
bool must_follow(const op& earlier, const op& later) noexcept;

class worker;

struct file_state {
  std::shared_ptr<controller::impl> owner;  // a file may outlive its controller object
  std::uint64_t id = 0;                     // never reused: keys the threads' stream caches
  int fd = -1;
  bool readable = false;
  bool writable = false;
  bool direct = false;
  std::size_t align = 1;
  std::FILE* stdio = nullptr;  // the stdio engine's stream (under stdio_mutex)
  std::mutex stdio_mutex;
  std::unique_ptr<file_cache> cache;  // open_options::cache

  std::atomic<bool> closed{false};
  std::atomic<std::uint32_t> in_flight{0};  // futex word: close() waits for zero

  // io_uring: its index in every ring's table of registered files, or -1; the workers whose
  // ring registered it (bit i % 64 for worker i), which close() asks to let go of it.
  int slot = -1;
  std::atomic<std::uint64_t> registered_in{0};

  // Kept after their thread exits: its requests may still be running.
  base::per_thread_states streams{true};

  ~file_state();
  //! The calling thread's stream on this file (made on first use: not_enough_memory).
  result<stream*> stream_of_this_thread() noexcept;
};

//! A worker thread: an inbox any thread pushes to, drained by the thread's engine loop.
class worker {
 public:
  explicit worker(controller::impl& c) : ctl_(c) {}
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
  void add_counts(engine_stats& s) const noexcept {
    s.requests_ordered_in_ring += ordered_.load(std::memory_order_relaxed);
    s.requests_on_registered_files += registered_.load(std::memory_order_relaxed);
    s.requests_on_registered_buffers += fixed_buffers_.load(std::memory_order_relaxed);
  }
  //! Makes the engine let go of file `id` at table index `slot` if it registered it, and
  //! returns when it has (at once for engines that register nothing, or an ended thread).
  virtual void forget(int slot, std::uint64_t id) noexcept {
    (void)slot;
    (void)id;
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

  controller::impl& ctl_;
  std::thread thread_;
  base::adaptive_spin idle_spin_;
  // Counts for engine_stats, written by the worker thread only.
  std::atomic<std::uint64_t> ordered_{0};
  std::atomic<std::uint64_t> registered_{0};
  std::atomic<std::uint64_t> fixed_buffers_{0};
  static void count(std::atomic<std::uint64_t>& n) noexcept {
    n.store(n.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  // Set (seq_cst) before the thread checks its inbox for the last time and sleeps; a pusher
  // that finds it set wakes the thread. One of the two always sees the other.
  std::atomic<bool> sleeping_{false};

 private:
  std::atomic<op*> inbox_{nullptr};
};

std::unique_ptr<worker> make_sync_worker(controller::impl& c, engine_kind k);
std::unique_ptr<worker> make_uring_worker(controller::impl& c, unsigned index);

}  // namespace keel::aio::detail

namespace keel::aio {

struct controller::impl {
  options opts;
  engine_kind kind = engine_kind::posix;
  std::string fallback_reason;
  std::vector<std::unique_ptr<detail::worker>> workers;
  std::atomic<bool> stopping{false};
  std::mutex stop_mutex;
  bool stopped = false;  // under stop_mutex
  // Requests submitted and not finished (stop waits for zero; workers exit at zero).
  std::atomic<std::uint64_t> outstanding{0};
  std::unique_ptr<detail::cache_control> cache;  // null when the hard limit is zero

  // options::registered_buffers in address order (their index in every ring's table).
  std::vector<std::span<std::byte>> buffers;
  //! The table index of the registered buffer holding [p, p + n) wholly, or -1.
  [[nodiscard]] int buffer_index(const std::byte* p, std::size_t n) const noexcept;

  // io_uring's registered files: the size of every ring's table, and its free indexes.
  unsigned file_slots = 0;
  std::mutex slots_mutex;
  std::vector<int> free_slots;
  int next_slot = 0;
  //! A free table index for a new file, or -1 (none left, or not registering).
  int take_slot() noexcept;
  //! Makes every ring let go of `f` and frees its index (close, after the last request).
  void release_slot(detail::file_state& f) noexcept;

  impl();
  ~impl();

  //! Runs requests queued for the workers on the calling thread (worker::help): whether
  //! it ran any.
  bool help() noexcept;
  //! Hands a ready op to a worker (round robin per stream).
  void dispatch(detail::op* o, unsigned& next_worker) noexcept;
  //! The end of a request: publishes `outcome` (or cancellation), runs the completion,
  //! wakes waiters, and hands on the ops of its stream that waited for it.
  void finish(detail::op* o, result<std::size_t> outcome, bool cancelled = false) noexcept;
  //! Runs a request on the calling thread with plain syscalls (tasks, and the posix engine).
  static result<std::size_t> run_posix(detail::op& o) noexcept;
};

}  // namespace keel::aio
