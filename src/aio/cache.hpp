#pragma once
// The write-back cache of files opened with open_options::cache.
//
// A file's cached bytes live in 4 KiB pages indexed by a radix tree over the offset space.
// Each page knows which of its bytes are valid (hold the file's current content, as this
// controller wrote it) and which are dirty (not yet written to the file). A cached write
// copies into pages and completes at once; a read whose bytes are all valid is served from
// the pages; any other read goes to the engine and has the valid bytes laid over what it
// read. Dirty pages are written out, oldest first, by the controller's flusher thread: above
// the soft limit, and when no cached write came for a while (each idle round halves the
// cached amount); fsync, tasks and close write out the file's dirty pages first. At the
// hard limit a write that touches no cached page bypasses the cache; so does one where the
// cache has not paid lately (a file written once, front to back: nothing to merge, and the
// copy would only cost). Once written out, a buffered file's pages go (the kernel's page
// cache holds those bytes, and a write-only file would otherwise fill the cache with clean
// pages, allocated and freed a page per page written); an O_DIRECT file's stay, for reads.
// Dropped pages are kept for reuse (up to soft / 8, at least 64 pages, in all) until an
// idle round.
//
// Invariant: a valid byte equals the file's content as the requests that finished made it,
// so writing any valid byte to the file is always correct (a write-out may race with newer
// writes; the page's generation tells whether its dirty bytes can be forgotten).
//
// Write-outs write straight from the pages (pwritev), without the file's mutex: a page
// being written from is not written into (a write copies it and puts the copy in its place)
// and not dropped.
//
// Locks: a file's `mutex` guards its pages and counters, held only for copies; its
// `flush_mutex` makes write-outs of one file take turns (fsync waits for the flusher's).
// No lock is shared by two files; the controller's counters are atomics.

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <vector>

#include "base/thread_safety.hpp"
#include "engine.hpp"
#include "file_state.hpp"
#include "radix_tree.hpp"

namespace keel::aio::detail {

inline constexpr std::size_t page_size = 4096;

//! One bit per byte of a page. None set and all set are kept as a state, without the words
//! (writes of whole pages, the common case, then never touch them: 512 bytes a set of bits,
//! which cost more than the page's copy in cache misses).
class page_bits {
 public:
  //! Sets bits [lo, hi).
  void set(std::size_t lo, std::size_t hi) noexcept {
    if (lo >= hi || state_ == all_set) return;
    if (lo == 0 && hi == page_size) {
      state_ = all_set;
      return;
    }
    if (state_ == none_set) {
      words_.fill(0);
      state_ = some_set;
    }
    for (std::size_t w = lo / 64; w * 64 < hi; ++w)
      words_[w] |= mask(w, lo, hi);
  }
  void clear() noexcept { state_ = none_set; }
  //! Whether every bit of [lo, hi) is set.
  [[nodiscard]] bool all(std::size_t lo, std::size_t hi) const noexcept {
    if (lo >= hi || state_ == all_set) return true;
    if (state_ == none_set) return false;
    for (std::size_t w = lo / 64; w * 64 < hi; ++w) {
      const std::uint64_t m = mask(w, lo, hi);
      if ((words_[w] & m) != m) return false;
    }
    return true;
  }
  [[nodiscard]] bool any() const noexcept { return state_ != none_set; }  // some: one or more
  //! Calls `f(run_lo, run_hi)` for every run of set bits inside [lo, hi), in order.
  template <class F>
  void runs(std::size_t lo, std::size_t hi, F&& f) const {
    if (lo >= hi || state_ == none_set) return;
    if (state_ == all_set) {
      f(lo, hi);
      return;
    }
    std::size_t i = lo;
    while (i < hi) {
      i = next(i, hi, true);
      if (i >= hi) return;
      const std::size_t end = next(i, hi, false);
      f(i, end);
      i = end;
    }
  }

 private:
  // The bits of word `w` that fall in [lo, hi).
  static std::uint64_t mask(std::size_t w, std::size_t lo, std::size_t hi) noexcept {
    const std::size_t from = w * 64 < lo ? lo - w * 64 : 0;
    const std::size_t to = hi - w * 64 >= 64 ? 64 : hi - w * 64;
    const std::uint64_t upto = to == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << to) - 1;
    return upto & ~((std::uint64_t{1} << from) - 1);
  }
  // The first index >= i (and < hi, else hi) whose bit equals `value` (state some_set).
  std::size_t next(std::size_t i, std::size_t hi, bool value) const noexcept {
    while (i < hi) {
      const std::size_t w = i / 64;
      std::uint64_t bits = value ? words_[w] : ~words_[w];
      bits &= ~std::uint64_t{0} << (i % 64);
      if (bits != 0) return std::min(hi, w * 64 + static_cast<std::size_t>(std::countr_zero(bits)));
      i = (w + 1) * 64;
    }
    return hi;
  }

  enum : std::uint8_t { none_set, some_set, all_set } state_ = none_set;
  std::array<std::uint64_t, page_size / 64> words_{};  // only meaningful in some_set
};

struct cache_page {
  std::uint64_t offset = 0;      // of its first byte in the file
  std::uint64_t generation = 0;  // bumped by every write into it
  cache_page* older = nullptr;   // the file's list, least recently written first
  cache_page* newer = nullptr;
  cache_page* next_dirty = nullptr;  // the file's dirty pages (unordered)
  cache_page* prev_dirty = nullptr;
  std::uint64_t stamp = 0;  // the controller's write count when last written
  bool flushing = false;    // a write-out is writing from it: never written into nor dropped
  bool detached = false;    // replaced by a copy while a write-out wrote from it
  page_bits valid;
  page_bits dirty;
  //! The page's bytes: aligned to the page (an O_DIRECT file's write-outs go straight from
  //! them), left uninitialised (only valid bytes are read).
  [[nodiscard]] std::byte* data() noexcept { return bytes_.b.data(); }
  [[nodiscard]] const std::byte* data() const noexcept { return bytes_.b.data(); }

  cache_page() = default;  // bad_alloc when its bytes cannot be had
  cache_page(const cache_page&) = delete;
  cache_page& operator=(const cache_page&) = delete;
  ~cache_page() { delete &bytes_; }

  //! As new, for reuse (the data is left as it is: no byte of it is valid).
  void reset() noexcept {
    generation = 0;
    older = newer = next_dirty = prev_dirty = nullptr;
    stamp = 0;
    flushing = false;
    detached = false;
    valid.clear();
    dirty.clear();
  }

  //! Becomes a copy of `other` (not its place in the lists).
  void take_over(const cache_page& other) noexcept {
    offset = other.offset;
    generation = other.generation;
    stamp = other.stamp;
    valid = other.valid;
    dirty = other.dirty;
    bytes_ = other.bytes_;
  }

 private:
  struct alignas(page_size) page_bytes {
    std::array<std::byte, page_size> b;
  };
  page_bytes& bytes_ = *new page_bytes;  // (a reference: never null)
};

using page_tree = radix_tree<cache_page, 34, 9, 9, 12>;
static_assert(page_tree::leaf_span == page_size);

//! The cache of one file.
struct file_cache {
  base::mutex mutex;
  page_tree pages KEEL_GUARDED_BY(mutex);
  cache_page* oldest KEEL_GUARDED_BY(mutex) = nullptr;  // the list of pages by last write
  cache_page* newest KEEL_GUARDED_BY(mutex) = nullptr;
  // The file's size once every cached write is out.
  std::uint64_t logical_size KEEL_GUARDED_BY(mutex) = 0;
  // Reads at the engine: no page may be dropped meanwhile.
  std::size_t reads_from_file KEEL_GUARDED_BY(mutex) = 0;
  // Pages with a dirty byte, listed from `dirty`.
  std::size_t dirty_pages KEEL_GUARDED_BY(mutex) = 0;
  cache_page* dirty KEEL_GUARDED_BY(mutex) = nullptr;
  // A failed write-out, reported by the next fsync/close.
  keel::error flush_error KEEL_GUARDED_BY(mutex);
  // Whether the cache pays here (see steps_aside in cache.cpp): of the last writes, how
  // many came back to bytes written shortly before (a cached page, or a write that went
  // past the cache); the verdict; and the last writes that went past it.
  unsigned window_writes KEEL_GUARDED_BY(mutex) = 0;
  unsigned window_hits KEEL_GUARDED_BY(mutex) = 0;
  bool stepping_aside KEEL_GUARDED_BY(mutex) = false;
  struct range {
    std::uint64_t offset = 0;
    std::uint64_t end = 0;
  };
  std::array<range, 8> passed KEEL_GUARDED_BY(mutex){};
  unsigned next_passed KEEL_GUARDED_BY(mutex) = 0;
  // Dropped pages kept for the next writes: no allocation, no fresh memory to fault in
  // (at most cache_control::spare_cap for all files together, and this many for one).
  std::vector<std::unique_ptr<cache_page>> spare KEEL_GUARDED_BY(mutex);
  static constexpr std::size_t max_spare = 1024;
  // Pages replaced by copies while the running write-out writes from them (cache_write).
  std::vector<std::unique_ptr<cache_page>> detached;

  base::mutex flush_mutex;
  bool closed KEEL_GUARDED_BY(flush_mutex) = false;  // no write-out after the file closed
};

//! The controller's side: quotas, counters and the flusher thread.
struct cache_control {
  engine* write_engine = nullptr;  // the write-outs go through it
  std::size_t soft = 0;
  std::size_t hard = 0;
  std::chrono::milliseconds idle{100};
  std::size_t behind_pages = 0;  // write-behind: the dirty pages a file keeps (0: off)
  // Dropped pages the files keep for reuse (a write-out drops in bursts that the next writes
  // take back: freed and allocated again they would cost malloc's time and page faults),
  // up to soft / 8 (at least 64 pages); an idle round frees them.
  std::size_t spare_cap = 0;
  std::atomic<std::size_t> spare_pages{0};
  std::atomic<std::size_t> bytes{0};  // pages cached, in bytes
  std::atomic<std::size_t> dirty_pages{0};
  std::atomic<std::uint64_t> writes{0};  // cached writes (also the pages' clock)
  std::atomic<std::uint64_t> read_hits{0};
  std::atomic<std::uint64_t> bypassed{0};
  std::atomic<std::uint64_t> written_out{0};  // bytes written to files by write-outs

  base::mutex files_mutex;
  std::vector<std::weak_ptr<file_state>> files KEEL_GUARDED_BY(files_mutex);  // with a cache

  std::thread flusher;
  std::atomic<std::uint32_t> signal{0};  // futex word the flusher sleeps on
  std::atomic<bool> wanted{false};       // a write passed the soft limit since the last round
  std::atomic<bool> behind{false};       // a file passed twice behind_pages dirty since then
  std::atomic<bool> quit{false};
};

//! The cache as the controller sees it: a layer between the submitting thread and the
//! engine, one per controller, shared by the files opened with open_options::cache. It
//! writes out through the controller's engine (engine::write_out). The controller calls it
//! where a file opens and closes, where a request is submitted, where a worker takes it, and
//! where a read it sent to the engine ends.
class write_back_cache {
 public:
  //! With the controller's limits; starts the flusher thread.
  [[nodiscard]] static result<std::unique_ptr<write_back_cache>> start(
      controller::impl& c) noexcept;
  write_back_cache(const write_back_cache&) = delete;
  write_back_cache& operator=(const write_back_cache&) = delete;
  ~write_back_cache();

  //! `f`, of `size` bytes now, is cached from now on (f->cache).
  [[nodiscard]] result<void> attach(const std::shared_ptr<file_state>& f,
                                    std::uint64_t size) noexcept;
  //! On the submitting thread, never blocking: the outcome of a write it cached or of a read
  //! it holds wholly, or nothing (the request goes to a worker).
  std::optional<result<std::size_t>> on_submit(op& o) noexcept;
  //! On a worker, before the engine: the same for a request not yet seen; an fsync or task
  //! has the file's cached bytes written out first (and ends here if that failed, with the
  //! error, also an earlier write-out's not yet reported).
  std::optional<result<std::size_t>> on_worker(op& o) noexcept;
  //! A read that went to the engine (o.reads_file) ended: lays the cached bytes over it.
  void read_finished(op& o, result<std::size_t>& outcome) noexcept;
  //! A write the cache sent to the engine (o.passed_cache) ended: the file's size moves with
  //! it if it succeeded, and the pages that hold some of its bytes are brought in step.
  void passed_write_finished(op& o, const result<std::size_t>& outcome) noexcept;
  //! `f` closes (its last request ended): writes out and drops its pages. The error of a
  //! failed write-out, now or earlier and not yet reported.
  [[nodiscard]] result<void> detach(file_state& f) noexcept;
  //! Writes out every file's pages (errors wait for the files' fsync or close) and ends the
  //! flusher thread. Idempotent.
  void stop() noexcept;
  [[nodiscard]] cache_stats stats() const noexcept;

 private:
  write_back_cache() noexcept = default;
  cache_control cc_;
};

}  // namespace keel::aio::detail
