#pragma once
// This process's side of a store's users (doc/kv-format.md, "Users" and "Dead users"): its
// liveness descriptor, through which it holds the open byte of `index` shared and the byte
// of each user slot it leases, its hold on the store file (presence_byte), the slots it
// holds (idle or busy), and its calls reading without a slot. Owns all of it: users.cpp takes and
// gives back the slots, the fork handlers there make a forked child forget its parent's, and
// opening (open.cpp, private_index.cpp) hands over the first descriptor (adopt). The slots' words
// in the index are not owned here: a slot's holder writes them (slot_ref, their layout).

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "base/fork.hpp"
#include "base/thread_safety.hpp"
#include "keel/io/file_handle.hpp"
#include "kv/index_file.hpp"

namespace keel::kv {

//! What a slot's writer is doing (its state word).
enum class commit_state : std::uint64_t { idle = 0, reserved = 1, taking = 2, writing = 3 };

//! A user slot (256 bytes at page 1 + slot × 256).
struct slot_ref {
  std::byte* base;
  std::atomic_ref<std::uint32_t> pid() const noexcept { return u32(0); }
  std::atomic_ref<std::uint32_t> tid() const noexcept { return u32(4); }
  std::atomic_ref<std::uint64_t> start_time() const noexcept { return u64(8); }
  std::atomic_ref<std::uint64_t> snapshot() const noexcept { return u64(16); }
  std::atomic_ref<std::uint64_t> state() const noexcept { return u64(24); }
  std::atomic_ref<std::uint64_t> seq() const noexcept { return u64(32); }
  std::atomic_ref<std::uint64_t> block() const noexcept { return u64(40); }
  std::atomic_ref<std::uint64_t> block_length() const noexcept { return u64(48); }
  //! Snapshots taken in this slot so far: a waiter sees a new transaction begin.
  std::atomic_ref<std::uint64_t> snapshots() const noexcept { return u64(56); }
  //! The delta its user is charging in the space ledger (0: none).
  std::atomic_ref<std::uint64_t> ledger_pin() const noexcept { return u64(slot_ledger_pin); }

 private:
  std::atomic_ref<std::uint32_t> u32(std::size_t at) const noexcept {
    return std::atomic_ref(*reinterpret_cast<std::uint32_t*>(base + at));
  }
  std::atomic_ref<std::uint64_t> u64(std::size_t at) const noexcept {
    return std::atomic_ref(*reinterpret_cast<std::uint64_t*>(base + at));
  }
};

//! A slot this process holds (its byte locked through the liveness descriptor); or, for a
//! read the volume refused a slot's write to, none, with the slotless byte held instead.
struct slot_lease {
  std::uint32_t index = max_slots;
  std::uint64_t generation = 0;  // the fork generation it was leased in
  bool slotless = false;
  [[nodiscard]] bool held() const noexcept { return index < max_slots; }
};

//! What a slot is taken for: a call that may write needs one; one that only reads can do
//! without (slotless_byte) where the volume refuses the slot's write.
enum class slot_use : std::uint8_t { writing, reading };

struct process_users {
  //! Taken after the store's maintenance mutex and before its segment map's (the order the
  //! fork handlers take all three in).
  base::mutex mutex;
  //! Holds the open byte and our slots' bytes; a forked child's copy is its parent's.
  io::file_handle live KEEL_GUARDED_BY(mutex);
  //! The store file, opened by this process, holding presence_byte (taken after the open
  //! byte, let go before it: drop_live); a forked child's copy is its parent's.
  io::file_handle store_hold KEEL_GUARDED_BY(mutex);
  //! The fork generation `live` was opened in.
  std::uint64_t generation KEEL_GUARDED_BY(mutex) = 0;
  //! That generation + 1 while `live` holds the open byte for it (0: no descriptor). Read
  //! without the mutex at the start of every call (store::impl::hold_open_byte), which reads
  //! the index only once this process holds the byte: a forked child that does not yet (its
  //! parent's copy closed) could meet a lone opener's rebuild, which cuts the index short,
  //! and fault on it.
  std::atomic<std::uint64_t> held_in{0};
  //! Slots of ours that no call uses now (beside the idle cells).
  std::vector<std::uint32_t> free_slots KEEL_GUARDED_BY(mutex);
  //! Which slots are ours (their bytes held through `live`).
  std::array<bool, max_slots> ours KEEL_GUARDED_BY(mutex){};
  //! This process's calls reading without a slot now (slotless_byte held through `live` while
  //! there are any), of fork generation `slotless_generation`.
  std::uint32_t slotless_readers KEEL_GUARDED_BY(mutex) = 0;
  std::uint64_t slotless_generation KEEL_GUARDED_BY(mutex) = 0;
  //! Until when (now_ms) a read goes without a slot at once: the volume refused one's write
  //! then, and is asked again only every slots_refused_ms.
  std::atomic<std::uint64_t> slots_refused_until_ms{0};
  static constexpr std::uint64_t slots_refused_ms = 100;
  //! Idle slots of this process, leased and released without the mutex (each cell holds a
  //! slot's index, or max_slots; a thread tries its own cell first). They belong to fork
  //! generation `idle_generation`: a child's copies are not its slots.
  struct alignas(64) idle_cell {
    std::atomic<std::uint32_t> slot{max_slots};
  };
  static constexpr std::size_t idle_cells = 16;
  std::array<idle_cell, idle_cells> idle_slots{};
  std::atomic<std::uint64_t> idle_generation{0};

  //! Whether this process holds the open byte now, read without the mutex (held_in).
  [[nodiscard]] bool holds_open_byte() const noexcept {
    return held_in.load(std::memory_order_acquire) == base::fork_generation() + 1;
  }
  //! Whether `live` is open and this process's own (not a forked child's copy).
  [[nodiscard]] bool live_is_ours() const noexcept KEEL_REQUIRES(mutex) {
    return live.is_open() && generation == base::fork_generation();
  }
  //! Takes `f`, which holds the open byte shared, as this process's liveness descriptor, and
  //! `store` (holding presence_byte, or not open: a reader with an index of its own).
  void adopt(io::file_handle f, io::file_handle store) noexcept KEEL_REQUIRES(mutex) {
    store_hold = std::move(store);
    live = std::move(f);
    generation = base::fork_generation();
    held_in.store(generation + 1, std::memory_order_release);
  }
  //! Closes `live` (a forked child's copy of its parent's, or one no longer ours).
  void drop_live() noexcept KEEL_REQUIRES(mutex) {
    held_in.store(0, std::memory_order_release);
    (void)store_hold.close();
    (void)live.close();
  }
  //! Forgets the slots held (the descriptor closed first, or a forked child's copy closed):
  //! none is ours any more.
  void forget_slots() noexcept KEEL_REQUIRES(mutex) {
    free_slots.clear();
    ours.fill(false);
    forget_idle_slots();
  }
  //! Empties the idle cells (the mutex held, or the only thread).
  void forget_idle_slots() noexcept {
    for (auto& c : idle_slots)
      c.slot.store(max_slots, std::memory_order_relaxed);
    idle_generation.store(base::fork_generation(), std::memory_order_release);
  }
};

//! While it lives, `f` (a descriptor through which an opener holds bytes of a store before it
//! hands it to the store's users: open_index) is closed in a child forked meanwhile, as the
//! users' own are (users.cpp's fork handlers): the child's copy would keep those bytes held
//! for the child's whole life, and openers would find a user there that is none. Its end
//! closes `f` (unless handed over), before a fork may come that no longer closes it.
class closed_in_forked_children {
 public:
  explicit closed_in_forked_children(io::file_handle& f) noexcept;
  ~closed_in_forked_children();
  //! Opens the descriptor with `how` where no fork comes between its making and its being
  //! `f` (a child forked between them would keep a copy nobody closes).
  [[nodiscard]] result<void> make(const std::function<result<io::file_handle>()>& how) noexcept;
  closed_in_forked_children(const closed_in_forked_children&) = delete;
  closed_in_forked_children& operator=(const closed_in_forked_children&) = delete;

 private:
  io::file_handle* f_;
};

}  // namespace keel::kv
