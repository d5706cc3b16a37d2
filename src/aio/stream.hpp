#pragma once
// Per-thread ordering: the requests one thread submitted on one file that have not finished,
// and which of them must wait for which (file.hpp states the promise).

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include "base/per_thread.hpp"
#include "base/thread_safety.hpp"
#include "keel/io/file_handle.hpp"
#include "op.hpp"

namespace keel::aio::detail {

//! Whether `later` must wait for `earlier` (both of one stream).
bool must_follow(const op& earlier, const op& later) noexcept;

//! The unfinished requests of one thread on one file, in submission order. Its mutex is
//! taken by that thread to append and by the thread that finishes a request to remove it.
struct stream final : base::thread_state {
  base::mutex mutex;
  std::deque<op*> unfinished KEEL_GUARDED_BY(mutex);
  // Of them, not yet handed to a worker (no scan when zero).
  std::size_t held_back KEEL_GUARDED_BY(mutex) = 0;
  unsigned next_worker KEEL_GUARDED_BY(mutex) = 0;

  // Used by the thread of the stream only (the posix engine's submit_here): its own open
  // file description of the file, for the reads it runs itself (options::reader_descriptions);
  // null before its 64th such read, and for good once one could not be had.
  const io::file_handle* reader = nullptr;
  unsigned reads_here = 0;
  bool reader_tried = false;

  //! Appends `o`; whether it is ready (no earlier unfinished request holds it back).
  bool append(op& o) noexcept KEEL_REQUIRES(mutex);
  //! Removes `o` (finished).
  void remove(op& o) noexcept KEEL_REQUIRES(mutex);
  //! Whether the last appended request, not ready, is held back only by requests from
  //! position `first` on that are handed over now (a batch's): it can wait for them in
  //! their worker. Marks it and them `chained`.
  bool chainable(std::size_t first) noexcept KEEL_REQUIRES(mutex);

  //! The requests a finished one released, to be handed to workers from `first_worker` on
  //! (round robin), outside the stream's lock.
  struct released {
    std::array<op*, 16> few{};
    std::size_t n_few = 0;
    std::vector<op*> more;  // past the first 16
    unsigned first_worker = 0;
  };
  //! Removes the finished `o` and marks dispatched the requests no earlier unfinished one
  //! holds back any more.
  void finished(op& o, released& out) noexcept KEEL_EXCLUDES(mutex);

 private:
  // Whether a scan could find an earlier request `later` must follow: false is certain, so
  // a stream of requests that do not touch each other never scans (see must_follow).
  [[nodiscard]] bool may_wait(const op& later) const noexcept KEEL_REQUIRES(mutex);

  // A summary of `unfinished`: counts, and the hulls of the ranges of its writes and of its
  // reads and writes (reset when it empties).
  std::size_t writes_ KEEL_GUARDED_BY(mutex) = 0;
  std::size_t tasks_ KEEL_GUARDED_BY(mutex) = 0;
  std::uint64_t written_lo_ KEEL_GUARDED_BY(mutex) = UINT64_MAX;
  std::uint64_t written_hi_ KEEL_GUARDED_BY(mutex) = 0;
  std::uint64_t touched_lo_ KEEL_GUARDED_BY(mutex) = UINT64_MAX;
  std::uint64_t touched_hi_ KEEL_GUARDED_BY(mutex) = 0;
};

}  // namespace keel::aio::detail
