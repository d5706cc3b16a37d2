#pragma once
// The index file's fixed part, as every user maps it (doc/kv-format.md, "The index"): the
// header's words and who writes each, the users' slots, the segment table, the byte-range
// locks and the lock entities beside the bucket pages.

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

#include "base/format_header.hpp"
#include "keel/space/ledger.hpp"
#include "kv/format.hpp"
#include "kv/index.hpp"

namespace keel::kv {

// ---- The index file's fixed part (doc/kv-format.md, "The index") ----

// Who writes which word: each file below writes only the words it lists, and the rest of the
// store only reads them (tests/kv/header_writers.py checks every write: a store, fetch or
// exchange through h64, through a name bound to it, or the word's address handed on). A part
// that holds the store alone (an opener that initialises the index, a rebuild, a checkpoint
// loaded at open) writes words that are others' while the store is in use.
//
//   open.cpp: visible next_seq sync_error sync_error_segment visible_waiters fruitless_below
//     deletes_segment dead_bytes (alone: an index reset; dead_bytes of a leftover segment a
//     lone opener removes); split_journal ledger (their addresses, handed to index::table and
//     space::ledger, which write them)
//   recovery.cpp: store_id boot_id checksum state tail next_seq visible counting next_segment
//     live_records live_bytes dead_bytes pages_allocated pages_used unvoided_torn (a rebuild
//     from the log, alone)
//   checkpoint.cpp: checkpoint_from checkpoint_seq checkpoint_bytes checkpoint_error;
//     directory live_records live_bytes dead_bytes retired_pages pages_allocated pages_used
//     (a checkpoint loaded at open, alone)
//   maintenance.cpp: checkpoint_error checkpoint_attempt (a background checkpoint begun, or
//     failed) maintenance_wanted
//   checkpoint_write.cpp: checkpoint_from checkpoint_seq checkpoint_bytes checkpoint_error (a
//     checkpoint written)
//   pages.cpp: pages_allocated pages_used retired_pages free_head free_tail free_pages
//     free_changing
//   segments.cpp: next_segment
//   reserve.cpp: tail deletes_segment dead_bytes (the end of a segment a block skips)
//   commit_write.cpp: next_seq
//   visible.cpp: visible visible_waiters dead_check_ns counting live_records live_bytes
//     dead_bytes
//   store_impl.hpp: visible_gates (their addresses, for visible.cpp's waits and wakes)
//   group_sync.cpp: sync_started sync_done sync_error sync_error_segment sync_joined
//     sync_batch sync_mark sync_ns
//   manifest.cpp: sync_error sync_error_segment (a segment's failed sync at its sealing)
//   compaction.cpp: compaction_runs compaction_ends dead_bytes (of a victim that stays)
//   compaction_victims.cpp: fruitless_below fruitless_tail_segment
//   compaction_removal.cpp: compactions background_after fruitless_below spare deletes_room
//     dead_bytes
//   compaction_schedule.cpp: background_after
//   relocate.cpp: dead_bytes (a copy none names)
//   space.cpp: ledger ledger_closer
//   users.cpp: ledger_closer (a dead closer's) unvoided_torn
namespace header {
constexpr std::size_t store_id = 24;
constexpr std::size_t boot_id = 40;
constexpr std::size_t state = 56;
constexpr std::size_t visible = 64;
constexpr std::size_t next_seq = 72;
constexpr std::size_t tail = 80;
constexpr std::size_t next_segment = 88;
constexpr std::size_t sync_started = 96;
constexpr std::size_t sync_done = 104;
constexpr std::size_t sync_error = 112;
// When a waiter on *visible* last looked whether the writer in front is dead (steady clock,
// ns; a hint: see store::impl::dead_check_is_taken).
constexpr std::size_t dead_check_ns = 120;
constexpr std::size_t pages_allocated = 128;
constexpr std::size_t pages_used = 136;
// The free page list (retired bucket pages, oldest first, linked through the pages): its
// first page, its last, and how many (doc/kv-format.md, "Growth").
constexpr std::size_t free_head = 144;
constexpr std::size_t live_records = 160;
constexpr std::size_t live_bytes = 168;
constexpr std::size_t dead_bytes = 176;
constexpr std::size_t visible_waiters = 184;
constexpr std::size_t retired_pages = 192;
constexpr std::size_t free_tail = 200;
// 1 while the list is being changed: the next to change it finds its changer died there.
constexpr std::size_t free_changing = 208;
constexpr std::size_t free_pages = 216;
// The size of seg/deletes while it is there and whole (0: none): see room_file.
constexpr std::size_t deletes_room = 224;
constexpr std::size_t checkpoint_from = 232;     // where the replay from the last checkpoint starts
constexpr std::size_t checkpoint_seq = 240;      // the seq the last checkpoint is a copy at
constexpr std::size_t counting = 248;            // the seq whose counter changes are being added
constexpr std::size_t checkpoint_error = 256;    // errno of the last failed checkpoint, or 0
constexpr std::size_t checkpoint_attempt = 264;  // tail when a background checkpoint began
// Group commit's batching hints (see group_sync).
constexpr std::size_t sync_joined = 272;  // durable commits that have asked for a sync so far
constexpr std::size_t sync_batch = 280;   // how many asked between the last two syncs' starts
constexpr std::size_t sync_mark = 288;    // sync_joined when the last sync started
constexpr std::size_t sync_ns = 296;      // how long the last sync took
// The segment an erase made from the room puts leave for deletes (0: none): puts do not
// write into it (see room_for).
constexpr std::size_t deletes_segment = 304;
// The size of seg/spare while it is there and whole (0: none): see room_file.
constexpr std::size_t spare = 312;
// Read by every lookup, written seldom: a cache line apart from the words every commit
// writes.
constexpr std::size_t directory = 320;
constexpr std::size_t split_journal = 328;  // old, low, high: index::split_journal
constexpr std::size_t compactions = 352;    // segments removed by compaction so far (batches)
// When a caller last waited for the maintenance byte (steady clock, ns; 0: never): background
// work does not take it within maintenance_yield_ns of that, so that asked-for checkpoints,
// compactions and verifies are not kept waiting by it (a hint).
constexpr std::size_t maintenance_wanted = 360;
// *Dead bytes* below which no background compaction begins: a segment above what the last
// compaction left (0: none yet; a hint, see store::impl::compaction_due).
constexpr std::size_t background_after = 368;
// The space ledger's words (keel/space/ledger.hpp): a cache line of their own, charged by
// every commit that puts.
constexpr std::size_t ledger = 384;
// The ledger's closer: (1 + the slot of the user closing a delta) << 32 | its pid (0: none). Not a
// keel::lock entity: one sharing a lock slot with a bucket page would wait for that page's writer,
// who may be inside the delta being closed.
constexpr std::size_t ledger_closer = 448;
// Compaction runs begun so far (whether they removed anything: see make_room).
constexpr std::size_t compaction_runs = 456;
// Compaction runs ended so far: a futex (low 32 bits) for writers waiting for one to end.
constexpr std::size_t compaction_ends = 464;
// A compaction short of room that found nothing to take: it could take something only once
// *dead bytes* reach this (0: no such finding), or a segment is sealed after the one the tail
// was in then (whose number is in the next word). A hint that spares a full store's puts a
// walk of the whole index each (see compaction_would_take_nothing).
constexpr std::size_t fruitless_below = 472;
constexpr std::size_t fruitless_tail_segment = 480;
// The segment whose fdatasync failed (with *sync error*: written before it).
constexpr std::size_t sync_error_segment = 488;
// The first block a read-only rebuild found torn and could not void (0: none): no close
// records it, or anything after it, as durable (seal_durable).
constexpr std::size_t unvoided_torn = 496;
// The size of `checkpoint` as last written (0: none): counted under options::max_bytes.
constexpr std::size_t checkpoint_bytes = 504;
// Futex words for waiters on *visible*: the gate of seq s (4 bytes at visible_gates + 4 ×
// (s % visible_gate_count)) moves on when *visible* becomes s, and only its waiters wake.
constexpr std::size_t visible_gates = 512;
constexpr std::size_t visible_gate_count = 128;
// One bit per segment table entry: a block was written into that segment since the last
// group sync began.
constexpr std::size_t dirty_segments = 1024;
constexpr std::size_t checksum = 4088;
constexpr std::size_t checksummed = 56;  // bytes 0-55 never change while the index is in use
}  // namespace header

constexpr std::uint64_t state_building = 0;
constexpr std::uint64_t state_valid = 1;

constexpr std::size_t slot_first_page = 1;
constexpr std::size_t max_slots = 1024;
constexpr std::size_t slot_size = 256;
//! Where in a slot its user's ledger words are (space::writer_words: the delta it is
//! charging, 0: none; and its cost).
constexpr std::size_t slot_ledger_pin = 64;
constexpr std::size_t slot_ledger_cost = 72;
static_assert(slot_ledger_cost == slot_ledger_pin + offsetof(space::writer_words, cost));
constexpr std::size_t segtab_first_page = 65;
constexpr std::size_t segtab_entries = 8064;
constexpr std::size_t segtab_entry_size = 32;
constexpr std::size_t dirty_words = (segtab_entries + 63) / 64;
static_assert(header::visible_gates + 4 * header::visible_gate_count <= header::dirty_segments);
static_assert(header::dirty_segments + dirty_words * 8 <= header::checksum);
constexpr std::size_t first_free_page = 128;
//! A new (or rebuilt) index file's pages (the most: a store whose segments grow starts with
//! initial_index_pages_growing, its first directory page and buckets and no more).
constexpr std::size_t initial_index_pages = first_free_page + 256;
constexpr std::size_t initial_index_pages_growing = first_free_page + 1 + 64;
//! A new index's pages for a store whose first segment size is `first_segment_size` (0: fixed
//! segments).
[[nodiscard]] constexpr std::size_t initial_index_pages_for(
    std::uint64_t first_segment_size) noexcept {
  return first_segment_size != 0 ? initial_index_pages_growing : initial_index_pages;
}
//! Keys a log segment of `size` holds as single puts, each record of `mean` bytes in a block
//! of its own (at least the smallest record: a header and an 8-byte key).
[[nodiscard]] std::uint64_t keys_in_segment(std::uint64_t size, std::uint64_t mean) noexcept;

// Byte-range locks on the index file (through the liveness descriptor).
constexpr off_t user_byte = off_t{1} << 40;  // + slot: held while the slot's user lives
constexpr off_t open_byte = off_t{1} << 41;  // shared by every open store; exclusive: alone
// The maintenance byte: held by the one checkpointer, compactor or verifier at a time.
constexpr off_t checkpoint_byte = open_byte + 1;
// Held shared by a process while any of its calls reads without a slot, the volume having
// refused the slot's write (btrfs at its quota: a reader never needs to write). Such a reader
// takes the byte, then the visible seq: whoever finds the byte free after reading *visible*
// knows every reader without a slot that comes later reads at or above it, as a slot's
// snapshot says (reuse_horizon, wait_for_transactions).
constexpr off_t slotless_byte = open_byte + 2;
// Byte-range locks on the store file (`keel-kv`, there before any other file and after: an
// index may be missing), held shared by readers with an index of their own
// (store::impl::private_index): the first while one builds it from the log (an opener that
// would write waits: the log must not move under the build), the second for as long as one
// lives (compaction then only unlinks the segments it gives back, never zeroes or truncates
// them: such a reader maps them without a slot that would make compaction wait for it).
constexpr off_t private_opening_byte = 0;
constexpr off_t private_reading_byte = 1;
// Held shared by an opener that found a private reader building and waits for it: no new
// such reader starts meanwhile (one after another, their builds would keep it out for ever).
constexpr off_t opener_waiting_byte = 2;
// Held shared by every process that has the store open through the shared index (beside the
// index's open byte: taken after it, let go before it), on a descriptor of the store file of
// its own (process_users::store_hold). The index's open byte cannot say who is there once the
// index is removed by hand, or replaced: an opener alone on the index at the path that finds
// this byte held by another stands aside (a user goes on through an index no longer there;
// two indexes over one log lose commits), as does a reader that would build its own.
constexpr off_t presence_byte = 3;
//! How the maintenance byte is asked for (store::impl::take_checkpoint_byte).
enum class byte_claim : std::uint8_t {
  wait,        //!< until the countdown expires (announced: background work stands aside)
  try_once,    //!< fails at once when it is held
  background,  //!< as try_once, and not while a caller waits for it
};

// Lock entities beside the bucket pages' numbers.
constexpr std::uint64_t entity_base = std::uint64_t{1} << 62;
constexpr std::uint64_t entity_segment = entity_base + 2;
constexpr std::uint64_t entity_directory = entity_base + 3;
constexpr std::uint64_t entity_sync = entity_base + 4;

//! How far the index may grow: the size of the window every user maps (pages past the file's
//! end are never touched).
constexpr std::uint64_t index_window = std::uint64_t{1} << 36;

inline constexpr base::format index_format{"KEELKVX1", 6,
                                           base::layout_of({disk::page_size,
                                                            first_free_page,
                                                            max_slots,
                                                            slot_size,
                                                            segtab_entries,
                                                            index::entries_per_page,
                                                            header::retired_pages,
                                                            header::free_head,
                                                            header::free_tail,
                                                            header::free_changing,
                                                            header::free_pages,
                                                            header::directory,
                                                            header::split_journal,
                                                            header::compactions,
                                                            header::checkpoint_attempt,
                                                            header::dirty_segments,
                                                            header::sync_ns,
                                                            header::deletes_segment,
                                                            header::spare,
                                                            header::deletes_room,
                                                            header::ledger,
                                                            header::ledger_closer,
                                                            header::compaction_runs,
                                                            header::compaction_ends,
                                                            slot_ledger_pin,
                                                            slot_ledger_cost,
                                                            header::visible_gates,
                                                            header::visible_gate_count,
                                                            index_window})};

}  // namespace keel::kv
