#pragma once
// An open file as the controller and its engines see it: its descriptor, what its engine and
// its write-back cache keep of it, its threads' streams, and the count of its requests in
// flight. Owned by the file objects that share it (file.hpp) and by the requests in flight.

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "base/per_thread.hpp"
#include "base/sharded_count.hpp"
#include "base/thread_safety.hpp"
#include "engine.hpp"
#include "keel/aio/controller.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/result.hpp"
#include "op.hpp"
#include "stream.hpp"

namespace keel::aio::detail {

struct file_cache;

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

}  // namespace keel::aio::detail
