#pragma once
// A request (op): what was asked, where it stands in its stream, and its outcome, shared by
// its receipts and the controller (reference counted).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "keel/aio/receipt.hpp"
#include "keel/error.hpp"
#include "keel/result.hpp"

namespace keel::aio::detail {

enum class op_kind : std::uint8_t { read, write, fsync, fdatasync, task };

struct stream;
struct file_state;
struct op;

//! The requests of one batch that must follow one another, on one io_uring worker; used by
//! that worker's thread only once handed over.
struct chain {
  unsigned refs = 0;      // requests that point to it
  unsigned running = 0;   // requests started and not ended
  op* waiting = nullptr;  // from the first barrier that could not start on, in order
  op* waiting_tail = nullptr;
};

struct op {
  op_kind kind = op_kind::read;
  std::uint64_t offset = 0;
  std::byte* buffer = nullptr;
  std::size_t length = 0;
  std::size_t done = 0;  // bytes transferred so far (the running worker's)
  completion on_done;
  std::function<result<std::size_t>()> task;
  // Its file, held for the request's life: the end of finish() and a receipt's wait use the
  // file (and its controller) past the point where close() stops waiting for the request,
  // and a close() on another thread may let go of the file's last other reference then.
  std::shared_ptr<file_state> file;
  unsigned shard = 0;  // of the counts of requests in flight it was added to
  stream* owner = nullptr;
  bool dispatched = false;     // under owner->mutex
  bool cache_checked = false;  // the cache decided it goes to the engine
  bool reads_file = false;     // a read of a cached file at the engine (see cache.hpp)
  bool passed_cache = false;   // a write of a cached file the cache sent to the engine
  op* next = nullptr;          // inbox and worker-local queues

  // A batch's requests that must follow one another go to one io_uring worker as a chain,
  // and wait there instead of in the stream (file::submit, uring_engine.cpp).
  chain* in_chain = nullptr;  // its chain (holds a reference)
  bool barrier = false;       // starts only when the chain's earlier requests have ended
  bool counted = false;       // worker-local: counted in in_chain->running
  bool chained = false;       // under owner->mutex, while the batch is handed over

  // Started on the submitting thread's own io_uring ring (uring_engine.cpp): that ring, set
  // before the receipt is handed out and never changed; and whether its completion is still
  // to be reaped from it (under the ring's mutex).
  const void* ring = nullptr;
  bool in_ring = false;

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

//! The status part of an op's state word.
constexpr std::uint32_t status_of(std::uint32_t state) noexcept {
  return state & 0xff;
}

//! Makes the receipt of an op (taking over one reference).
struct receipt_access {
  static receipt make(op* o) noexcept { return receipt(o); }
};

}  // namespace keel::aio::detail
