#pragma once
// The segments this process has mapped (doc/kv-format.md, "Segments"): a table from a
// segment's number to its map, read without a lock (two acquire loads), and the segments and
// table chunks behind it, which live as long as the store: a pointer handed out stays valid
// (a segment removed is unmapped, its object kept), so a reader holding a snapshot never
// meets a freed one. Owns the table, the objects, the count of compactions it last swept for
// and their mutex: segments.cpp maps into it (store::impl::segment_at), compaction and
// recovery unmap what they removed, and the fork handlers (users.cpp) hold the mutex across
// a fork.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "base/thread_safety.hpp"
#include "keel/io/mapped_file.hpp"
#include "keel/result.hpp"

namespace keel::kv {

//! A segment as this process has it: a map of all of it, and no descriptor (its file is
//! closed once mapped: a store of 8064 segments holds no more descriptors than one of one,
//! whatever RLIMIT_NOFILE says).
struct segment {
  std::uint64_t number = 0;
  std::uint64_t size = 0;
  keel::detail::shared_path path;  //!< what errors about it name
  io::mapped_file map;
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept {
    return {map.data(), map.size()};
  }
  //! Faults in (without dirtying) its bytes [offset, offset + length), cut at its end. A
  //! hint: where the kernel has no MADV_POPULATE_READ, the pages fault in on first touch.
  void populate(std::uint64_t offset, std::uint64_t length) const noexcept {
    if (offset >= size) return;
    (void)map.advise(io::map_advice::populate_read, offset, std::min(length, size - offset));
  }
  //! Its data on stable storage (msync MS_SYNC: fdatasync of the mapped range, through the
  //! seam). Errors: the sync's, naming the file; never retried.
  [[nodiscard]] result<void> sync() const noexcept {
    if (auto r = map.sync(0, 0, true); !r) return std::unexpected(r.error().about(path));
    return {};
  }
};

class segment_map {
 public:
  //! The segment mapped here as `number`, or null. No lock.
  [[nodiscard]] segment* find(std::uint64_t number) const noexcept {
    const auto* chunk = chunks_[chunk_of(number)].load(std::memory_order_acquire);
    return chunk == nullptr ? nullptr : chunk[cell_of(number)].load(std::memory_order_acquire);
  }

  //! The segment mapped here as `number`; if there is none, what `map()` makes (a
  //! result<std::unique_ptr<segment>>), called under the mutex, so by one thread at a time.
  //! For a caller whose find() found nothing. Errors: map's; not_enough_memory.
  template <class Map>
  [[nodiscard]] result<segment*> find_or_map(std::uint64_t number, Map&& map) noexcept {
    const base::lock_guard g(mutex_);
    auto* chunk = chunks_[chunk_of(number)].load(std::memory_order_acquire);
    if (chunk == nullptr) {
      auto fresh = std::unique_ptr<std::atomic<segment*>[]>(
          new (std::nothrow) std::atomic<segment*>[std::size_t{1} << chunk_bits]());
      if (!fresh || !reserve_one(chunks_owned_)) {
        return errc_error(std::errc::not_enough_memory);
      }
      chunk = fresh.get();
      chunks_owned_.push_back(std::move(fresh));
      chunks_[chunk_of(number)].store(chunk, std::memory_order_release);
    }
    auto& cell = chunk[cell_of(number)];
    if (segment* s = cell.load(std::memory_order_acquire)) return s;
    if (!reserve_one(owned_)) return errc_error(std::errc::not_enough_memory);
    auto made = map();
    if (!made) return std::unexpected(made.error());
    segment* raw = made->get();
    owned_.push_back(std::move(*made));
    cell.store(raw, std::memory_order_release);
    return raw;
  }

  //! Unmaps segment `number` here, if it is mapped (the object stays).
  void forget(std::uint64_t number) noexcept;

  //! Runs `f(const segment&)` on segment `number` if it is mapped here, under the mutex, so
  //! that no unmap (forget, forget_removed) comes meanwhile; maps nothing. For a thread that
  //! holds no snapshot, which would keep a segment it reads from being removed (the log
  //! supplier's).
  template <class F>
  void with_mapped(std::uint64_t number, F&& f) noexcept {
    const base::lock_guard g(mutex_);
    if (const segment* s = find(number); s != nullptr && s->map.data() != nullptr) f(*s);
  }

  //! Unmaps every segment mapped here that `removed(const segment&)` says is gone: once for
  //! each `generation` (the store's count of compactions: none is removed between two), or
  //! whatever it is (`always`).
  template <class Removed>
  void forget_removed(std::uint64_t generation, bool always, Removed&& removed) noexcept {
    if (!always && generation == swept_.load(std::memory_order_relaxed)) return;
    const base::lock_guard g(mutex_);
    swept_.store(generation, std::memory_order_relaxed);
    for (auto& s : owned_) {
      if (s->map.data() == nullptr || !removed(*s)) continue;
      // Nobody here is reading it. The object stays (pointers to it are never kept past a
      // snapshot).
      chunks_[chunk_of(s->number)].load()[cell_of(s->number)].store(nullptr,
                                                                    std::memory_order_release);
      (void)s->map.unmap();
    }
  }

  //! Held across a fork (users.cpp): a child never inherits it held.
  void lock_for_fork() noexcept KEEL_ACQUIRE(mutex_) { mutex_.lock(); }
  void unlock_after_fork() noexcept KEEL_RELEASE(mutex_) { mutex_.unlock(); }

 private:
  static constexpr std::size_t chunk_bits = 12;
  [[nodiscard]] static std::size_t chunk_of(std::uint64_t number) noexcept {
    return static_cast<std::size_t>(number >> chunk_bits) & ((std::size_t{1} << chunk_bits) - 1);
  }
  [[nodiscard]] static std::size_t cell_of(std::uint64_t number) noexcept {
    return static_cast<std::size_t>(number) & ((std::size_t{1} << chunk_bits) - 1);
  }
  //! Room for one more in `v`, grown as push_back grows it (by doubling: a reserve of one
  //! more each time would move every element at every map).
  template <class V>
  [[nodiscard]] static bool reserve_one(V& v) noexcept {
    try {
      if (v.size() == v.capacity()) v.reserve(std::max<std::size_t>(16, 2 * v.capacity()));
      return true;
    } catch (const std::bad_alloc&) {
      return false;
    }
  }

  std::array<std::atomic<std::atomic<segment*>*>, std::size_t{1} << chunk_bits> chunks_{};
  base::mutex mutex_;  // everything below, and the making of a chunk or a segment
  std::vector<std::unique_ptr<segment>> owned_ KEEL_GUARDED_BY(mutex_);
  std::vector<std::unique_ptr<std::atomic<segment*>[]>> chunks_owned_ KEEL_GUARDED_BY(mutex_);
  std::atomic<std::uint64_t> swept_{0};
};

}  // namespace keel::kv
