// Compaction's moves, steps 5 and 5b of compaction.hpp (doc/kv-format.md, "Compaction"):
// every record still live in a victim copied to the tail (relocate, relocate.cpp), and a
// victim an entry still names kept.

#include <algorithm>
#include <vector>

#include "kv/compaction.hpp"

namespace keel::kv {

// 5. Move every record still live out of each victim. Should the room run out first (a
// volume that shows more free room than it then allocates: btrfs near full), the victims
// emptied so far still go; the rest stay, their records moved so far named by the entries
// in their copies, the originals dead.
result<void> compaction_run::move_live() noexcept {
  for (auto v = victims.begin(); v != victims.end(); ++v) {
    auto seg = s.segment_at(*v);
    if (!seg) return std::unexpected(seg.error());
    auto walked = move_out_of(*v, **seg);
    if (walked) continue;
    if (!out_of_room(walked.error())) return walked;
    stopped = walked.error();
    try {
      const std::set<std::uint64_t> before = victims;
      victims.erase(v, victims.end());
      close_over_blobs();
      if (auto c = count_moved_of_dropped(before); !c) return c;
    } catch (const std::bad_alloc&) {
      return errc_error(std::errc::not_enough_memory);
    }
    break;
  }
  return {};
}

// The live records of victim `n`, moved together in batches of about relocation_batch.
result<void> compaction_run::move_out_of(std::uint64_t n, const segment& seg) noexcept {
  std::vector<store::impl::move> batch;
  std::uint64_t batch_bytes = 0;
  const auto bytes = seg.bytes();
  auto walked =
      s.for_each_block(seg, [&](std::uint64_t off, const disk::block_header& head) -> result<void> {
        return collect_block(n, bytes, off, head, batch, batch_bytes);
      });
  if (walked && !batch.empty()) walked = s.relocate(batch, victims, cd, st, moved_from[n]);
  return walked;
}

// The records of one block of victim `n` that are still live: each added to `batch` (moved
// once it holds relocation_batch), or, an erase record whose key is forgettable, its entry
// emptied.
result<void> compaction_run::collect_block(std::uint64_t n, std::span<const std::byte> bytes,
                                           std::uint64_t off, const disk::block_header& head,
                                           std::vector<store::impl::move>& batch,
                                           std::uint64_t& batch_bytes) noexcept {
  // Every block whose header checks out, record by record: a record an entry names
  // is live whatever the rest of its block is (a commit damaged after it was made
  // stands). A copy is made only of a record that checks out (always: a copy gets a
  // new checksum, and must never make damage look whole); one that does not stays,
  // and so does its segment while an entry names it (below).
  if (head.kind != static_cast<std::uint16_t>(disk::block_kind::commit) &&
      head.kind != static_cast<std::uint16_t>(disk::block_kind::relocation)) {
    return {};
  }
  std::uint64_t r = off + sizeof(disk::block_header);
  for (std::uint32_t i = 0; i < head.records; ++i) {
    const auto rest = bytes.subspan(r, off + head.length - r);
    auto rec = disk::parse_record(rest, s.salt, true);
    if (!rec) {
      st.records_unreadable += 1;
      auto shape = disk::parse_record_head(rest);
      if (!shape) {
        st.records_unreadable += head.records - i - 1;
        return {};  // where the next record starts is unknown
      }
      r += shape->size;
      continue;
    }
    // Most records of a victim are dead: told so without the page lock, which a
    // writer of the same keys holds most of the time (a run that took it for each
    // record fell far behind one fast writer).
    if (!s.named_now(disk::make_location(n, r), rec->key)) {
      r += rec->size;
      continue;
    }
    const std::uint64_t at = disk::make_location(n, r);
    r += rec->size;
    if (rec->head.op == static_cast<std::uint8_t>(disk::op::erase) &&
        forgettable.contains(
            std::string_view(reinterpret_cast<const char*>(rec->key.data()), rec->key.size()))) {
      // The key is gone for every snapshot, and no older version of it outlives
      // this compaction: nothing to copy, and the entry is free for any key
      // (doc/kv-format.md, "Compaction", forgetting erased keys).
      auto emptied = s.repoint(at, rec->key, 0, cd);
      if (!emptied) return std::unexpected(emptied.error());
      if (*emptied) {
        st.erasures_dropped += 1;
        moved_from[n] += rec->size;
      }
      continue;
    }
    try {
      batch.push_back({at, *rec});
    } catch (const std::bad_alloc&) {
      return errc_error(std::errc::not_enough_memory);
    }
    batch_bytes += rec->size;
    if (batch_bytes >= relocation_batch) {
      auto moved = s.relocate(batch, victims, cd, st, moved_from[n]);
      batch.clear();
      batch_bytes = 0;
      if (!moved) return moved;
    }
  }
  return {};
}

// 5b. A victim is removed only once no entry names it: a live record that could not be
// copied (it did not check out) keeps its segment, and the segments holding its blobs.
// Entries only ever move out of victims now (new records go to the tail), so one walk
// after the moves decides.
result<void> compaction_run::keep_named_victims() noexcept {
  std::set<std::uint64_t> named;
  auto hold = snapshot_hold::take(s, slot_use::writing);
  if (!hold) return std::unexpected(hold.error());
  try {
    auto walked = s.table->for_each_page(0, [&](std::uint64_t page) -> result<bool> {
      s.table->page(page).for_each_key(
          [&](std::size_t, const index::entry_ref&, const index::entry_ref::state& e) {
            if (e.location != 0 && victims.contains(disk::segment_of(e.location))) {
              named.insert(disk::segment_of(e.location));
            }
            if ((e.seq & index::pending) != 0) {
              named.insert(disk::segment_of(e.seq & ~index::pending));
            }
            return true;
          });
      return true;
    });
    if (!walked) return std::unexpected(walked.error());
    if (std::ranges::any_of(named, [&](std::uint64_t n) { return victims.contains(n); })) {
      const std::set<std::uint64_t> before = victims;
      std::erase_if(victims, [&](std::uint64_t n) { return named.contains(n); });
      close_over_blobs();
      if (auto c = count_moved_of_dropped(before); !c) return c;
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return {};
}

}  // namespace keel::kv
