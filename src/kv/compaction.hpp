#pragma once
// One compaction run (doc/kv-format.md, "Compaction"), as the steps of that section: what each
// step found, kept for the next. store::impl::compact (compaction.cpp) drives the steps; the
// run owns what it found (nothing here is shared: one run at a time holds the maintenance
// byte), and writes the index header's words the header's owner list gives compaction
// (index_file.hpp): *compaction runs* and *compaction ends* (the driver), *fruitless below*
// and *fruitless tail segment* (choose_victims), *dead bytes*, *spare*, *deletes room*,
// *compactions* and *background after* (keep_named_victims, remove_victims).
//
// The steps, each in the file named:
//   1. find_candidates     the segments that may go, once their writers have ended
//                          (compaction_survey.cpp)
//   2. count_live          what is live in each, from every entry of the index (same)
//   3. find_forgettable    erased keys whose erase record is their last (same)
//   4. choose_victims      which candidates go, as the room allows (compaction_victims.cpp)
//   5. move_live           their live records copied to the tail (compaction_moves.cpp)
//  5b. keep_named_victims  a victim still named by an entry stays (same)
//   6. wait_for_readers    the copies synced, and no reader left of an original
//                          (compaction_removal.cpp)
//   7. remove_victims      the victims off the manifest, their room kept or given back (same)

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kv/store_impl.hpp"

namespace keel::kv {

//! The records compaction copies into one relocation block at most (about: it stops once
//! they reach it), so that a move that ends it repoints entries soon after their copy.
inline constexpr std::uint64_t relocation_batch = 64 * 1024;

//! What one segment holds that is live, as step 2 counts it.
struct segment_use {
  std::uint64_t live = 0;             // bytes of records entries name, and of their blobs
  std::uint64_t copies = 0;           // blocks a move writes: a record's, and its blob's
  std::uint64_t largest = 0;          // the largest of those blocks
  std::uint64_t largest_record = 0;   // of them, the largest record's (not a blob's)
  std::uint64_t size = 0;             // the segment's (set for candidates that may go)
  std::uint64_t forgettable = 0;      // of `live`: erase records that go with it, uncopied
  std::uint64_t forgotten = 0;        // of `copies`: those records
  std::set<std::uint64_t> blob_refs;  // other segments holding records whose blobs are here
  bool pinned = false;                // an entry here is pending: leave it alone
};

//! What copying a segment's live records takes: the records (and blobs, each a block of its
//! own, header included), a header for each relocation block (one per relocation_batch, and
//! one more where a segment ends within it), and its largest block once more: a block never
//! spans two segments, so the copies may leave up to that unused where they cross into the
//! next one. Nothing at all for a segment with nothing to copy.
[[nodiscard]] std::uint64_t copy_need(const segment_use& u) noexcept;

struct compaction_run {
  compaction_run(store::impl& store, const io::countdown& deadline, byte_claim claim) noexcept
      : s(store), cd(deadline), how(claim) {}

  store::impl& s;
  const io::countdown& cd;
  const byte_claim how;
  compact_stats st;

  // ---- found by step 1 ----
  std::uint64_t horizon = 0;           // visible then: every snapshot is at or above it
  std::uint64_t numbered_before = 0;   // next segment then: any numbered since is no candidate
  std::uint64_t tail_then = 0;         // the tail then
  std::uint64_t active = 0;            // its segment
  std::uint64_t dead_then = 0;         // dead bytes then
  std::vector<std::uint64_t> numbers;  // seg/'s segments then
  // ---- step 2 ----
  std::map<std::uint64_t, segment_use> use;
  std::set<std::uint64_t> candidates;  // only these were waited for
  //! Erase records the entries name, that no snapshot can see past: key, segment; and
  //! their records' sizes.
  std::vector<std::pair<std::string, std::uint64_t>> erasures;
  std::vector<std::uint64_t> erasure_sizes;
  // ---- step 3 ----
  std::set<std::string, std::less<>> forgettable;
  // ---- steps 4 to 7 ----
  std::set<std::uint64_t> victims;
  std::map<std::uint64_t, std::uint64_t> moved_from;  // record bytes moved, per victim
  std::optional<error> stopped;  // why step 5 stopped short of the last victims (no room)

  // The steps (see the top).
  [[nodiscard]] result<void> find_candidates() noexcept;
  [[nodiscard]] result<void> count_live() noexcept;
  void find_forgettable() noexcept;
  [[nodiscard]] result<void> choose_victims() noexcept;
  [[nodiscard]] result<void> move_live() noexcept;
  [[nodiscard]] result<void> keep_named_victims() noexcept;
  [[nodiscard]] result<void> wait_for_readers() noexcept;
  [[nodiscard]] result<void> remove_victims() noexcept;

  // ---- shared by the steps (compaction.cpp) ----
  //! Stores to the index header where the volume may refuse them (stored_escapably).
  template <class Stores>
  [[nodiscard]] bool stored(Stores&& stores) noexcept {
    return s.stored_escapably(cd, stores);
  }
  //! Waits for the transactions open now; a background run only a moment (it gives up,
  //! timed_out, and runs again once more has died).
  [[nodiscard]] result<void> wait_for_transactions() noexcept;
  //! Whether the spare is as it must be: there and as large as the largest log segment.
  [[nodiscard]] bool spare_as_it_must_be() noexcept;
  //! Makes the spare as it must be, when the volume has the room (after `removed` segments,
  //! btrfs's freed room shown first). Under the `segment` lock.
  [[nodiscard]] result<void> spare_again(bool removed) noexcept;
  //! The end of a run that takes no victim: the spare as it must be, under the `segment`
  //! lock.
  [[nodiscard]] result<compact_stats> end_without_victims() noexcept;
  //! Drops from `victims` any whose blobs a record outside them uses (to a fixed point).
  void close_over_blobs();
  //! After victims were dropped from `before`: the bytes moved out of each dropped one are
  //! dead there now (its originals), added to *dead bytes*.
  [[nodiscard]] result<void> count_moved_of_dropped(const std::set<std::uint64_t>& before) noexcept;

 private:
  // step 2
  [[nodiscard]] result<void> choose_candidates();
  [[nodiscard]] result<void> pin(std::uint64_t at, bool block);
  [[nodiscard]] result<void> count_page(std::uint64_t page);
  [[nodiscard]] result<void> count_entry(std::uint64_t seq, std::uint64_t at);
  // step 4
  [[nodiscard]] result<void> take_eligible();
  void fit_victims_to_room();
  // step 5
  [[nodiscard]] result<void> move_out_of(std::uint64_t n, const segment& seg) noexcept;
  [[nodiscard]] result<void> collect_block(std::uint64_t n, std::span<const std::byte> bytes,
                                           std::uint64_t off, const disk::block_header& head,
                                           std::vector<store::impl::move>& batch,
                                           std::uint64_t& batch_bytes) noexcept;
  // step 7
  struct room_picks {
    std::uint64_t spare = 0;    // the victim kept as the spare (0: none)
    std::uint64_t deletes = 0;  // the victim kept as the deletes' room (0: none)
    bool spare_whole = true;    // the spare, there or kept, as large as every log segment left
  };
  //! What the victims became (sizes; 0: none kept as that).
  struct rooms_kept {
    std::uint64_t spare = 0;
    std::uint64_t deletes = 0;
    std::uint64_t next = 0;  // the number of the one kept as the next segment
    std::uint64_t next_size = 0;
    std::uint64_t freed_dead = 0;  // of the victims, as counted in *dead bytes*
    std::uint64_t room = 0;        // kept as the spare, the deletes' or the next segment
  };
  [[nodiscard]] room_picks pick_rooms() noexcept;
  [[nodiscard]] result<void> give_back(std::uint64_t n, const room_picks& picks,
                                       rooms_kept& kept) noexcept;
  [[nodiscard]] result<void> record_kept_rooms(const rooms_kept& kept) noexcept;
};

}  // namespace keel::kv
