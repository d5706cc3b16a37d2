// A commit's preparation, before any lock (doc/kv-format.md, "Committing", step 1): its keys
// planned, its size checked against what may be, the ledger charged, its blobs written. See
// commit_run.hpp.

#include <algorithm>

#include "kv/commit_run.hpp"

namespace keel::kv {

result<void> commit_run::plan_keys() noexcept {
  try {
    keys.reserve(t.writes.size() + t.reads.size());
    for (const write_set::write& w : t.writes) {
      key_plan& p = keys.emplace_back();
      p.key = w.key;
      p.h = w.h;
      p.w = &w;
    }
    for (const auto& k : t.reads) {
      const disk::key_hash h = s->hash_of(as_bytes(k));
      if (t.writes.find(k, h) != nullptr) continue;
      key_plan& p = keys.emplace_back();
      p.key = k;
      p.h = h;
    }
    // In the order of their pages (the directory routes a key by its hash's top bits): the
    // steps that follow visit each page's keys together, while it is in the cache (in a
    // transaction of 65 536 puts, each page of the index took some 30 keys, each a miss).
    if (keys.size() > 64) {
      std::sort(keys.begin(), keys.end(),
                [](const key_plan& a, const key_plan& b) { return a.h.hi < b.h.hi; });
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return {};
}

// 1. Room, then blobs, before any lock.
result<void> commit_run::size_up() noexcept {
  const std::uint64_t threshold = s->dir.params.blob_threshold;
  // A commit that only erases may use the segment of room puts leave: deletes work on a
  // volume (or budget) puts have filled.
  only_erases = std::all_of(keys.begin(), keys.end(),
                            [](const key_plan& k) { return k.w == nullptr || k.w->erase; });
  need = sizeof(disk::block_header);
  block = sizeof(disk::block_header);
  own_segments = own_room = puts = 0;
  has_blobs = chose_own = false;
  // The segments made now: a blob larger gets a segment of its own, so that no log segment
  // grows past them for it (a 700 KB blob in a 1 MiB log segment beside 256 KiB ones made
  // the spare 1 MiB, and segments made of the spare after were as large: once another
  // program on the volume took the room a pass gave back, the spare shrank to a 256 KiB
  // victim, the 1 MiB segments could never be copied, and erases failed with no_space).
  const std::uint64_t next_size = s->next_segment_size();
  const std::uint64_t log_room = next_size - disk::segment_header_size;
  // And while segments are still small beside the blobs (they have not grown to their most),
  // a blob of over a quarter of one that the rest of the tail's segment cannot hold (a hint:
  // other writers move the tail) goes into a segment of its own, of its size: in the log it
  // would leave that rest dead. Values of 100-200 KB in a store of 256 KiB segments left
  // 23-45 % of an 8 MiB volume dead, which compaction could not take back (every segment
  // held one live value). (Not once segments are at their most: blobs a segment holds a few
  // of would then each take a segment-table entry, of which a store has 8064.) Nor where the
  // volume or the budget has no room for what a segment of its own is charged (own_room) and
  // a log segment beside: there the log takes it as before (a store's first blob under the
  // least budget was refused). A store with no log segment yet makes one that holds it.
  // (Only for such a blob: a commit without one, the common put, reads nothing more here.)
  const auto tail_rest = [&]() -> std::uint64_t {
    const std::uint64_t tail = s->h64(header::tail).load(std::memory_order_relaxed);
    if (tail == 0) return log_room;
    if (s->puts_keep_off(tail)) return 0;
    return s->log_segment_size_at(tail) - disk::offset_of(tail);
  };
  const bool still_small = next_size < s->dir.params.segment_size;
  const auto own_room_for = [&](std::uint64_t len) {
    return ((disk::segment_header_size + len + next_size - 1) / next_size + 1) * log_room;
  };
  // (Beside what the commit is charged so far: each blob's check on its own let a commit of
  // three 70 KB blobs be charged more than was left, and refused where the log held them.)
  const auto saves_room = [&](std::uint64_t len) {
    return !blobs_in_log && still_small && len > log_room / 4 && len > tail_rest() &&
           s->could_put(2 * (need - own_segments) + own_room + own_room_for(len) + next_size);
  };
  for (key_plan& k : keys) {
    if (k.w == nullptr) continue;
    disk::record_in r;
    r.key = as_bytes(k.key);
    if (k.w->erase) {
      r.what = disk::op::erase;
    } else if (k.w->value.size() >= threshold) {
      r.what = disk::op::put_blob;
      const std::uint64_t len = disk::blob_block_size(k.w->value.size());
      k.own_segment = len > log_room;
      if (!k.own_segment && saves_room(len)) k.own_segment = chose_own = true;
      if (k.own_segment) {
        own_segments += len;
        own_room += own_room_for(len);
      }
      need += len;
      has_blobs = true;
    } else {
      r.value = as_bytes(k.w->value);
    }
    puts += k.w->erase ? 0 : 1;
    need += disk::record_size(r);
    block += disk::record_size(r);
  }
  // A block never spans two segments: one that cannot fit a segment is too large whatever
  // room is left (before any check of the room, which would call it no_space near full).
  if (block > s->dir.params.segment_size - disk::segment_header_size) {
    return keel_error(errc::too_large);
  }
  // Under a budget, a commit whose blobs and block cannot all fit in the room left is
  // refused before its blobs are written: written, they would be space no commit uses (and a
  // blob segment of its own could not even be compacted while the store is full). Writers
  // racing for the same room can still leave such space; compaction takes it.
  if (s->opts.max_bytes != 0 && has_blobs && need > s->room_left(room_for::put)) {
    return keel_error(errc::budget_reached);
  }
  return {};
}

void ledger_hold::done() noexcept {
  if (s == nullptr) return;
  // (The pin and the balance are in the index: a page the volume refuses past the
  // deadline leaves them as a writer killed here would, its slot given up.)
  const bool left = s->stored_escapably(*cd, [&] {
    if (used) {
      s->ledger->leave(who);
    } else {
      (void)s->ledger->refund(who, c);
    }
  });
  if (!left) s->forsake_slot(*lease);
  s = nullptr;
}

// The ledger: a commit that puts is charged its worst case before anything of it is
// written. Its block and each blob may leave up to their own length unused at the end of a
// segment they do not fit (a blob in a segment of its own: that segment, see own_room);
// each new key may split a page in two.
result<void> commit_run::charge() noexcept {
  if (only_erases || !s->opts.ledger || s->opts.read_only) return {};
  // (The directory's next doubling is held back from every delta's room once, in
  // room_for_puts: charged to each commit, it made a 1 KiB put cost 40 KiB at 100 000
  // keys, and a thousand writers closed deltas ten times as often, each close waiting for
  // the commits of the one before.)
  const std::uint64_t index_pages = 2 * puts;
  const std::uint64_t cost = 2 * (need - own_segments) + own_room + index_pages * disk::page_size;
  commit_step_reached(commit_step::charging);
  auto c =
      s->charge(t.lease, static_cast<std::int64_t>(std::min<std::uint64_t>(cost, INT64_MAX)), cd);
  if (!c) return std::unexpected(c.error());
  charged.c = *c;
  charged.who = t.lease.index;
  charged.lease = &t.lease;
  charged.cd = &cd;
  charged.s = s;  // last: a hold with no store does nothing
  commit_step_reached(commit_step::charged);
  return {};
}

// Each value of at least the blob threshold in a block of its own, ahead of the commit's.
result<void> commit_run::write_blobs() noexcept {
  const std::uint64_t threshold = s->dir.params.blob_threshold;
  for (key_plan& k : keys) {
    if (k.w == nullptr || k.w->erase || k.w->value.size() < threshold) continue;
    const auto value = as_bytes(k.w->value);
    const std::uint64_t len = disk::blob_block_size(value.size());
    std::uint64_t at = 0;
    if (!k.own_segment) {
      auto r = s->reserve(len);
      if (!r) return std::unexpected(r.error());
      at = *r;
    } else {
      // Larger than a segment, or than the tail's rest while segments are small (size_up):
      // a segment of its own, never a log segment's size (a page more if it would be one:
      // the log's tail is never placed in it).
      auto g = s->locks->lock({lock::entity(entity_segment)}, io::deadline(cd.expiry()));
      if (!g) return std::unexpected(g.error());
      std::uint64_t size = disk::segment_header_size + len;
      if (s->log_segment_size(size)) size += disk::page_size;
      // The rooms as seg/ has them (see next_active_segment).
      if (auto r = s->reconcile_rooms(); !r) return std::unexpected(r.error());
      // (Its last page is allocated whole: counted so under a budget.)
      const std::uint64_t pages = (size + disk::page_size - 1) / disk::page_size * disk::page_size;
      if (auto r = s->ready_for_put(pages, true); !r) return std::unexpected(r.error());
      auto n = s->make_segment(size);
      if (!n) return std::unexpected(n.error());
      at = disk::make_location(*n, disk::segment_header_size);
    }
    charged.used = true;
    if (auto w = s->segment_write_ready(at, len); !w) return std::unexpected(w.error());
    auto bytes_there = s->bytes_at(at);
    if (!bytes_there) return std::unexpected(bytes_there.error());
    // (Its pages written back and refused again before the copy ends, past the deadline: the
    // blob is dead space, as a writer's killed here.)
    std::uint64_t sum = 0;
    if (auto w = s->store_or_refuse([&] {
          sum = s->write_dirty(
              at, [&] { return disk::encode_blob_block(bytes_there->first(len), value, s->salt); });
        });
        !w) {
      return std::unexpected(w.error());
    }
    k.blob = {at, sum};
  }
  return {};
}

}  // namespace keel::kv
