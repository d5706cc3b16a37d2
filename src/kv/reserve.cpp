// Where a block goes (doc/kv-format.md, "Committing", "Segments"): room reserved at the tail,
// the next segment made (or a room taken) when the tail's segment is full, for a put, an
// erase or compaction in turn. Moves *tail* (a rebuild sets it, in recovery.cpp) and writes
// *deletes segment* (so does an opener alone, in open.cpp).

#include <algorithm>
#include <thread>

#include "kv/store_impl.hpp"

namespace keel::kv {

result<std::uint64_t> store::impl::next_active_segment(room_for who,
                                                       std::uint64_t at_least) noexcept {
  std::uint64_t seg_size = next_segment_size(at_least);
  const std::uint64_t fixed = compacting.segment_size.load(std::memory_order_relaxed);
  if (who == room_for::compaction && fixed != 0) {
    // Compaction's at the size its room was counted in (its copies grow the log meanwhile).
    seg_size = std::max(fixed, least_segment_size(at_least));
  }
  if (who == room_for::compaction) {
    // Never larger than the spare while it is there (each copy is a record of a segment no
    // larger than the spare, so it fits).
    if (const std::uint64_t spare = h64(header::spare).load(); spare != 0) {
      seg_size = std::min(seg_size, spare);
    }
  }
  // The rooms' words as seg/ has them: a taker killed after its rename left its room's word
  // set, which counted the room twice (beside the segment made of it) against a budget, and
  // kept compaction from keeping a segment as that room again. Rooms change only under the
  // `segment` lock, held here.
  if (auto r = reconcile_rooms(); !r) return std::unexpected(r.error());
  if (auto a = adopt_named_leftover(); !a) return std::unexpected(a.error());
  // The last segment made, if the tail never moved into it (its maker, or the taker of the
  // spare, was killed, or failed, in between): nothing was written there, so it is the next
  // one, whoever asks (else, on a full volume, it would hold its room for good). A blob
  // segment is larger than a log segment, and never the tail.
  const std::uint64_t last = abandoned_segment();
  const bool abandoned = last != 0;
  if (who != room_for::compaction) {
    // The spare first, as large as the segment needs (a log segment is never larger than
    // the spare: compaction copies any one into it); a segment made while the spare cannot
    // grow is made at the spare's size, which holds `at_least`.
    if (who != room_for::put) {
      if (auto b = check_budget(0, who); !b) return std::unexpected(b.error());
      // (A commit that only erases needs the spare there, whatever its size.)
      if (auto r = ensure_room(spare_room, 0, room_need::there); !r) {
        return std::unexpected(r.error());
      }
    }
    auto spare_ready = ensure_room(spare_room, abandoned ? 0 : at_least);
    if (!spare_ready && (who == room_for::put || !out_of_room(spare_ready.error()))) {
      return std::unexpected(spare_ready.error());
    }
    if (const std::uint64_t spare = h64(header::spare).load(); spare != 0) {
      seg_size = std::min(seg_size, spare);
    }
    // Near full, a put makes a smaller segment where the volume or the budget no longer has
    // one of this size (down to what its block needs): the store fills the volume.
    if (who == room_for::put && !abandoned) {
      while (seg_size > least_segment_size(at_least) && !could_put(seg_size))
        seg_size /= 2;
    }
    const std::uint64_t more = abandoned ? 0 : seg_size;
    const auto next = [&]() -> result<std::uint64_t> {
      if (abandoned) return last;
      // (An erase whose segment the spare could not grow for: the deletes' room, below.)
      if (!spare_ready) return std::unexpected(spare_ready.error());
      return make_segment(seg_size);
    };
    if (who == room_for::put) {
      if (auto r = ready_for_put(more); !r) return std::unexpected(r.error());
      return mark_for_deletes(next(), false);
    }
    // A commit that only erases: a new segment while the budget and the volume allow one
    // (the deletes' room stays for later), else the deletes' room, which no other program
    // can have taken.
    const bool for_deletes = !could_put(more);
    const auto budget = check_budget(more, who);
    auto n = budget ? next() : std::unexpected(budget.error());
    if (n || !out_of_room(n.error())) return mark_for_deletes(n, for_deletes);
    // A block the room cannot hold is refused before it takes it (taken, the room would be
    // spent and the block still without a place): such a commit must be split.
    if (auto st = fs->stat_at(&dir.segments, deletes_room.name, false);
        st && log_segment_size(st->size) && st->size < at_least) {
      return std::unexpected(
          error(make_error_code(errc::too_large)).about(path + "/seg/" + deletes_room.name));
    }
    auto a = adopt_room(deletes_room);
    if (a) return mark_for_deletes(a, true);
    if (a.error() != std::errc::no_space_on_device) return a;
    return n;
  }
  if (abandoned) return mark_for_deletes(last, !could_put(0));
  // A new segment while the budget and the volume allow one (the spare stays for later);
  // else the spare.
  error why{make_error_code(errc::budget_reached)};
  if (check_budget(seg_size, room_for::compaction)) {
    const bool for_deletes = !could_put(seg_size);
    auto n = make_segment(seg_size);
    if (n) return mark_for_deletes(n, for_deletes);
    if (n.error() != std::errc::no_space_on_device &&
        n.error() != std::error_code(EDQUOT, std::system_category())) {
      return n;
    }
    why = n.error();
  }
  // Puts could never have taken the spare. Nor may a pass that frees less than the spare's
  // size (the spare could not be made again of its room): it stops where its room ran out.
  if (compacting.keeps_off_spare.load(std::memory_order_relaxed)) return std::unexpected(why);
  auto a = adopt_room(spare_room);
  if (a) return mark_for_deletes(a, true);
  if (a.error() != std::errc::no_space_on_device) return a;
  return std::unexpected(why);
}

result<void> store::impl::ready_for_put(std::uint64_t more, bool blob) noexcept {
  const std::uint64_t need = put_needs(more, blob);
  if (auto b = check_budget(need, room_for::put); !b) return b;
  if (auto r = ensure_room(spare_room); !r) return r;
  if (auto r = ensure_room(deletes_room); !r) return r;
  return check_headroom(need);
}

result<std::uint64_t> store::impl::mark_for_deletes(result<std::uint64_t> made,
                                                    bool for_deletes) noexcept {
  // A segment a put could not have made is made of the room kept for deletes, whoever made
  // it: puts leave it to erases and compaction (see reserve).
  if (made) {
    if (auto w =
            store_or_refuse([&] { h64(header::deletes_segment).store(for_deletes ? *made : 0); });
        !w) {
      return std::unexpected(w.error());
    }
  }
  return made;
}

result<std::uint64_t> store::impl::reserve(std::uint64_t length, room_for who) noexcept {
  auto r = reserve_fitting(std::span(&length, 1), who);
  if (!r) return std::unexpected(r.error());
  return r->at;
}

result<store::impl::reserved> store::impl::reserve_fitting(std::span<const std::uint64_t> lengths,
                                                           room_for who) noexcept {
  if (lengths.empty() || lengths.front() > dir.params.segment_size - disk::segment_header_size) {
    return keel_error(errc::too_large);
  }
  auto& tail = *reinterpret_cast<std::uint64_t*>(base() + header::tail);
  std::atomic_ref<std::uint64_t> t(tail);
  for (;;) {
    std::uint64_t at = t.load(std::memory_order_acquire);
    if (who != room_for::compaction && h64(header::spare).load(std::memory_order_acquire) == 0) {
      // Compaction took the spare (it cleared the word before it moved the tail into it, so
      // a tail loaded here that is in the taken spare comes with the word at 0): what is
      // left of it is compaction's, until a new spare can be made.
      auto g = locks->lock({lock::entity(entity_segment)}, opts.lock_timeout);
      if (!g) return std::unexpected(g.error());
      if (h64(header::spare).load() == 0) {
        // A put goes on only with the room for deletes left beside the new spare; an erase
        // needs the spare alone.
        const auto ready = [&]() -> result<void> {
          if (who == room_for::put) return ready_for_put(0);
          if (auto b = check_budget(0, who); !b) return b;
          return ensure_room(spare_room, 0, room_need::there);
        };
        if (auto r = ready(); !r) return std::unexpected(r.error());
      }
      continue;
    }
    // The segment made of the room kept for deletes is theirs (and compaction's) while that
    // room is not there again: a put waits for a segment of its own, which needs that room
    // again. Once it is (a compaction kept a victim as it), the segment is any log segment:
    // a put that left its rest behind abandoned all but the erases in it (under a 2 MiB
    // budget, half the room a store erased whole and compacted gave back).
    const bool theirs = who == room_for::put && puts_keep_off(at);
    // (The tail's segment is in the table before the tail moves into it.)
    const std::uint64_t seg_size = at == 0 ? 0 : log_segment_size_at(at);
    // The longest of `lengths` that fits the rest of the active segment.
    std::size_t fits = 0;
    while (at != 0 && fits < lengths.size() && disk::offset_of(at) + lengths[fits] <= seg_size) {
      ++fits;
    }
    if (!theirs && fits != 0) {
      const std::uint64_t length = lengths[fits - 1];
      // (The tail is the header's: written back and refused, an escape past lock_timeout
      // fails the reserve before anything was taken.)
      bool took = false;
      if (auto w = store_or_refuse(
              [&] { took = t.compare_exchange_weak(at, at + length, std::memory_order_acq_rel); });
          !w) {
        return std::unexpected(w.error());
      }
      if (!took) continue;
      // Crossing into the next chunk: the one after it is faulted in now, by the supplier's
      // thread, so that writers never take page faults on fresh pages (nor wait for each
      // other's, on the same page), nor pay for their zeroing.
      const std::uint64_t off = disk::offset_of(at);
      if (off / prefault_chunk != (off + length) / prefault_chunk) {
        supply_ahead(disk::make_location(disk::segment_of(at),
                                         ((off + length) / prefault_chunk + 1) * prefault_chunk));
      }
      return reserved{at, fits};
    }
    // The active segment is full (or there is none yet): make the next one, once.
    auto g = locks->lock({lock::entity(entity_segment)}, opts.lock_timeout);
    if (!g) return std::unexpected(g.error());
    if (t.load(std::memory_order_acquire) != at) continue;
    auto n = next_active_segment(who, disk::segment_header_size + lengths.front());
    if (!n) return std::unexpected(n.error());
    prefault(*n, 0);
    prefault(*n, prefault_chunk);
    // (Refused past lock_timeout: the segment made and never moved into is the abandoned
    // one the next writer takes, as when its maker is killed here.)
    if (auto w = store_or_refuse([&] {
          if (at != 0) {
            // What is left at the end of the old one is dead space.
            h64(header::dead_bytes).fetch_add(seg_size - disk::offset_of(at));
          }
          t.store(disk::make_location(*n, disk::segment_header_size), std::memory_order_release);
        });
        !w) {
      return std::unexpected(w.error());
    }
  }
}

}  // namespace keel::kv
