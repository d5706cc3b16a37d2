#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "keel/io/deadline.hpp"
#include "keel/result.hpp"

namespace keel::lock {

using io::deadline;

//! What is locked: a 63-bit value and whether the lock on it is exclusive (else shared).
//! Values are the caller's to choose; `from_string`/`from_bytes` hash a name into one.
struct entity {
  std::uint64_t value : 63 = 0;
  std::uint64_t exclusive : 1 = 1;

  constexpr entity() noexcept = default;
  constexpr explicit entity(std::uint64_t v, bool excl = true) noexcept
      : value(v & max_value), exclusive(excl ? 1 : 0) {}

  static constexpr std::uint64_t max_value = (std::uint64_t{1} << 63) - 1;
  //! The largest value a lock takes: the 17 above it are the lock files' own bytes (which
  //! algorithm has a path open: doc/lock-formats.md), so `lock` refuses them
  //! (invalid_argument) rather than fold two values onto one byte.
  static constexpr std::uint64_t max_lockable = max_value - 17;

  //! The 64-bit XXH3 hash of `bytes`, folded to 63 bits, then into [0, max_lockable].
  [[nodiscard]] static entity from_bytes(std::span<const std::byte> bytes,
                                         bool exclusive = true) noexcept;
  [[nodiscard]] static entity from_string(std::string_view name, bool exclusive = true) noexcept;

  [[nodiscard]] constexpr bool is_exclusive() const noexcept { return exclusive != 0; }
  //! The same entity, shared.
  [[nodiscard]] constexpr entity shared() const noexcept { return entity(value, false); }
  friend constexpr bool operator==(entity a, entity b) noexcept {
    return a.value == b.value && a.exclusive == b.exclusive;
  }
};
static_assert(sizeof(entity) == 8);

class shared_fs_mutex;

//! Holds the entities one `lock` call acquired; unlocks them on destruction. Move-only.
//! Like std::mutex, a guard must be unlocked (or destroyed) on the thread that locked it:
//! deadlock detection keeps each thread's held entities in that thread. A forked child holds
//! none of its parent's locks: its copy of a guard made before the fork unlocks nothing (the
//! parent still holds the entities) and succeeds.
class entities_guard {
 public:
  entities_guard() noexcept = default;
  entities_guard(entities_guard&& other) noexcept;
  entities_guard& operator=(entities_guard&& other) noexcept;
  entities_guard(const entities_guard&) = delete;
  entities_guard& operator=(const entities_guard&) = delete;
  ~entities_guard() { (void)unlock(); }

  [[nodiscard]] bool owns_lock() const noexcept { return mutex_ != nullptr; }
  explicit operator bool() const noexcept { return owns_lock(); }
  //! The entities held, sorted by value, each once (a duplicate asked as exclusive and shared
  //! is held exclusive).
  [[nodiscard]] std::span<const entity> entities() const noexcept;
  [[nodiscard]] shared_fs_mutex* mutex() const noexcept { return mutex_; }

  //! Unlocks now. The guard owns nothing afterwards, even when an error is returned (the
  //! algorithm's I/O failed: the entities may stay locked until this process exits).
  result<void> unlock() noexcept {
    if (mutex_ == nullptr) return {};
    return unlock_held();
  }
  //! Stops owning the entities without unlocking them. They stay locked until the process
  //! exits (or, for lock_files, until a waiter finds this process dead).
  void release() noexcept;

 private:
  friend class shared_fs_mutex;
  static constexpr std::size_t inline_capacity = 8;

  result<void> unlock_held() noexcept;
  void assign(std::span<const entity> sorted);
  void reset() noexcept;
  [[nodiscard]] entity* inline_data() noexcept { return reinterpret_cast<entity*>(inline_); }
  [[nodiscard]] const entity* inline_data() const noexcept {
    return reinterpret_cast<const entity*>(inline_);
  }
  [[nodiscard]] entity* data() noexcept { return heap_ ? heap_.get() : inline_data(); }

  shared_fs_mutex* mutex_ = nullptr;
  std::size_t size_ = 0;
  // Raw storage: only the first size_ entities are ever written or read (no start-up cost).
  alignas(entity) std::byte inline_[inline_capacity * sizeof(entity)];
  std::unique_ptr<entity[]> heap_;
  std::uint64_t token_ = 0;       // the algorithm's own (a record offset, a user index, ...)
  std::uint64_t generation_ = 0;  // the fork generation it was locked in
};

//! A mutex over sets of entities, shared between threads and processes through the
//! filesystem. The algorithms (lock_files, byte_ranges, atomic_append, memory_map) and the
//! kernel baselines (flock, fcntl_ofd, sysv) all derive from it; each header documents its
//! cost, fairness, crash behaviour, network-filesystem behaviour and caveats.
//!
//! Thread-safe and process-safe: two threads exclude each other exactly as two processes
//! do, whether they share one instance or each open their own on the same path.
class shared_fs_mutex {
 public:
  shared_fs_mutex(const shared_fs_mutex&) = delete;
  shared_fs_mutex& operator=(const shared_fs_mutex&) = delete;
  virtual ~shared_fs_mutex();

  //! Locks every entity in `set` (all or none) before `d`. Any order of `set` is fine: no
  //! two callers can deadlock whatever orders they list overlapping sets in. An empty set
  //! succeeds at once with an empty guard. `spin_not_sleep` makes waits spin (yielding the
  //! CPU) instead of sleeping: lower latency at the price of a busy core.
  //! Errors: timed_out (finite deadline passed), operation_would_block (zero deadline and
  //! something is held), invalid_argument (a value above entity::max_lockable: nothing is
  //! locked), resource_deadlock_would_occur (this thread already holds one of
  //! them through this lock path), ESTALE (a thread of this instance found the lock path
  //! removed or replaced since the instance opened it: it never locks another file), and
  //! the I/O error that stopped it (never reported as contention).
  [[nodiscard]] result<entities_guard> lock(std::span<const entity> set, deadline d = {},
                                            bool spin_not_sleep = false) noexcept;
  [[nodiscard]] result<entities_guard> lock(std::initializer_list<entity> set, deadline d = {},
                                            bool spin_not_sleep = false) noexcept {
    return lock(std::span<const entity>(set.begin(), set.size()), d, spin_not_sleep);
  }
  //! `lock` with a zero deadline.
  [[nodiscard]] result<entities_guard> try_lock(std::span<const entity> set) noexcept {
    return lock(set, deadline::zero());
  }
  [[nodiscard]] result<entities_guard> try_lock(std::initializer_list<entity> set) noexcept {
    return lock(set, deadline::zero());
  }

  //! The algorithm's name as the CLI spells it ("byte_ranges", ...).
  [[nodiscard]] virtual std::string_view algorithm() const noexcept = 0;

 protected:
  //! `identity` names the lock path (st_dev and st_ino) for deadlock detection.
  explicit shared_fs_mutex(std::uint64_t dev, std::uint64_t ino) noexcept;

  //! Acquires every entity of `sorted` (sorted by value, no duplicates, not empty), all or
  //! none, before `cd` expires. On success returns a token that `do_unlock` gets back.
  //! Return operation_would_block when `cd.is_zero()` and timed_out when it expired.
  virtual result<std::uint64_t> do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                        bool spin_not_sleep) noexcept = 0;
  virtual result<void> do_unlock(std::span<const entity> sorted, std::uint64_t token) noexcept = 0;

 private:
  friend class entities_guard;
  std::uint64_t dev_;
  std::uint64_t ino_;
};

}  // namespace keel::lock
