#pragma once
// The store's seams for tests: functions called at named points of its protocols when a test
// sets them (null otherwise, one load each), to kill a writer there, stop it, or let another
// thread run. Set by tests alone (kv_support.hpp and the kv tests); the store only calls
// them.

#include <cstdint>

#include "keel/io/file_handle.hpp"

namespace keel::kv {

//! For tests: called by compact after it moved the live records, before it waits for the
//! snapshots that may still read the originals.
inline void (*compact_moved_hook)() noexcept = nullptr;
//! For tests: called by compact once its victims are off the manifest, before their entries
//! in the segment table are emptied and their files removed.
inline void (*compact_unlisted_hook)() noexcept = nullptr;
//! For tests: called by compaction once a relocation block is written, before the entries
//! that name its originals are made to name its copies.
inline void (*relocation_written_hook)() noexcept = nullptr;
//! For tests: called by a checkpoint once its file is in place, before the header names it.
inline void (*checkpoint_written_hook)() noexcept = nullptr;
//! For tests: io::atomic_replace's hook for the checkpoint's file (may kill the process).
inline void (*checkpoint_replace_hook)(io::replace_step, void*) noexcept = nullptr;

//! For tests: called by the ledger's closer as it begins to close a delta.
inline void (*ledger_close_hook)() noexcept = nullptr;

//! For tests: called by a reader between finding a key's page and looking in it (to let
//! splits run there).
inline void (*read_page_hook)() noexcept = nullptr;

//! For tests: called by a rebuild once it has cut the index file to nothing, before it grows
//! the new one.
inline void (*index_reset_hook)() noexcept = nullptr;

//! For tests: called by an opener between its two opens of the index by path (the one it
//! maps, the one it locks), to replace the file there.
inline void (*index_opened_hook)() noexcept = nullptr;

//! For tests: called by an opener alone in the store (holding the open byte exclusively and
//! the presence byte), before it checks or rebuilds the index (to fork there).
inline void (*alone_opening_hook)() noexcept = nullptr;

//! For tests: called by a store's close once its threads are joined, before it gives back
//! its slots and lets go of its bytes (to fork there).
inline void (*closing_hook)() noexcept = nullptr;

//! For tests: called while the free page list is marked as being changed (to kill there).
inline void (*free_list_hook)() noexcept = nullptr;

//! For tests: called by acquire_slot once the slot's page is asked for, before the call uses it.
inline void (*slot_ready_hook)() noexcept = nullptr;
//! For tests: called by segment_at while it maps a segment, holding the segment map's mutex.
inline void (*segment_map_hook)() noexcept = nullptr;

//! The steps of a commit, for tests that kill a writer at each one (`commit_hook`).
enum class commit_step : std::uint8_t {
  charging,       //!< (a put, with the ledger on) about to charge the ledger, nothing stored
  charged,        //!< (a put, with the ledger on) charged and pinned in a delta, no lock taken
  locked,         //!< its pages locked and validated
  reserved,       //!< its block's space reserved
  marked,         //!< its entries marked pending
  took_seq,       //!< its seq taken, not yet written in its slot
  recorded,       //!< its seq in its slot, its block not yet written
  written,        //!< its block complete, nothing published
  published_one,  //!< its first entry published
  published,      //!< every entry published, not yet visible
  visible,        //!< visible, pages still locked
  leaving,        //!< visible, pages unlocked, its charge (if any) not yet left in the ledger
  sync_waiting,   //!< (sync commits) it has noted the sync count it waits to see pass
  syncing,        //!< (a sync leader) its sync started and the dirty bits taken, no file synced
};
//! Called at each step of every commit when set (tests only; null otherwise).
inline void (*commit_hook)(commit_step) noexcept = nullptr;
//! Where a commit reaches step `at`: calls commit_hook, when set.
inline void commit_step_reached(commit_step at) noexcept {
  if (commit_hook != nullptr) commit_hook(at);
}

}  // namespace keel::kv
