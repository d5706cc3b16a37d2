#pragma once
// One commit (doc/kv-format.md, "Committing"), as the steps of that section: what each step
// found, kept for the next. transaction::impl::commit (commit.cpp) drives the steps; the run
// is the committing thread's alone.
//
// The steps, each in the file named:
//   plan_keys          every key written or read, hashed          (commit_prepare.cpp)
//   1. size_up         the block's size and its blobs', checked against what may be
//      charge          the ledger charged the worst case (a put)
//      write_blobs     large values written to blocks of their own
//   2-4. lock_and_validate  the keys' pages locked and looked up; a key changed since the
//                      snapshot is a conflict; pages too full for the new keys grown
//                      (commit_validate.cpp)
//      ready_index_pages, build_records
//   (the driver arms the escape from a volume that refuses write faults here)
//   reserve_block      the slot says *reserved*, the block's room taken  (commit_write.cpp)
//   5. mark            each written key's entry pending on the block
//   6. take_seq        the commit's seq, recorded in the slot
//   7. write_block     the block written, sealed last
//   9. publish         each entry names its new record
//  10. make_visible    visible in seq order; the slot idle, the locks let go
//   8. make_durable    for durability::sync, a group sync that covers it
//
// From the escape's arming to make_visible's disarming, a refused store jumps back into the
// driver (io/map_guard.hpp, "A way out"): the steps of that stretch hold nothing that needs
// a destructor run (what does lives in a scope that holds the escape back), and what the
// escape reads after the jump (`taken`, `reserved`) is volatile.

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "kv/transaction_impl.hpp"

namespace keel::kv {

//! One key of a commit as it goes through the protocol.
struct key_plan {
  std::string_view key;
  disk::key_hash h{};
  const write_set::write* w = nullptr;  // null: only read
  std::uint64_t page = 0;
  std::optional<index::entry_ref> entry;  // its entry, if it has one
  std::uint64_t prev = 0;                 // the entry's location and seq at validation
  std::uint64_t prev_seq = 0;
  std::uint64_t prev_size = 0;  // bytes of the previous version, 0 if none or an erase
  disk::blob_ref blob{};
  bool own_segment = false;  // its blob in a segment of its own
  std::uint64_t record_at = 0;
};

//! A commit's charge in the ledger (a commit that puts, with the ledger on): left as spent
//! once space was taken, else refunded, when the commit ends (or at `done`).
struct ledger_hold {
  store::impl* s = nullptr;
  slot_lease* lease = nullptr;
  const io::countdown* cd = nullptr;
  std::uint32_t who = 0;
  space::charge c;
  bool used = false;  // space was taken: it stays charged
  void done() noexcept;
  ledger_hold() = default;
  ledger_hold(const ledger_hold&) = delete;
  ledger_hold& operator=(const ledger_hold&) = delete;
  ~ledger_hold() {
    if (s != nullptr) done();
  }
};

struct commit_run {
  commit_run(transaction::impl& transaction, durability durability,
             const io::countdown& deadline) noexcept
      : t(transaction), s(transaction.s), d(durability), cd(deadline) {}

  transaction::impl& t;
  store::impl* const s;
  const durability d;
  const io::countdown& cd;

  std::vector<key_plan> keys;
  // ---- step 1 ----
  bool only_erases = false;  // it may use the deletes' room
  bool has_blobs = false;
  std::uint64_t need = 0;  // its block and blobs, ideally placed
  //! Of that, blobs in a segment file of their own, header and all (larger than a segment,
  //! or as size_up chooses), and what each takes of the room for puts, counted in whole
  //! segments less their headers: up to one segment more than its file's size, by rounding.
  std::uint64_t own_segments = 0;
  std::uint64_t own_room = 0;
  //! Whether size_up gave a blob a segment of its own to save room (not for its size), and
  //! whether it may not: a segment of its own is charged whole segments, so a commit the
  //! ledger refuses so is sized again with such blobs in the log (commit.cpp).
  bool chose_own = false;
  bool blobs_in_log = false;
  std::uint64_t puts = 0;
  std::uint64_t block = 0;  // the commit block alone
  ledger_hold charged;
  // ---- steps 2 to 4 ----
  lock::entities_guard held;
  std::vector<disk::record_in> records;
  std::uint64_t length = 0;  // the block's
  // ---- steps 5 to 10 ----
  bool escapable = false;               // the escape is armed
  volatile std::uint64_t taken = 0;     // the seq, once taken
  volatile std::uint64_t reserved = 0;  // the block's location, once reserved
  std::uint64_t location = 0;           // the block's
  std::span<std::byte> bytes;           // the block's, mapped
  std::uint64_t seq = 0;

  // The steps (see the top).
  [[nodiscard]] result<void> plan_keys() noexcept;
  [[nodiscard]] result<void> size_up() noexcept;
  [[nodiscard]] result<void> charge() noexcept;
  [[nodiscard]] result<void> write_blobs() noexcept;
  [[nodiscard]] result<void> lock_and_validate() noexcept;
  [[nodiscard]] result<void> ready_index_pages() noexcept;
  [[nodiscard]] result<void> build_records() noexcept;
  [[nodiscard]] result<void> reserve_block() noexcept;
  //! A failure before the marks: nothing of the commit is seen (its space, if reserved, is
  //! dead, as a writer's that died there). The escape disarmed; a slot whose page the volume
  //! refuses now is given up instead, a dead writer's that every user settles.
  [[nodiscard]] std::unexpected<error> fail_unmarked(const error& e) noexcept;
  void mark() noexcept;
  void take_seq() noexcept;
  //! Whether the block was sealed (else a waiter abandoned it first: see give_up_marks).
  [[nodiscard]] bool write_block() noexcept;
  //! The block was abandoned before it was sealed: every mark goes back, the seq is a hole.
  [[nodiscard]] result<std::uint64_t> give_up_marks() noexcept;
  [[nodiscard]] store::impl::counter_delta publish() noexcept;
  void make_visible(const store::impl::counter_delta& delta) noexcept;
  [[nodiscard]] result<std::uint64_t> make_durable() noexcept;

 private:
  [[nodiscard]] slot_ref me() const noexcept { return s->slot(t.lease.index); }
  // steps 2 to 4
  enum class round : std::uint8_t { done, again };
  [[nodiscard]] result<round> lock_pages() noexcept;
  [[nodiscard]] result<void> look_up(std::map<std::uint64_t, std::size_t>& new_keys) noexcept;
  [[nodiscard]] result<round> grow_pages(
      const std::map<std::uint64_t, std::size_t>& new_keys) noexcept;
};

}  // namespace keel::kv
