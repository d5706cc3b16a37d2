// Compaction's survey, steps 1 to 3 of compaction.hpp (doc/kv-format.md, "Compaction"): the
// candidates, once every writer that might still write into one has ended; what is live in
// each, from every entry of the index; and the erased keys whose erase record is their last.

#include <algorithm>

#include "kv/compaction.hpp"

namespace keel::kv {

// 1. Candidates: every segment but the one the tail is in. Writers that might still be
// writing into one began before now; wait for them to finish. Once they have, every
// snapshot is at or above `horizon` (visible only grows).
result<void> compaction_run::find_candidates() noexcept {
  horizon = s.h64(header::visible).load(std::memory_order_seq_cst);
  // A segment numbered from here on may be made by a transaction the wait below does not
  // wait for (one begun after it started): never a candidate.
  numbered_before = s.h64(header::next_segment).load(std::memory_order_seq_cst);
  // Every block below it was reserved by a transaction open now, or one that has ended.
  tail_then = s.h64(header::tail).load(std::memory_order_acquire);
  active = disk::segment_of(tail_then);
  // Every commit visible now added the bytes it made dead before it became visible, and the
  // walk below sees its entries: the dead still to come is what has been added since.
  dead_then = s.h64(header::dead_bytes).load(std::memory_order_seq_cst);
  auto listing = s.segment_numbers(false);
  if (!listing) return std::unexpected(listing.error());
  numbers = std::move(*listing);
  return wait_for_transactions();
}

// 2. What is live where: every entry of the index (as of one directory word: a split
// copies entries, never moves them, and the pages it retires are not reused while our
// snapshot is held, so every record live now is named by the pages that word reaches;
// records committed from now on live in newer segments, as do their blobs).
result<void> compaction_run::count_live() noexcept {
  try {
    if (auto c = choose_candidates(); !c) return c;
    // Let go at the end of this step: step 6 waits for every snapshot held.
    auto walking = snapshot_hold::take(s, slot_use::writing);
    if (!walking) return std::unexpected(walking.error());
    auto counted = s.table->for_each_page(0, [&](std::uint64_t page) -> result<bool> {
      if (auto c = count_page(page); !c) return std::unexpected(c.error());
      return true;
    });
    if (!counted) return std::unexpected(counted.error());
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return {};
}

result<void> compaction_run::choose_candidates() {
  // Below the tail's segment: a segment made and named, but not yet the tail's, is about
  // to be written. Above it, a blob's segment of its own (never a log segment's size), numbered
  // before step 1, so by a transaction open then (waited for) or one that has ended: an
  // overwritten or interrupted large value dies there, and was never reclaimed while the
  // tail stayed below it. The highest the manifest lists too (a large value erased last
  // once stayed whole, "removed 0 segments"): the manifest's change that takes it off says
  // its number was handed out (numbered below), and a rebuild numbers new segments from
  // there, never with a removed number (an old commit's dead blob location would point into
  // a stranger's bytes, and its commit read as torn). The manifest is read after the
  // listing: what it lists then is named in seg/.
  auto listed = s.listed_segments();
  if (!listed) return std::unexpected(listed.error());
  std::set<std::uint64_t> in_manifest;
  for (const disk::manifest_entry& e : *listed)
    in_manifest.insert(e.number);
  for (const std::uint64_t n : numbers) {
    if (n < active) {
      candidates.insert(n);
    } else if (n > active && n < numbered_before && in_manifest.contains(n) &&
               s.segtab(n, 0).load() == n && !s.log_segment_size(s.segtab(n, 1).load())) {
      candidates.insert(n);
    }
  }
  return {};
}

// Pins the segment of a block (or record) and of every blob it names, wherever the block
// or record lies: a blob may be in a candidate segment while the block naming it went
// into the next one, the tail's. A record an entry names is whole. A block in a candidate
// is a dead writer's (the live were waited for); one above may be a live writer's, being
// written now: it is read only once sealed (its seq word, acquire), and one not sealed
// names no blob below the tail that can count (a live writer's blobs were reserved after
// step 1, at or above it; a dead writer's unsealed block is abandoned, never made).
result<void> compaction_run::pin(std::uint64_t at, bool block) {
  use[disk::segment_of(at)].pinned = true;
  const auto pin_blob = [&](const disk::record_view& r) {
    if (disk::is_blob(r)) use[disk::segment_of(r.blob.location)].pinned = true;
  };
  if (!block) {
    auto r = s.record_head_at(at);  // as a settled entry's: damage past its head is not
                                    // the walk's to judge
    if (!r) return std::unexpected(r.error());
    pin_blob(r->rec);
    return {};
  }
  auto bytes = s.bytes_at(at);
  if (!bytes) return std::unexpected(bytes.error());
  if (!candidates.contains(disk::segment_of(at))) {
    const std::uint64_t sealed = disk::block_seq(*bytes);
    if (sealed == 0 || sealed == disk::void_seq) return {};
  }
  // A block that does not check out (torn, or abandoned) is never made: its blobs are
  // dead.
  auto head = disk::check_block(*bytes, s.salt);
  if (!head) return {};
  std::uint64_t r = sizeof(disk::block_header);
  for (std::uint32_t i = 0; i < head->records; ++i) {
    auto rec = disk::parse_record(bytes->subspan(r, head->length - r), s.salt, false);
    if (!rec) return {};
    pin_blob(*rec);
    r += rec->size;
  }
  return {};
}

// The entries of one bucket page, counted.
result<void> compaction_run::count_page(std::uint64_t page) {
  const index::bucket_ref b = s.table->page(page);
  // The page's records lie at random in the log, each a cache miss (and on a big store a
  // TLB miss): ask for all their first lines before reading any, so that the misses
  // overlap (at a gigabyte: 0.31 s a walk reading one record at a time, 0.13 s so; asking
  // a page ahead gained nothing more: the asks themselves wait for the TLB).
  b.for_each_key([&](std::size_t, const index::entry_ref&, const index::entry_ref::state& e) {
    if (e.location == 0) return true;
    if (auto bytes = s.bytes_at(e.location)) __builtin_prefetch(bytes->data());
    return true;
  });
  result<void> counted;
  b.for_each_key([&](std::size_t, const index::entry_ref&, const index::entry_ref::state& e) {
    counted = count_entry(e.seq, e.location);
    return static_cast<bool>(counted);
  });
  return counted;
}

// One entry of a bucket page, counted: its record's bytes to its segment's live ones, and
// its blob's to the blob's segment; an erase the horizon passed noted to be forgotten.
result<void> compaction_run::count_entry(std::uint64_t seq, std::uint64_t at) {
  if ((seq & index::pending) != 0) {
    // A dead writer's commit, settled later either way: its block, the record it would
    // restore, and the blobs of both must stay.
    if (auto p = pin(seq & ~index::pending, true); !p) return std::unexpected(p.error());
    if (at != 0) {
      if (auto p = pin(at, false); !p) return std::unexpected(p.error());
    }
    return {};
  }
  if (at == 0) return {};
  auto rec = s.record_head_at(at);
  if (!rec) return std::unexpected(rec.error());
  if (rec->rec.head.op == static_cast<std::uint8_t>(disk::op::erase) &&
      rec->rec.head.seq <= horizon && candidates.contains(disk::segment_of(at))) {
    erasures.push_back(
        {std::string(reinterpret_cast<const char*>(rec->rec.key.data()), rec->rec.key.size()),
         disk::segment_of(at)});
    erasure_sizes.push_back(rec->rec.size);
  }
  auto& here = use[disk::segment_of(at)];
  here.live += rec->rec.size;
  here.copies += 1;
  const std::uint64_t block = rec->rec.size + sizeof(disk::block_header);
  here.largest = std::max(here.largest, block);
  here.largest_record = std::max(here.largest_record, block);
  if (disk::is_blob(rec->rec)) {
    auto& u = use[disk::segment_of(rec->rec.blob.location)];
    const std::uint64_t blob = disk::blob_block_size(rec->rec.head.value_length);
    u.live += blob;
    u.copies += 1;
    u.largest = std::max(u.largest, blob);
    u.blob_refs.insert(disk::segment_of(at));
  }
  return {};
}

// 3. Erased keys to forget: those whose erase record is the only record of the key left in
// any segment (counted by key: a key sharing its hash does not count). The erase record
// itself is what keeps a replay of the whole log from bringing an older version back: it
// may go only with the last of them. Its entry is emptied before its segment is removed,
// and if the compaction stops in between, the erase record alone still says the key is
// gone. Counted before the victims are chosen: a segment of such records frees all of
// them and copies nothing (a store whose keys were all erased must be able to empty).
void compaction_run::find_forgettable() noexcept {
  try {
    std::map<std::string, std::uint64_t, std::less<>> records_of;
    for (const auto& [key, n] : erasures) {
      records_of[key] = 0;
    }
    // Up to where the tail was at step 1 (the blocks below it are whole: their writers have
    // ended). What lies beyond was written since: new versions of keys an erase no snapshot
    // sees past, which step 4 finds in their entries, and never an older version (copies
    // are only ever made by compactions, which ran before this one).
    bool known = true;
    for (const std::uint64_t n : numbers) {
      if (records_of.empty() || n > active) break;
      auto seg = s.segment_at(n);
      if (!seg) {
        known = false;  // cannot tell: forget nothing
        break;
      }
      const auto bytes = (*seg)->bytes();
      (void)s.for_each_block_below(
          **seg, n == active ? disk::offset_of(tail_then) : UINT64_MAX,
          [&](std::uint64_t off, const disk::block_header& head) -> result<void> {
            if (head.kind != static_cast<std::uint16_t>(disk::block_kind::commit) &&
                head.kind != static_cast<std::uint16_t>(disk::block_kind::relocation)) {
              return {};
            }
            // Whole or not: a damaged block's records are still versions of their keys (a
            // torn one's are never replayed, and counting them only forgets less). A record
            // whose key cannot be read may be any key's: then nothing is forgotten.
            std::uint64_t r = off + sizeof(disk::block_header);
            for (std::uint32_t i = 0; i < head.records; ++i) {
              auto rec = disk::parse_record_head(bytes.subspan(r, off + head.length - r));
              if (!rec) {
                known = false;
                return {};
              }
              const std::string_view key(reinterpret_cast<const char*>(rec->key.data()),
                                         rec->key.size());
              if (auto it = records_of.find(key); it != records_of.end()) ++it->second;
              r += rec->size;
            }
            return {};
          });
    }
    if (known) {
      for (const auto& [key, count] : records_of) {
        if (count == 1) forgettable.insert(key);
      }
    }
  } catch (const std::bad_alloc&) {
    forgettable.clear();
  }
  for (std::size_t i = 0; i < erasures.size(); ++i) {
    if (forgettable.contains(erasures[i].first)) {
      use[erasures[i].second].forgettable += erasure_sizes[i];
      use[erasures[i].second].forgotten += 1;
    }
  }
}

}  // namespace keel::kv
