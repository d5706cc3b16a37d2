// Compaction's driver (doc/kv-format.md, "Compaction"): the maintenance byte taken, the run
// counted, then the steps of compaction.hpp in order, as LevelDB's DBImpl::Write orchestrates
// its own. And what the steps share: the spare made again, the victims closed over their
// blobs, the bytes moved out of a victim that stays counted dead.

#include "kv/compaction.hpp"

#include <algorithm>
#include <chrono>
#include <climits>

#include "base/futex.hpp"

namespace keel::kv {

std::uint64_t copy_need(const segment_use& u) noexcept {
  if (u.copies == u.forgotten) return 0;
  const std::uint64_t kept = u.live - u.forgettable;
  return kept + 2 * (kept / relocation_batch + 1) * sizeof(disk::block_header) + u.largest;
}

result<compact_stats> store::compact() noexcept {
  if (auto held = impl_->hold_open_byte(); !held) return std::unexpected(held.error());
  return impl_->compact(std::nullopt, nullptr, byte_claim::wait);
}

result<compact_stats> store::impl::compact(std::optional<std::uint64_t> unless_since,
                                           bool* others_ran, byte_claim how) noexcept {
  impl& s = *this;
  if (auto w = s.writable(); !w) return std::unexpected(w.error());
  const io::countdown cd = io::deadline(s.opts.lock_timeout).start();
  // The maintenance byte, for the whole run: one compactor at a time, no verify walking the
  // segments, and no checkpoint (one copied while records move could name originals that
  // are then removed; a fresh one is written once they are). Not a keel::lock entity: its
  // slot would be some bucket pages' too, whose writers would wait for the whole run.
  if (auto b = s.take_checkpoint_byte(cd, how); !b) return std::unexpected(b.error());
  const maintenance_hold held{&s};
  // The size of the segments its copies go to, fixed for the run (see compaction_room).
  struct segment_size_hold {
    impl& s;
    ~segment_size_hold() {
      s.compacting.segment_size.store(0, std::memory_order_relaxed);
      s.compacting.keeps_off_spare.store(false, std::memory_order_relaxed);
    }
  } const sized{s};
  {
    // (No larger than the spare: see next_active_segment.)
    const std::uint64_t spare = s.h64(header::spare).load();
    const std::uint64_t next = s.next_segment_size();
    s.compacting.segment_size.store(spare != 0 ? std::min(next, spare) : next,
                                    std::memory_order_relaxed);
  }
  compaction_run run(s, cd, how);
  // Where the volume may refuse a write fault (btrfs at a qgroup's limit), the header's page
  // first: refused, nothing could move. Its words are stored escapably all the same (the
  // page may be written back and refused again): a store refused past the deadline fails the
  // compaction where one killed there would have stopped (doc/kv-format.md, "Compaction").
  if (auto w = s.index_write_ready(0); !w) return std::unexpected(w.error());
  // Another compaction ran while we waited for the byte: the room it made is the caller's
  // to try first (a crowd of writers finding the volume full runs one compaction, not one
  // each).
  if (unless_since &&
      s.h64(header::compaction_runs).load(std::memory_order_seq_cst) != *unless_since) {
    if (others_ran != nullptr) *others_ran = true;
    return run.st;
  }
  if (!run.stored(
          [&] { s.h64(header::compaction_runs).fetch_add(1, std::memory_order_seq_cst); })) {
    return std::unexpected(s.index_write_refusal());
  }
  // However it ends: writers waiting for a compaction to end (make_room) go on (refused, they
  // find out at their next look, as when a compactor is killed).
  struct ended {
    store::impl* s;
    const io::countdown* cd;
    ~ended() {
      (void)s->stored_escapably(
          *cd, [&] { s->h64(header::compaction_ends).fetch_add(1, std::memory_order_seq_cst); });
      base::futex_wake(s->futex_word(header::compaction_ends), INT_MAX, base::futex_scope::shared);
    }
  } const end{&s, &cd};

  if (auto r = run.find_candidates(); !r) return std::unexpected(r.error());
  if (auto r = run.count_live(); !r) return std::unexpected(r.error());
  run.find_forgettable();
  if (auto r = run.choose_victims(); !r) return std::unexpected(r.error());
  if (run.victims.empty()) return run.end_without_victims();
  if (auto r = run.move_live(); !r) return std::unexpected(r.error());
  if (run.victims.empty() && run.stopped) return std::unexpected(*run.stopped);
  if (auto r = run.keep_named_victims(); !r) return std::unexpected(r.error());
  if (run.victims.empty()) return run.end_without_victims();
  if (auto r = run.wait_for_readers(); !r) return std::unexpected(r.error());
  if (auto r = run.remove_victims(); !r) return std::unexpected(r.error());
  return run.st;
}

// ---- shared by the steps ----

result<void> compaction_run::wait_for_transactions() noexcept {
  // Holding the byte, a background run waits for open transactions only a moment: a reader
  // that keeps one open (idle, or for long) would keep asked-for checkpoints, compactions and
  // verifies waiting, and this process's close, for the whole lock timeout.
  if (how != byte_claim::background) return s.wait_for_transactions(cd);
  return s.wait_for_transactions(
      io::deadline(std::min<std::chrono::milliseconds>(
                       s.opts.lock_timeout, store::impl::process_compaction::background_patience))
          .start());
}

// The spare, when it is not there (taken by a pass before, or by one killed before it made
// it again), made now at the size it must be: a pass ends with a spare whenever the volume
// has the room. btrfs shows the room an unlink frees once its transaction commits. Should
// another program take the room first, the next writer that needs a segment tries again.
// (Also a spare kept smaller than a log segment: it grows once the volume has the room.)
bool compaction_run::spare_as_it_must_be() noexcept {
  return s.opts.read_only ||
         (s.has_room(spare_room) && s.h64(header::spare).load() >= s.largest_log_segment());
}

result<void> compaction_run::spare_again(bool removed) noexcept {
  if (spare_as_it_must_be()) return {};
  if (auto f = s.fs->statfs(s.dir.dir); removed && f && f->type == io::fs_type::btrfs) {
    if (auto r = s.dir.dir.sync_filesystem(); !r) return r;
  }
  if (auto r = s.ensure_room(spare_room); !r && !out_of_room(r.error())) return r;
  return {};
}

result<compact_stats> compaction_run::end_without_victims() noexcept {
  if (spare_as_it_must_be()) return st;
  auto g = s.locks->lock({lock::entity(entity_segment)}, io::deadline(cd.expiry()));
  if (!g) return std::unexpected(g.error());
  if (auto r = spare_again(false); !r) return std::unexpected(r.error());
  return st;
}

void compaction_run::close_over_blobs() {
  for (bool changed = true; changed;) {
    changed = false;
    for (auto it = victims.begin(); it != victims.end();) {
      const auto& refs = use[*it].blob_refs;
      const bool outside = std::ranges::any_of(
          refs, [&](std::uint64_t r) { return r != *it && !victims.contains(r); });
      if (outside) {
        it = victims.erase(it);
        changed = true;
      } else {
        ++it;
      }
    }
  }
}

result<void> compaction_run::count_moved_of_dropped(
    const std::set<std::uint64_t>& before) noexcept {
  if (!stored([&] {
        for (const std::uint64_t kept : before) {
          const auto moved = moved_from.find(kept);
          if (!victims.contains(kept) && moved != moved_from.end()) {
            s.h64(header::dead_bytes).fetch_add(moved->second);
          }
        }
      })) {
    return std::unexpected(s.index_write_refusal());
  }
  return {};
}

}  // namespace keel::kv
