#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "keel/aio/receipt.hpp"
#include "keel/result.hpp"

namespace keel::aio {

namespace detail {
struct file_state;
}

//! One request of a batch (`file::submit`).
struct request {
  enum class kind : std::uint8_t { read, write, fsync, fdatasync };
  kind what = kind::read;
  std::uint64_t offset = 0;
  //! read: where the bytes go; write: the bytes (cast from const). Must stay valid and
  //! untouched until the request finishes.
  std::span<std::byte> buffer;
  completion on_done;
};

//! A file opened through a controller. All members are thread-safe; a `file` may be used
//! by any number of threads at once.
//!
//! **Ordering.** The requests one thread submits on one file take effect in the order it
//! submitted them: a read sees every earlier write of that thread (overlapping or not), an
//! fsync covers every earlier write of that thread, a task submitted with `submit(task)`
//! runs after every earlier request of that thread on this file has finished and before any
//! later one starts. Requests of different threads may interleave in any order. Requests of
//! one thread that cannot see each other (reads of untouched ranges, writes to disjoint
//! ranges) may run at the same time.
//!
//! **Buffers** are the caller's: they must stay valid until the request finishes (its
//! receipt is ready or its completion has run).
//!
//! **Errors** come back in the receipt, never by throwing: the errno of the failed call, or
//! an aio::errc for a request keel refused before running it, naming the file (and for a read
//! or write the offset asked for). A short transfer is continued until done or end of file;
//! a failed fsync is reported, not retried. A request is reported done only once its effect
//! is where the engine's contract puts it: a write in the kernel (the stdio engine flushes
//! its stream's buffer, so a refused write fails in its own receipt), or for a cached file
//! in the cache, whose failed write-out the next fsync or close of the file reports (the
//! bytes stay cached, dirty, for the next one). A write that fails may have written part of
//! its bytes, as pwrite(2) does (a full device, RLIMIT_FSIZE); what reads report then is what
//! the file holds: the cache never reports an end of file that no write made.
class file {
 public:
  file() noexcept = default;
  file(file&& other) noexcept;
  file& operator=(file&& other) noexcept;
  file(const file&) = delete;
  file& operator=(const file&) = delete;
  //! Closes (see `close`), ignoring its error.
  ~file();

  [[nodiscard]] bool is_open() const noexcept;
  //! Whether the file was opened with O_DIRECT.
  [[nodiscard]] bool is_direct() const noexcept;
  //! What offsets, lengths and buffer addresses must be multiples of (O_DIRECT), else 1.
  [[nodiscard]] std::size_t alignment() const noexcept;

  //! Reads up to `into.size()` bytes at `offset`. Fewer only at end of file.
  receipt read(std::uint64_t offset, std::span<std::byte> into, completion on_done = {}) noexcept;
  //! Writes all of `data` at `offset`.
  receipt write(std::uint64_t offset, std::span<const std::byte> data,
                completion on_done = {}) noexcept;
  //! Flushes this thread's earlier writes and the file's metadata to stable storage.
  receipt fsync(completion on_done = {}) noexcept;
  //! fsync without the metadata that reading the data back does not need.
  receipt fdatasync(completion on_done = {}) noexcept;
  //! Runs `task` on a controller thread in this thread's order on this file (see above).
  //! Its result is the receipt's.
  receipt submit(std::function<result<std::size_t>()> task, completion on_done = {}) noexcept;
  //! Submits `requests` at once (one hand-over to the controller), in order; `out` gets one
  //! receipt per request and must be as long. With io_uring, the requests that must follow
  //! earlier ones of the same batch (an fsync after its writes, a read after an overlapping
  //! write) go to one ring's worker with them and wait there: the worker starts each as
  //! soon as the earlier ones have ended, with no hand-over (controller::engine_counts).
  void submit(std::span<request> requests, std::span<receipt> out) noexcept;

  //! Waits for every request on this file to finish, then closes it. Later requests fail
  //! with aio::errc::file_closed. Errors: those of close(2) (the data may not be on disk).
  //! With io_uring it also waits, on a thread that is not one of the controller's, until
  //! every worker whose ring used the file has let go of it (a ring holds the file open past
  //! close(2)): a task or callback on such a worker that waits for the closing thread by
  //! other means than keel's (a flag set after close returns) would wait forever. keel's own
  //! waits (a receipt, a close, a stop) run meanwhile what their thread owes. A close
  //! called from a callback that a close on the same thread runs while it waits, of a
  //! file another close has begun, returns at once, before that close has ended (waiting
  //! could close a cycle of closes nested on two threads).
  result<void> close() noexcept;

 private:
  friend class controller;
  explicit file(std::shared_ptr<detail::file_state> s) noexcept : state_(std::move(s)) {}
  std::shared_ptr<detail::file_state> state_;
};

}  // namespace keel::aio
