// When compaction runs (doc/kv-format.md, "Compaction"): due by what has died, in the
// background, or for a writer short of room; and what a run asks of the store around it
// (waiting for open transactions, unmapping the segments it removed). The run itself is
// compaction.hpp's.

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "base/futex.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {

result<void> store::impl::wait_for_transactions(const io::countdown& cd) noexcept {
  // Each transaction open now (a slot holding a snapshot) is waited for until it ends. One
  // that begins meanwhile (its slot's snapshot count moves on) began after the caller's
  // point, so it is not waited for: a stream of readers cannot starve us.
  std::vector<std::uint64_t> count(max_slots);
  std::vector<bool> waiting(max_slots);
  try {
    for (std::uint32_t u = 0; u < max_slots; ++u) {
      count[u] = slot(u).snapshots().load(std::memory_order_seq_cst);
      waiting[u] = true;
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  // Readers without a slot (slotless_byte): those reading now are waited for until the byte
  // is found free once; any that comes after began after the caller's point.
  bool slotless = !no_slotless_readers();
  for (;;) {
    if (slotless) slotless = !no_slotless_readers();
    bool older = slotless;
    for (std::uint32_t u = 0; u < max_slots; ++u) {
      if (!waiting[u]) continue;
      const slot_ref sl = slot(u);
      // The slot holds 1 + its snapshot (0: none), so one of an empty store counts too.
      const std::uint64_t held = sl.snapshot().load(std::memory_order_seq_cst);
      if (held == 0 || sl.snapshots().load(std::memory_order_seq_cst) != count[u] ||
          slot_owner_dead(u)) {
        waiting[u] = false;
        continue;
      }
      older = true;
    }
    if (!older) return {};
    if (cd.expired()) return errc_error(std::errc::timed_out);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void store::impl::unmap_removed_segments(bool always) noexcept {
  // Removed by a compaction that waited until no snapshot could reach it: its entry in the
  // segment table is another's, or empty.
  mapped.forget_removed(h64(header::compactions).load(std::memory_order_acquire), always,
                        [&](const segment& s) { return segtab(s.number, 0).load() != s.number; });
}

std::uint64_t store::impl::log_not_live() const noexcept {
  const table_segments t = segments_in_table();
  const std::uint64_t log = t.bytes - t.count * disk::segment_header_size;
  // Live records, each counted with a block header and alignment of its own (the most a
  // record's block adds: records committed together share one), and the tail's unwritten
  // rest.
  const std::uint64_t tail = h64(header::tail).load();
  const std::uint64_t used = h64(header::live_bytes).load() +
                             h64(header::live_records).load() * (sizeof(disk::block_header) + 8) +
                             (tail == 0 ? 0 : log_segment_size_at(tail) - disk::offset_of(tail));
  return log > used ? log - used : 0;
}

bool store::impl::compaction_would_take_nothing() const noexcept {
  // Read between two reads of the threshold: the compactor clears it before it writes the
  // segment, so two equal reads bracket one finding's segment.
  auto below = h64(header::fruitless_below);
  const std::uint64_t b = below.load(std::memory_order_seq_cst);
  if (b == 0) return false;
  const std::uint64_t then = h64(header::fruitless_tail_segment).load(std::memory_order_seq_cst);
  if (below.load(std::memory_order_seq_cst) != b) return false;
  return h64(header::dead_bytes).load(std::memory_order_seq_cst) < b &&
         disk::segment_of(h64(header::tail).load(std::memory_order_seq_cst)) == then;
}

result<bool> store::impl::make_room(std::uint64_t seen_runs) noexcept {
  const io::countdown cd = io::deadline(opts.lock_timeout).start();
  std::uint32_t* const ends = futex_word(header::compaction_ends);
  bool others_ran = false;
  result<compact_stats> c;
  for (;;) {
    const std::uint32_t ended = std::atomic_ref(*ends).load(std::memory_order_seq_cst);
    c = compact(seen_runs, &others_ran, byte_claim::try_once);
    if (c || !held_elsewhere(c.error())) {
      break;
    }
    // The byte is busy (a compaction, a checkpoint or a verify runs): sleep until a
    // compaction ends, not polling the byte (a crowd of writers polling one lock slows all
    // of them, and the compactor with them).
    if (cd.expired()) return errc_error(std::errc::timed_out);
    base::futex_wait(ends, ended, std::chrono::milliseconds(20), base::futex_scope::shared);
    if (std::atomic_ref(*ends).load(std::memory_order_seq_cst) != ended) return true;
  }
  if (!c) return std::unexpected(c.error());
  // Another began since: its room (or, if it freed none, whatever has changed since) is worth
  // a retry; the caller's retries are bounded, so a crowd on a store that is really full runs
  // about one compaction per round of retries, not one each.
  if (others_ran) return true;
  // Ours freed nothing: still worth a retry when a put could make a segment now (others made
  // room meanwhile; compaction then takes only half-dead victims, and found none).
  return c->segments_removed != 0 || !short_of_room();
}

result<void> store::impl::show_freed_room(const result<io::fs_info>& before,
                                          std::uint64_t freed) noexcept {
  // btrfs shows the room an unlink frees only once its transaction commits: then sync, or
  // the writer that asked for the room would not see it.
  const auto after = fs->statfs(dir.dir);
  if (before && after && after->available_bytes < before->available_bytes + freed / 2) {
    return dir.dir.sync_filesystem();
  }
  return {};
}

bool store::impl::compaction_due() noexcept {
  const double fraction = opts.compact_dead_fraction;
  if (fraction <= 0 || opts.read_only) return false;
  const std::uint64_t seg_size = next_segment_size();
  const std::uint64_t dead = h64(header::dead_bytes).load(std::memory_order_relaxed);
  if (dead < seg_size || dead < h64(header::background_after).load(std::memory_order_relaxed))
    return false;
  const std::uint64_t now = now_ms();
  if (now < maintenance.busy_until.load(std::memory_order_relaxed)) return false;
  // The log is about its live and dead records (the block headers and a segment's unused
  // end aside): no walk of the segment table on every commit.
  const std::uint64_t live_now = h64(header::live_bytes).load(std::memory_order_relaxed);
  if (dead >= 2 * seg_size &&
      static_cast<double>(dead) >= fraction * static_cast<double>(live_now + dead)) {
    return true;
  }
  // Short of room, compaction takes any segment a sixteenth dead (see compact): a segment's
  // worth of dead is then worth a run before a put finds the volume full. statfs is a call:
  // not on every commit.
  std::uint64_t next = compacting.next_room_check.load(std::memory_order_relaxed);
  if (now < next || !compacting.next_room_check.compare_exchange_strong(
                        next, now + process_compaction::room_check_ms, std::memory_order_relaxed)) {
    return false;
  }
  return short_of_room();
}

void store::impl::compact_in_background() noexcept {
  const std::uint64_t seg_size = next_segment_size();
  const std::uint64_t dead_before = h64(header::dead_bytes).load();
  auto c = compact(std::nullopt, nullptr, byte_claim::background);
  if (!c && held_elsewhere(c.error())) {
    // Another user's compaction, checkpoint or verify: not again for a while.
    maintenance.busy_until.store(now_ms() + process_maintenance::busy_backoff_ms,
                                 std::memory_order_relaxed);
    return;
  }
  compacting.background_errno.store(c ? 0 : c.error().value(), std::memory_order_relaxed);
  // One that removed segments set the mark itself. Else not again before a segment more has
  // died: a policy met by dead spread too thinly to take (or by a failure) does not make
  // every commit walk the index.
  if (!c || c->segments_removed == 0) {
    (void)stored_escapably(io::deadline(opts.lock_timeout).start(),
                           [&] { h64(header::background_after).store(dead_before + seg_size); });
  }
}

}  // namespace keel::kv
