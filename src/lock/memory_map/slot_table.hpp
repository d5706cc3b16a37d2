#pragma once
// The slot protocol of memory_map, on the shared map: taking, releasing and handing on a
// slot, and clearing what a dead user left in one. Everything here works on the map's bytes
// alone (no files), so fuzz/ can drive it over a table of garbage.
//
// A slot is free when its writer word is 0 and no reader bit is set. A writer stores its
// user index + 1 (compare-and-swap from 0), then checks the reader set; a reader sets its
// bit, then checks the writer word. Each side publishes before it looks (seq_cst), so at
// least one of two racing lockers sees the other and backs off: never both inside.
//
// Waiters sleep on their own futex word (user_entry::wake) after setting their bit in the
// slot's waiter set. A releaser that finds waiters hands the slot
// to the next one after itself in user order (round robin, so every waiter gets its turn):
// an exclusive waiter that has slept long is granted the slot (the writer word set to its
// index + 1 | `granted`) before it is woken, so a releaser that comes straight back cannot
// take the slot again in front of it. The target collects a grant by clearing `granted`;
// one nobody will collect (the target gave up) is withdrawn by a compare-and-swap that only
// matches the uncollected grant, so a grant that became a held lock is never taken back.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "format.hpp"
#include "keel/io/deadline.hpp"
#include "keel/lock/shared_fs_mutex.hpp"

namespace keel::lock::memory_map_detail {

constexpr std::uint32_t no_slot = 0xffffffffu;
constexpr std::uint32_t wants_exclusive = 0x80000000u;
//! In a writer word: handed to that user, not yet collected by it.
constexpr std::uint64_t granted = std::uint64_t{1} << 32;

//! A sleeper that has waited this long is handed the slot; before, a release only wakes it
//! and anyone may take the slot first (short holds then run back to back without a
//! hand-over, and a long wait always ends in one).
constexpr std::uint64_t hand_over_after_ns = 1'000'000;

struct user_entry {
  std::uint32_t pid;
  std::uint32_t tid;
  std::uint64_t start_time;
  std::uint32_t wake;   // futex word: bumped by whoever wakes this user
  std::uint32_t wants;  // the slot it sleeps on (| wants_exclusive), or no_slot
  std::uint32_t clean;  // non-zero: the last user of this index left no mark in any slot
  std::uint32_t reserved;
  std::uint64_t waiting_since_ns;  // CLOCK_MONOTONIC when it started waiting on `wants`
};
static_assert(sizeof(user_entry) <= user_size);

struct slot_ref {
  std::uint64_t* base;
  [[nodiscard]] std::atomic_ref<std::uint64_t> writer() const noexcept { return word(0); }
  //! The user spinning on the slot (index + 1), or 0: one spinner per slot at a time, named
  //! so that one that died spinning can be cleared.
  [[nodiscard]] std::atomic_ref<std::uint64_t> spinner() const noexcept { return word(2); }
  [[nodiscard]] std::atomic_ref<std::uint64_t> spin_budget_ns() const noexcept { return word(3); }
  [[nodiscard]] std::atomic_ref<std::uint64_t> woken() const noexcept { return word(4); }
  [[nodiscard]] std::atomic_ref<std::uint64_t> readers(std::size_t w) const noexcept {
    return word(8 + w);
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> waiters(std::size_t w) const noexcept {
    return word(8 + bitset_words + w);
  }
  //! Non-zero when someone may sleep on the slot: set by each sleeper after its bit, cleared
  //! by a releaser that finds the waiter set empty (and that then looks again, restoring it if
  //! a bit appeared). Never 0 while a live sleeper's bit is set and no releaser is between
  //! the two looks, so a release that reads 0 has nobody to wake; a stale 1 costs one look.
  //! (Up to format 5 this word counted sleepers, and drifted for good when a sleeper died
  //! between its bit and its count.)
  [[nodiscard]] std::atomic_ref<std::uint64_t> maybe_waiters() const noexcept { return word(1); }
  //! Whether anyone sleeps on the slot: the waiter set itself, which recovery clears exactly.
  [[nodiscard]] bool has_waiters() const noexcept {
    std::uint64_t any = 0;
    for (std::size_t w = 0; w < bitset_words; ++w)
      any |= waiters(w).load();
    return any != 0;
  }
  //! How many sleep on the slot.
  [[nodiscard]] std::uint64_t waiter_total() const noexcept;
  //! Whether any reader other than user `u` is in (`no_slot`: any reader). Every exclusive
  //! take asks: the common case (no reader at all) is one inline pass.
  [[nodiscard]] bool other_readers(std::uint32_t u) const noexcept {
    std::uint64_t any = 0;
    for (std::size_t w = 0; w < bitset_words; ++w)
      any |= readers(w).load();
    return any != 0 && other_readers_slow(u);
  }
  //! The user the writer word names (held or granted), or no_slot when it is free.
  [[nodiscard]] std::uint32_t writer_user() const noexcept;

 private:
  [[nodiscard]] bool other_readers_slow(std::uint32_t u) const noexcept;
  [[nodiscard]] std::atomic_ref<std::uint64_t> word(std::size_t i) const noexcept {
    return std::atomic_ref<std::uint64_t>(base[i]);
  }
};

//! One slot a lock call needs, and how.
struct slot_request {
  std::uint32_t slot;
  bool exclusive;
};

//! The slot of an entity's value.
[[nodiscard]] inline std::size_t slot_of(std::uint64_t value) noexcept {
  static_assert((slots & (slots - 1)) == 0);
  return static_cast<std::size_t>((value * 0x9e3779b97f4a7c15ULL) >> 52) & (slots - 1);
}

//! The slots a set needs, each once (exclusive wins where two entities share one). Uses
//! `small` when it fits, else `big`.
std::span<slot_request> collect_slots(std::span<const entity> sorted,
                                      std::array<slot_request, 16>& small,
                                      std::vector<slot_request>& big);

//! What one user (a thread of one instance) holds: its index in the user table and how many
//! times it holds each slot (two entities of its sets may share one).
struct slot_user {
  std::uint32_t index = 0;
  std::vector<std::uint32_t> exclusive_holds;
  std::vector<std::uint32_t> shared_holds;
};

[[nodiscard]] std::uint64_t monotonic_ns() noexcept;

//! Test-only: points inside hand_on where a test makes the target act, to reproduce races
//! deterministically. Null (the default) costs one relaxed load on the hand-over path.
enum class hand_on_point : std::uint8_t {
  chose_exclusive_target,  //!< decided to wake or grant to an exclusive waiter
  made_grant,              //!< granted the slot, before checking the target still waits
};
using hand_on_hook = void (*)(hand_on_point, std::size_t slot, std::uint32_t target);
extern std::atomic<hand_on_hook> test_hand_on_hook;

//! The protocol over one map's bytes (map_size of them).
class slot_table {
 public:
  explicit slot_table(std::byte* map = nullptr) noexcept : map_(map) {}

  [[nodiscard]] slot_ref slot(std::size_t i) const noexcept {
    return slot_ref{reinterpret_cast<std::uint64_t*>(map_ + slots_at + i * slot_size)};
  }
  [[nodiscard]] user_entry* user(std::size_t u) const noexcept {
    return reinterpret_cast<user_entry*>(map_ + users_at + u * user_size);
  }
  [[nodiscard]] std::atomic_ref<std::uint32_t> wake_word(std::uint32_t u) const noexcept {
    return std::atomic_ref<std::uint32_t>(user(u)->wake);
  }
  [[nodiscard]] std::atomic_ref<std::uint32_t> wants_word(std::uint32_t u) const noexcept {
    return std::atomic_ref<std::uint32_t>(user(u)->wants);
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> degraded_word() const noexcept {
    return std::atomic_ref<std::uint64_t>(
        *reinterpret_cast<std::uint64_t*>(map_ + map_degraded_at));
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> next_user_word() const noexcept {
    return std::atomic_ref<std::uint64_t>(
        *reinterpret_cast<std::uint64_t*>(map_ + map_next_user_at));
  }

  //! Wakes user `u` (bumps its futex word).
  void wake(std::uint32_t u) const noexcept;
  //! The first waiter of `s` after user `from` in circular user order, not `from`.
  [[nodiscard]] static std::uint32_t next_waiter(const slot_ref& s, std::uint32_t from) noexcept;
  //! Called by user `from` after it released slot `i` (or backed off from it; seq_cst): if the
  //! slot is free and someone sleeps on it, hands it to the next waiter. Exclusive waiters are
  //! woken to compete, or granted the writer word after hand_over_after_ns; shared waiters
  //! are woken to take their bits. A waiter whose own reader bit is the only one (a
  //! shared-to-exclusive upgrade) counts as free for it.
  void hand_on(std::size_t i, std::uint32_t from) const noexcept {
    if (slot(i).maybe_waiters().load() == 0) return;  // nobody sleeps on it: the common case
    hand_on_to_waiters(i, from);
  }
  //! Takes back a grant to `u` that nobody will collect, and hands the slot on: whether
  //! there was one (a grant `u` collected is its lock and is never taken back).
  bool withdraw_grant(std::size_t i, std::uint32_t u) const noexcept;
  //! Takes back what a releaser killed half-way through `hand_on` left to a live user that
  //! no longer waits on slot `i`: a grant (nobody would collect it, and the slot would stay
  //! taken while its owner lives) or a woken mark (no release would wake a sleeper again).
  //! Whether there was one.
  bool drop_orphans(std::size_t i) const noexcept;
  //! Removes every mark user `u` left in slot `i` (held, granted, reading, waiting, woken),
  //! and hands the slot on if that freed it.
  void clear_user_in(std::size_t i, std::uint32_t u) const noexcept;
  //! One attempt at slot `r` for `me`; counts the hold on success.
  bool take(slot_user& me, const slot_request& r) const noexcept;
  //! Releases one hold of slot `r` by `me`.
  void give(slot_user& me, const slot_request& r) const noexcept;
  //! Spins for slot `r` while nobody sleeps on it, one spinner per slot at a time, for an
  //! adaptive budget (base::next_spin_budget, 1–200 µs).
  bool spin_for(slot_user& me, const slot_request& r, const io::countdown& cd) const noexcept;
  //! Whether any slot is held by (or handed to) any of `users`.
  [[nodiscard]] bool marks_of(std::span<const std::uint32_t> users) const noexcept;

 private:
  void hand_on_to_waiters(std::size_t i, std::uint32_t from) const noexcept;

  std::byte* map_;
};

}  // namespace keel::lock::memory_map_detail
