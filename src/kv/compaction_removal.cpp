// Compaction's removal, steps 6 and 7 of compaction.hpp (doc/kv-format.md, "Compaction"): the
// copies made durable and every reader of an original gone, then the victims off the
// manifest and the segment table, each kept as a room (the spare, the deletes' room, the
// next segment) or given back to the volume.

#include <algorithm>
#include <array>
#include <vector>

#include "kv/compaction.hpp"

namespace keel::kv {

// 6. The copies on disk before any original goes; then nobody may still read an original
// (a snapshot from before the moves, or one walking back to older versions).
result<void> compaction_run::wait_for_readers() noexcept {
  if (compact_moved_hook != nullptr) compact_moved_hook();
  if (auto r = s.group_sync(); !r) return std::unexpected(r.error());
  // A commit that superseded a record before it could move names the original as its
  // previous version: every snapshot from now on must see that commit (so every seq handed
  // out so far is visible first). And every transaction open now must end: it may hold an
  // original's location, or a view into it.
  const std::uint64_t moved_by = s.h64(header::next_seq).load(std::memory_order_seq_cst) - 1;
  // (A store refused past the deadline escapes the wait: it times out.)
  bool visible = false;
  (void)s.stored_escapably(
      cd, [&] { visible = s.wait_visible(moved_by, cd, store::impl::past_deadline::give_up); });
  if (!visible) return errc_error(std::errc::timed_out);
  return wait_for_transactions();
}

// 7. Remove them, under the sync lock (a group sync never meets a half-removed segment).
// The checkpoint goes first, for good: it may name originals (a rebuild without it
// replays the whole log).
result<void> compaction_run::remove_victims() noexcept {
  if (auto r = s.remove_checkpoint(); !r) return r;
  const auto free_before = s.fs->statfs(s.dir.dir);
  rooms_kept kept;
  {
    // With the `segment` lock too, which every change of the manifest holds: the victims
    // go off it first (a segment listed is one that must be there; their copies are synced,
    // so one unlisted and still there is a leftover the next lone opener removes).
    const std::array<lock::entity, 2> both{lock::entity(entity_sync), lock::entity(entity_segment)};
    auto g = s.locks->lock(both, io::deadline(cd.expiry()));
    if (!g) return std::unexpected(g.error());
    // Which rooms to keep: as seg/ has them (see next_active_segment).
    if (auto r = s.reconcile_rooms(); !r) return r;
    if (auto r = s.unlist_segments(victims); !r) return r;
    if (compact_unlisted_hook != nullptr) compact_unlisted_hook();
    const room_picks picks = pick_rooms();
    for (const std::uint64_t n : victims) {
      if (auto r = give_back(n, picks, kept); !r) return r;
    }
    if (auto r = record_kept_rooms(kept); !r) return r;
  }
  s.unmap_removed_segments();
  // Near full, the room must show before the writers that wait for it retry (where other
  // users still map a removed segment it is not free yet on any filesystem: then only
  // btrfs's own delay is worth a sync).
  if (free_before && free_before->type == io::fs_type::btrfs && s.short_of_room()) {
    if (auto r = s.show_freed_room(free_before, st.bytes_freed - kept.room); !r) return r;
  }
  // A checkpoint of the entries as they are now, naming the copies. Its failure (no_space
  // on a nearly full volume, where the copy would take the room just freed) leaves a longer
  // replay after a power loss, nothing wrong: kept for stats.
  s.checkpoint_after_compaction(cd);
  return {};
}

// Which victim becomes which room: the spare the largest; the deletes' room the smallest
// other, no larger than the spare (an erase that takes it makes it a log segment).
compaction_run::room_picks compaction_run::pick_rooms() noexcept {
  room_picks picks;
  const auto victim_size = [&](std::uint64_t n) { return s.segtab(n, 1).load(); };
  std::uint64_t spare_size = s.h64(header::spare).load();
  if (spare_size == 0) {
    for (const std::uint64_t n : victims) {
      const std::uint64_t size = victim_size(n);
      if (s.log_segment_size(size) && (picks.spare == 0 || size > victim_size(picks.spare))) {
        picks.spare = n;
      }
    }
    spare_size = picks.spare == 0 ? 0 : victim_size(picks.spare);
    const std::vector<std::uint64_t> leaving(victims.begin(), victims.end());
    picks.spare_whole = spare_size != 0 && spare_size >= s.largest_log_segment(leaving);
  }
  // A spare kept smaller than that (every victim was) grows below by the room the other
  // victims give back to the volume (none is kept as the next segment; one is as the
  // deletes' room when that was taken: erases after a full pass need room more than the
  // spare needs to grow, and with none kept a quarter of them failed beside another
  // program on the volume). Before, none was kept: all went back for a spare made anew of their
  // room, and another program on the volume that took that room first left the store with no
  // spare, and every erase after failed with no_space (test
  // `KvSharedVolumeGrowing.DeletesWorkWhileAForeignWriterKeepsTheVolumeFull`). A spare
  // that cannot grow stays smaller until the volume has the room: compaction's copies
  // then go to segments no larger (next_active_segment), and take only victims whose
  // records fit them.
  if (!s.has_room(deletes_room) && spare_size != 0) {
    for (const std::uint64_t n : victims) {
      const std::uint64_t size = victim_size(n);
      if (n != picks.spare && s.log_segment_size(size) && size <= spare_size &&
          (picks.deletes == 0 || size < victim_size(picks.deletes))) {
        picks.deletes = n;
      }
    }
  }
  return picks;
}

// Victim `n` out of the segment table, and kept as `picks` says or given back; its dead
// bytes off *dead bytes*.
result<void> compaction_run::give_back(std::uint64_t n, const room_picks& picks,
                                       rooms_kept& kept) noexcept {
  auto seg = s.segment_at(n);
  if (!seg) return std::unexpected(seg.error());
  const std::uint64_t size = (*seg)->size;
  // Its entry, unless another segment holds it (one named but never entered, left by a
  // maker killed in between, shares the entry of a segment 8064 numbers apart).
  std::uint64_t holder = n;
  if (!stored(
          [&] { s.segtab(n, 0).compare_exchange_strong(holder, 0, std::memory_order_seq_cst); })) {
    return std::unexpected(s.index_write_refusal());
  }
  // Compaction took the spare: a victim is the next one. An erase took the deletes'
  // room: another victim is that (both picked above). And one is kept as the next
  // segment, unless one is there: commits that only erase then need no room from the
  // volume, whoever else fills it.
  store::impl::room_kept keep;
  if (n == picks.spare) {
    keep.as = store::impl::room_kept::spare;
  } else if (n == picks.deletes) {
    keep.as = store::impl::room_kept::deletes;
  } else if (kept.next == 0 && s.abandoned_segment() == 0 && picks.spare_whole &&
             (s.has_room(spare_room) || picks.spare != 0)) {
    keep.as = store::impl::room_kept::next;
  }
  auto given = s.give_back_segment(n, size, keep);
  if (!given) return std::unexpected(given.error());
  // (Each kept at the size it has: the victim's.)
  if (given->as == store::impl::room_kept::spare) kept.spare = size;
  if (given->as == store::impl::room_kept::deletes) kept.deletes = size;
  if (given->as == store::impl::room_kept::next) {
    kept.next = given->number;
    kept.next_size = size;
  }
  const std::uint64_t dead = size - disk::segment_header_size > use[n].live
                                 ? size - disk::segment_header_size - use[n].live
                                 : 0;
  const std::uint64_t was = s.h64(header::dead_bytes).load();
  if (!stored([&] { s.h64(header::dead_bytes).fetch_sub(std::min(was, dead)); })) {
    return std::unexpected(s.index_write_refusal());
  }
  kept.freed_dead += std::min(was, dead);
  st.segments_removed += 1;
  st.bytes_freed += size;
  if (given->as != store::impl::room_kept::volume) kept.room += size;
  return {};
}

// The rooms the victims became, named in the header (and the next segment listed and
// entered), the spare made again if none was kept, and the run counted.
result<void> compaction_run::record_kept_rooms(const rooms_kept& kept) noexcept {
  if (auto r = s.dir.segments.sync_all(); !r) return r;
  if (!stored([&] {
        if (kept.spare != 0) s.h64(header::spare).store(kept.spare);
        if (kept.deletes != 0) s.h64(header::deletes_room).store(kept.deletes);
      })) {
    return std::unexpected(s.index_write_refusal());
  }
  if (kept.next != 0) {
    // Listed, then entered, as a segment made: named and not listed, it is the leftover the
    // next writer adopts (adopt_named_leftover).
    if (auto l = s.list_segment(kept.next, kept.next_size); !l) return l;
    if (auto e = s.enter_segment(kept.next, kept.next_size); !e) return e;
  }
  // No victim could be kept as the spare (it was taken, by this pass or one before), or one
  // smaller than a log segment that stays was: it is made, or grown, now, to the size it
  // must be, of the room the victims gave back (a pass that may take the spare frees at
  // least as much), when the volume has it.
  if (auto r = spare_again(true); !r) return r;
  if (!stored([&] {
        s.h64(header::compactions).fetch_add(1, std::memory_order_seq_cst);
        // What was found before no longer holds (*dead bytes* went down by an estimate).
        s.h64(header::fruitless_below).store(0, std::memory_order_seq_cst);
        // And no background compaction before a segment more has died than this one left
        // (what died while it ran counts: a run that fell behind a fast writer is followed
        // by the next).
        s.h64(header::background_after)
            .store(dead_then - std::min(dead_then, kept.freed_dead) + s.next_segment_size());
      })) {
    return std::unexpected(s.index_write_refusal());
  }
  return {};
}

}  // namespace keel::kv
