// Compaction's choice of victims, step 4 of compaction.hpp (doc/kv-format.md, "Compaction"):
// which candidates go, and how many the room left lets go.

#include <algorithm>
#include <vector>

#include "kv/compaction.hpp"

namespace keel::kv {

// 4. Victims: at most half live, not pinned, and whose blobs only victims' records use
// (removing one may disqualify another: to a fixed point). When a put would find no room,
// any with a sixteenth dead: the spare holds a whole victim's copies, and freeing a little
// beats staying full (deletes spread thinly over every segment leave none half dead).
result<void> compaction_run::choose_victims() noexcept {
  try {
    if (auto e = take_eligible(); !e) return e;
    close_over_blobs();
    fit_victims_to_room();
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return {};
}

// Every candidate that may go by what is live in it.
result<void> compaction_run::take_eligible() {
  const bool short_now = s.short_of_room();
  // The fewest bytes that must die before a segment left here could be taken short of
  // room (its copies must take less than it).
  std::uint64_t closest = UINT64_MAX;
  bool pinned = false;
  for (const std::uint64_t n : candidates) {
    segment_use& u = use[n];
    if (u.pinned) {
      pinned = true;
      continue;
    }
    auto seg = s.segment_at(n);
    if (!seg) return std::unexpected(seg.error());
    const std::uint64_t size = u.size = (*seg)->size;
    const std::uint64_t kept = u.live - u.forgettable;
    // Short of room, any segment whose copies take less than it by a sixty-fourth (the
    // room its records' headers and dead ones hold is more than the copies' block headers
    // and the slack where they cross into a new segment; with no margin, passes whose
    // copies barely fit ran out beside a program filling the volume, under load, and left
    // no spare). A sixteenth dead was asked before: erases
    // spread over a large store (512 MiB, 1 KiB values) left none so once the deletes'
    // room was spent, and every erase after failed with no_space.
    const std::uint64_t room = size - disk::segment_header_size;
    const std::uint64_t need = copy_need(u);
    if (short_now ? need + room / 64 < room : kept * 2 <= size) {
      victims.insert(n);
    } else if (short_now) {
      closest = std::min(closest, need + room / 64 + 1 - room);
    }
  }
  // Short of room with nothing to take (and no pending commit's segment, whose pin goes
  // without a byte dying): a put that finds no room need not walk the index again until
  // that many bytes have died, or a segment has been sealed since (unlike the ones here,
  // its records' block headers were not counted). Each byte that dies since adds to *dead
  // bytes* and takes at most one segment that much closer.
  if (short_now && victims.empty() && !pinned) {
    const std::uint64_t at = closest == UINT64_MAX ? s.next_segment_size() : closest;
    auto below = s.h64(header::fruitless_below);
    if (!stored([&] {
          below.store(0, std::memory_order_seq_cst);
          s.h64(header::fruitless_tail_segment).store(active, std::memory_order_seq_cst);
          below.store(std::max<std::uint64_t>(1, dead_then + at), std::memory_order_seq_cst);
        })) {
      return std::unexpected(s.index_write_refusal());
    }
  }
  return {};
}

// The copies must fit in the room left: the rest of the tail's segment, the spare, and
// the whole segments the budget (options::max_bytes) and the volume still allow. The
// least live first; the victims are removed only at the end, so a pass that took more
// would fail with nothing freed, and a full store would stay full for good. Each pass
// frees more than it copies (a victim that would need its whole size is left): compacting
// again goes on.
void compaction_run::fit_victims_to_room() {
  std::vector<std::uint64_t> by_live(victims.begin(), victims.end());
  // The most room freed first (and of two that free as much, the larger): its segment's
  // size less what its copies take.
  const auto gain = [&](std::uint64_t n) {
    const std::uint64_t need = copy_need(use[n]);
    return use[n].size > need ? use[n].size - need : 0;
  };
  std::ranges::sort(by_live, [&](std::uint64_t a, std::uint64_t b) {
    return gain(a) != gain(b) ? gain(a) > gain(b) : use[a].size > use[b].size;
  });
  const std::uint64_t room_all = s.compaction_room();
  const std::uint64_t spare = s.h64(header::spare).load();
  const std::uint64_t in_spare = spare == 0 ? 0 : spare - disk::segment_header_size;
  const std::uint64_t copy_block_room =
      s.compacting.segment_size.load(std::memory_order_relaxed) - disk::segment_header_size;
  // Whether a victim may go at all: it frees more than it takes, fits the spare alone (a
  // segment but its header), and its records fit the segments the copies go to, no larger
  // than the spare, which is smaller than some log segments after a pass found only
  // smaller victims.
  const auto may_go = [&](std::uint64_t n) {
    const segment_use& u = use[n];
    return (u.copies == u.forgotten || copy_need(u) <= u.size - disk::segment_header_size) &&
           u.largest_record <= copy_block_room;
  };
  // Victims in turn while their copies fit `room`, `first` (when not 0) before the others.
  // Returns the copies' bytes.
  const auto pick = [&](std::uint64_t room, std::uint64_t first = 0) {
    std::uint64_t copied = 0;
    victims.clear();
    const auto take = [&](std::uint64_t n) {
      const std::uint64_t need = copy_need(use[n]);
      if (need > room || !may_go(n)) return;  // a smaller one may still fit
      room -= need;
      copied += need;
      victims.insert(n);
    };
    if (first != 0) take(first);
    for (const std::uint64_t n : by_live) {
      if (n != first) take(n);
    }
    close_over_blobs();
    return copied;
  };
  std::uint64_t copied = pick(room_all);
  // A pass whose copies take the spare keeps a victim as large as the spare, where one
  // may go, as the next: a pass that freed smaller ones kept the spare smaller than the
  // segments that stayed, no pass could take those after, and erases failed with no_space
  // while they held 32 MB dead (512 MiB, 1 KiB values erased in random order). Not one
  // that holds a blob: a mostly live blob's segment, the only one as large as the spare,
  // copied to keep the spare whole beside a program that filled the volume, left no
  // spare at all under load (a third of the runs of
  // `KvSharedVolumeGrowing.DeletesWorkBesideALiveBlobWhileAForeignWriterKeepsTheVolumeFull`).
  const auto takes_spare = [&] { return copied > room_all - std::min(room_all, in_spare); };
  if (spare != 0 && takes_spare() &&
      std::ranges::none_of(victims, [&](std::uint64_t n) { return use[n].size >= spare; })) {
    for (const std::uint64_t n : by_live) {
      if (use[n].size >= spare && s.log_segment_size(use[n].size) && use[n].blob_refs.empty() &&
          copy_need(use[n]) <= room_all && may_go(n)) {
        copied = pick(room_all, n);
        break;
      }
    }
  }
  // A pass whose copies may take the spare frees at least as much as the spare: it becomes
  // a segment, and the spare must then be made again, as large as it was (no segment is
  // larger), of the victims' room. With segments that grow, victims can be smaller than
  // the spare; a pass that took a 1 MiB spare to free one 256 KiB segment left no room
  // for a new one, and every erase after failed. Else the copies keep off the spare.
  const auto freed = [&] {
    std::uint64_t f = 0;
    for (const std::uint64_t n : victims)
      f += use[n].size;
    return f;
  };
  // Unless a victim is a log segment: the largest is kept as the spare in place, whatever
  // its size (smaller, the spare stays so until the volume has the room to grow it). A
  // mostly live blob's 1 MiB segment made the spare 1 MiB beside 256 KiB segments: no pass
  // could free as much, none took the spare, and every erase after the deletes' room
  // failed with no_space while whole segments were dead (test
  // `KvSharedVolumeGrowing.DeletesWorkBesideALiveBlobWhileAForeignWriterKeepsTheVolumeFull`).
  const auto keeps_off_spare = [&] {
    return spare != 0 && freed() < spare && std::ranges::none_of(victims, [&](std::uint64_t n) {
             return s.log_segment_size(use[n].size);
           });
  };
  if (takes_spare() && keeps_off_spare()) {
    pick(room_all - std::min(room_all, in_spare));
  }
  // The room counted is an estimate (the copies may cross into a new segment elsewhere
  // than counted, and other writers use the room meanwhile): the copies of a pass that
  // frees less than the spare never take it, whatever they find (next_active_segment).
  s.compacting.keeps_off_spare.store(keeps_off_spare(), std::memory_order_relaxed);
}

}  // namespace keel::kv
