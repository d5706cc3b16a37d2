// Compaction (doc/kv-format.md, "Compaction"): the live records of mostly dead segments are
// copied to the tail, their entries pointed at the copies, and the segments removed once no
// snapshot can reach them, while readers and writers go on.

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
namespace {

// The records compaction copies into one relocation block at most (about: it stops once
// they reach it), so that a move that ends it repoints entries soon after their copy.
constexpr std::uint64_t relocation_batch = 64 * 1024;

struct segment_use {
  std::uint64_t live = 0;             // bytes of records entries name, and of their blobs
  std::uint64_t copies = 0;           // blocks a move writes: a record's, and its blob's
  std::uint64_t largest = 0;          // the largest of those blocks
  std::uint64_t largest_record = 0;   // of them, the largest record's (not a blob's)
  std::uint64_t size = 0;             // the segment's (set for candidates that may go)
  std::uint64_t forgettable = 0;      // of `live`: erase records that go with it, uncopied
  std::uint64_t forgotten = 0;        // of `copies`: those records
  std::set<std::uint64_t> blob_refs;  // other segments holding records whose blobs are here
  bool pinned = false;                // an entry here is pending: leave it alone
};

// What copying a segment's live records takes: the records (and blobs, each a block of its
// own, header included), a header for each relocation block (one per relocation_batch, and
// one more where a segment ends within it), and its largest block once more: a block never
// spans two segments, so the copies may leave up to that unused where they cross into the
// next one. Nothing at all for a segment with nothing to copy.
std::uint64_t copy_need(const segment_use& u) noexcept {
  if (u.copies == u.forgotten) return 0;
  const std::uint64_t kept = u.live - u.forgettable;
  return kept + 2 * (kept / relocation_batch + 1) * sizeof(disk::block_header) + u.largest;
}

}  // namespace

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

bool store::impl::named_now(std::uint64_t at, std::span<const std::byte> key) const noexcept {
  const disk::key_hash h = hash_of(key);
  bool named = false;
  table->for_chain(table->page_of(h), h, [&](index::entry_ref e) {
    if (e.location().load(std::memory_order_acquire) != at) return true;
    named = true;
    return false;
  });
  return named;
}

result<bool> store::impl::repoint(std::uint64_t at, std::span<const std::byte> key,
                                  std::uint64_t to, const io::countdown& cd) noexcept {
  const disk::key_hash h = hash_of(key);
  for (;;) {
    const std::uint64_t page = table->page_of(h);
    auto g = locks->lock({lock::entity(page)}, io::deadline(cd.expiry()));
    if (!g) return std::unexpected(g.error());
    if (table->page_of(h) != page) continue;  // split meanwhile
    if (const index::split_journal j = table->pending_split();
        j.old == page || j.low == page || j.high == page) {
      (void)g->unlock();
      if (auto r = settle_split(cd); !r) return std::unexpected(r.error());
      continue;
    }
    // The entry that names this very record, if any still does (dead writers' marks of
    // the hash settled first: only theirs can be pending while we hold the page).
    if (auto r = settle_chain(page, h); !r) return std::unexpected(r.error());
    std::optional<index::entry_ref> entry;
    table->for_chain(page, h, [&](index::entry_ref e) {
      if (e.location().load(std::memory_order_acquire) != at) return true;
      entry = e;
      return false;
    });
    if (!entry) return false;  // superseded: dead
    const index::entry_ref e = *entry;
    const auto holding =
        static_cast<std::uint64_t>(table->page_holding(e).base - base()) / disk::page_size;
    if (auto w = index_write_ready(holding); !w) return std::unexpected(w.error());
    // (Made writable above, the page may be written back and refused again before the
    // stores: then, past the deadline, the move ends where a compactor killed there leaves
    // it, a copy no entry names or an entry that names the whole copy.)
    if (!stored_escapably(cd, [&] {
          index::change_entry(table->page_holding(e), e, [&] {
            // The copy is whole before the entry names it; the seq stays (the same version).
            // An erase forgotten frees the entry for any key: location first.
            e.location().store(to, std::memory_order_release);
            if (to == 0) e.seq().store(0, std::memory_order_release);
          });
        })) {
      return std::unexpected(index_write_refusal());
    }
    return true;
  }
}

result<void> store::impl::relocate(std::span<const move> moves,
                                   const std::set<std::uint64_t>& victims, const io::countdown& cd,
                                   compact_stats& st, std::uint64_t& moved) noexcept {
  // The copies, each with its blob copied first when that lies in a victim (a victim's blobs
  // are only ever its own records' or another victim's: see compact).
  std::vector<disk::record_in> records;
  std::vector<const move*> of;
  std::vector<std::uint64_t> blob_bytes;
  std::vector<std::uint64_t> cuts;
  try {
    records.reserve(moves.size());
    of.reserve(moves.size());
    blob_bytes.reserve(moves.size());
    cuts.reserve(moves.size());
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  for (const move& m : moves) {
    const disk::record_view& rec = m.rec;
    disk::record_in r;
    r.key = rec.key;
    r.what = static_cast<disk::op>(rec.head.op);
    r.value = rec.value;
    r.blob = rec.blob;
    r.value_length = rec.head.value_length;
    r.prev = rec.head.prev;
    r.prev_seq = rec.head.prev_seq;
    r.seq = rec.head.seq;
    std::uint64_t blob = 0;
    if (disk::is_blob(rec) && victims.contains(disk::segment_of(rec.blob.location))) {
      auto value = value_of(found_record{m.at, rec, nullptr}, true);  // copies are checked
      if (!value && value.error() == errc::corrupt) {
        st.records_unreadable += 1;  // its blob does not check out: it stays
        continue;
      }
      if (!value) return std::unexpected(value.error());
      blob = disk::blob_block_size(value->size());
      auto nb = reserve(blob, room_for::compaction);  // it may take the spare
      if (!nb) return std::unexpected(nb.error());
      if (auto w = segment_write_ready(*nb, blob); !w) return std::unexpected(w.error());
      auto out = bytes_at(*nb);
      if (!out) return std::unexpected(out.error());
      std::uint64_t made = 0;
      if (!stored_escapably(cd, [&] {
            made = write_dirty(
                *nb, [&] { return disk::encode_blob_block(out->first(blob), *value, salt); });
          })) {
        return std::unexpected(index_write_refusal());
      }
      r.blob = {*nb, made};
    }
    records.push_back(r);
    of.push_back(&m);
    blob_bytes.push_back(blob);
  }
  // Many records to a relocation block (one block each cost a header apiece: a segment of
  // single puts of 16-byte values could not be copied into its own size), each block as many
  // as fit the rest of the tail's segment, and the rest in the next.
  for (std::size_t first = 0; first < records.size();) {
    cuts.clear();
    std::uint64_t length = sizeof(disk::block_header);
    for (std::size_t i = first; i < records.size(); ++i) {
      length += disk::record_size(records[i]);
      cuts.push_back(length);
    }
    auto got = reserve_fitting(cuts, room_for::compaction);
    if (!got) return std::unexpected(got.error());
    const std::uint64_t block_at = got->at;
    length = cuts[got->count - 1];
    const std::span<const disk::record_in> part(records.data() + first, got->count);
    if (auto w = segment_write_ready(block_at, length); !w) return std::unexpected(w.error());
    auto out = bytes_at(block_at);
    if (!out) return std::unexpected(out.error());
    if (!stored_escapably(cd, [&] {
          write_dirty(block_at, [&] {
            disk::encode_block(out->first(length), disk::block_kind::relocation, 0, part, salt);
          });
        })) {
      return std::unexpected(index_write_refusal());
    }
    // Each entry that still names its original now names the copy; a copy whose record was
    // superseded meanwhile is dead, and so is its blob's.
    std::uint64_t dead = 0;
    std::uint64_t at = block_at + sizeof(disk::block_header);
    for (std::size_t i = first; i < first + got->count; ++i) {
      const std::uint64_t size = disk::record_size(records[i]);
      auto pointed = repoint(of[i]->at, of[i]->rec.key, at, cd);
      if (!pointed) {
        (void)stored_escapably(cd, [&] { h64(header::dead_bytes).fetch_add(dead); });
        return std::unexpected(pointed.error());
      }
      if (*pointed) {
        st.records_moved += 1;
        st.bytes_moved += size + blob_bytes[i];
        moved += of[i]->rec.size;
      } else {
        dead += size + blob_bytes[i];
      }
      at += size;
    }
    st.bytes_moved += sizeof(disk::block_header);
    if (dead != 0 && !stored_escapably(cd, [&] { h64(header::dead_bytes).fetch_add(dead); })) {
      return std::unexpected(index_write_refusal());
    }
    first += got->count;
  }
  return {};
}

void store::impl::forget_segment(std::uint64_t number) noexcept {
  base::lock_guard g(segments_mutex);
  auto* chunk = segment_chunks[number >> chunk_bits].load();
  if (chunk == nullptr) return;
  auto& cell = chunk[number & ((1u << chunk_bits) - 1)];
  segment* s = cell.load();
  if (s == nullptr) return;
  cell.store(nullptr, std::memory_order_release);
  (void)s->map.unmap();  // the object stays (see unmap_removed_segments)
}

void store::impl::unmap_removed_segments(bool always) noexcept {
  const std::uint64_t now = h64(header::compactions).load(std::memory_order_acquire);
  if (!always && now == compactions_seen.load(std::memory_order_relaxed)) return;
  base::lock_guard g(segments_mutex);
  compactions_seen.store(now, std::memory_order_relaxed);
  for (auto& s : segments_owned) {
    if (!s->map.data() || segtab(s->number, 0).load() == s->number) continue;
    // Removed by a compaction that waited until no snapshot could reach it: nobody here is
    // reading it. The object stays (pointers to it are never kept past a snapshot).
    auto& cell =
        segment_chunks[s->number >> chunk_bits].load()[s->number & ((1u << chunk_bits) - 1)];
    cell.store(nullptr, std::memory_order_release);
    (void)s->map.unmap();
  }
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
  if (now < busy_until.load(std::memory_order_relaxed)) return false;
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
  std::uint64_t next = next_room_check.load(std::memory_order_relaxed);
  if (now < next || !next_room_check.compare_exchange_strong(next, now + room_check_ms,
                                                             std::memory_order_relaxed)) {
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
    busy_until.store(now_ms() + busy_backoff_ms, std::memory_order_relaxed);
    return;
  }
  background_errno.store(c ? 0 : c.error().value(), std::memory_order_relaxed);
  // One that removed segments set the mark itself. Else not again before a segment more has
  // died: a policy met by dead spread too thinly to take (or by a failure) does not make
  // every commit walk the index.
  if (!c || c->segments_removed == 0) {
    (void)stored_escapably(io::deadline(opts.lock_timeout).start(),
                           [&] { h64(header::background_after).store(dead_before + seg_size); });
  }
}

result<compact_stats> store::compact() noexcept {
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
      s.compaction_segment_size.store(0, std::memory_order_relaxed);
      s.compaction_keeps_off_spare.store(false, std::memory_order_relaxed);
    }
  } const sized{s};
  {
    // (No larger than the spare: see next_active_segment.)
    const std::uint64_t spare = s.h64(header::spare).load();
    const std::uint64_t next = s.next_segment_size();
    s.compaction_segment_size.store(spare != 0 ? std::min(next, spare) : next,
                                    std::memory_order_relaxed);
  }
  compact_stats st;
  // The spare, when it is not there (taken by a pass before, or by one killed before it made
  // it again), made now at the size it must be: a pass ends with a spare whenever the volume
  // has the room. btrfs shows the room an unlink frees once its transaction commits. Should
  // another program take the room first, the next writer that needs a segment tries again.
  // Under the `segment` lock.
  // (Also a spare kept smaller than a log segment: it grows once the volume has the room.)
  const auto spare_as_it_must_be = [&] {
    return s.opts.read_only ||
           (s.has_room(spare_room) && s.h64(header::spare).load() >= s.largest_log_segment());
  };
  const auto spare_again = [&](bool removed) -> result<void> {
    if (spare_as_it_must_be()) return {};
    if (auto f = s.fs->statfs(s.dir.dir); removed && f && f->type == io::fs_type::btrfs) {
      if (auto r = s.dir.dir.sync_filesystem(); !r) return r;
    }
    if (auto r = s.ensure_room(spare_room); !r && !out_of_room(r.error())) return r;
    return {};
  };
  const auto spare_again_locked = [&]() -> result<compact_stats> {
    if (spare_as_it_must_be()) return st;
    auto g = s.locks->lock({lock::entity(entity_segment)}, io::deadline(cd.expiry()));
    if (!g) return std::unexpected(g.error());
    if (auto r = spare_again(false); !r) return std::unexpected(r.error());
    return st;
  };
  // Where the volume may refuse a write fault (btrfs at a qgroup's limit), the header's page
  // first: refused, nothing could move. Its words are stored escapably all the same (the
  // page may be written back and refused again): a store refused past the deadline fails the
  // compaction where one killed there would have stopped (doc/kv-format.md, "Compaction").
  if (auto w = s.index_write_ready(0); !w) return std::unexpected(w.error());
  const auto stored = [&](auto&& stores) { return s.stored_escapably(cd, stores); };
  // Another compaction ran while we waited for the byte: the room it made is the caller's
  // to try first (a crowd of writers finding the volume full runs one compaction, not one
  // each).
  if (unless_since &&
      s.h64(header::compaction_runs).load(std::memory_order_seq_cst) != *unless_since) {
    if (others_ran != nullptr) *others_ran = true;
    return st;
  }
  if (!stored([&] { s.h64(header::compaction_runs).fetch_add(1, std::memory_order_seq_cst); })) {
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

  // 1. Candidates: every segment but the one the tail is in. Writers that might still be
  // writing into one began before now; wait for them to finish. Once they have, every
  // snapshot is at or above `horizon` (visible only grows).
  const std::uint64_t horizon = s.h64(header::visible).load(std::memory_order_seq_cst);
  // A segment numbered from here on may be made by a transaction the wait below does not
  // wait for (one begun after it started): never a candidate.
  const std::uint64_t numbered_before = s.h64(header::next_segment).load(std::memory_order_seq_cst);
  // Every block below it was reserved by a transaction open now, or one that has ended.
  const std::uint64_t tail_then = s.h64(header::tail).load(std::memory_order_acquire);
  const std::uint64_t active = disk::segment_of(tail_then);
  // Every commit visible now added the bytes it made dead before it became visible, and the
  // walk below sees its entries: the dead still to come is what has been added since.
  const std::uint64_t dead_then = s.h64(header::dead_bytes).load(std::memory_order_seq_cst);
  auto numbers = s.segment_numbers(false);
  if (!numbers) return std::unexpected(numbers.error());
  // Holding the byte, a background run waits for open transactions only a moment: a reader
  // that keeps one open (idle, or for long) would keep asked-for checkpoints, compactions and
  // verifies waiting, and this process's close, for the whole lock timeout. It gives up
  // (timed_out) and runs again once more has died.
  const auto wait_for_transactions = [&] {
    if (how != byte_claim::background) return s.wait_for_transactions(cd);
    return s.wait_for_transactions(io::deadline(std::min<std::chrono::milliseconds>(
                                                    s.opts.lock_timeout, impl::background_patience))
                                       .start());
  };
  if (auto w = wait_for_transactions(); !w) return std::unexpected(w.error());

  // 2. What is live where: every entry of the index (as of one directory word: a split
  // copies entries, never moves them, and the pages it retires are not reused while our
  // snapshot is held, so every record live now is named by the pages that word reaches;
  // records committed from now on live in newer segments, as do their blobs).
  std::map<std::uint64_t, segment_use> use;
  std::set<std::uint64_t> candidates;  // only these were waited for
  // Erase records the entries name, that no snapshot can see past: key hash -> segment.
  std::vector<std::pair<std::string, std::uint64_t>> erasures;  // key, segment
  std::vector<std::uint64_t> erasure_sizes;                     // their records' sizes
  try {
    // Below the tail's segment: a segment made and named, but not yet the tail's, is about
    // to be written. Above it, a blob's segment of its own (never a log segment's size), numbered
    // before step 1, so by a transaction open then (waited for) or one that has ended: an
    // overwritten or interrupted large value dies there, and was never reclaimed while the
    // tail stayed below it. Never the highest segment the manifest lists: a rebuild numbers
    // new segments after it, and a removed number used again would give an old commit's
    // dead blob location a stranger's bytes (its commit then reads as torn). The manifest is
    // read after the listing: what it lists then is named in seg/, and its highest only
    // grows.
    auto listed = s.listed_segments();
    if (!listed) return std::unexpected(listed.error());
    std::set<std::uint64_t> in_manifest;
    for (const disk::manifest_entry& e : *listed)
      in_manifest.insert(e.number);
    const std::uint64_t highest_listed = in_manifest.empty() ? 0 : *in_manifest.rbegin();
    for (const std::uint64_t n : *numbers) {
      if (n < active) {
        candidates.insert(n);
      } else if (n > active && n < numbered_before && n < highest_listed &&
                 in_manifest.contains(n) && s.segtab(n, 0).load() == n &&
                 !s.log_segment_size(s.segtab(n, 1).load())) {
        candidates.insert(n);
      }
    }
    // Pins the segment of a block (or record) and of every blob it names, wherever the block
    // or record lies: a blob may be in a candidate segment while the block naming it went
    // into the next one, the tail's. A record an entry names is whole. A block in a candidate
    // is a dead writer's (the live were waited for); one above may be a live writer's, being
    // written now: it is read only once sealed (its seq word, acquire), and one not sealed
    // names no blob below the tail that can count (a live writer's blobs were reserved after
    // step 1, at or above it; a dead writer's unsealed block is abandoned, never made).
    const auto pin = [&](std::uint64_t at, bool block) -> result<void> {
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
    };
    // Let go at the end of this block: step 6 waits for every snapshot held.
    auto walking = snapshot_hold::take(s, slot_use::writing);
    if (!walking) return std::unexpected(walking.error());
    auto counted = s.for_each_bucket_page(0, [&](std::uint64_t page) -> result<bool> {
      const index::bucket_ref b = s.table->page(page);
      // The page's records lie at random in the log, each a cache miss (and on a big store a
      // TLB miss): ask for all their first lines before reading any, so that the misses
      // overlap (at a gigabyte: 0.31 s a walk reading one record at a time, 0.13 s so; asking
      // a page ahead gained nothing more: the asks themselves wait for the TLB).
      for (std::size_t k = 0; k < index::entries_per_page; ++k) {
        const index::entry_ref e = b.entry(k);
        if (e.hi().load(std::memory_order_relaxed) == 0) continue;
        const std::uint64_t at = e.location().load(std::memory_order_relaxed);
        if (at == 0) continue;
        if (auto bytes = s.bytes_at(at)) __builtin_prefetch(bytes->data());
      }
      for (std::size_t k = 0; k < index::entries_per_page; ++k) {
        const index::entry_ref e = b.entry(k);
        if (e.hi().load(std::memory_order_acquire) == 0) continue;
        const std::uint64_t seq = e.seq().load(std::memory_order_acquire);
        const std::uint64_t at = e.location().load(std::memory_order_acquire);
        if ((seq & index::pending) != 0) {
          // A dead writer's commit, settled later either way: its block, the record it
          // would restore, and the blobs of both must stay.
          if (auto p = pin(seq & ~index::pending, true); !p) return std::unexpected(p.error());
          if (at != 0) {
            if (auto p = pin(at, false); !p) return std::unexpected(p.error());
          }
          continue;
        }
        if (at == 0) continue;
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
      }
      return true;
    });
    if (!counted) return std::unexpected(counted.error());
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }

  // 3. Erased keys to forget: those whose erase record is the only record of the key left in
  // any segment (counted by key: a key sharing its hash does not count). The erase record
  // itself is what keeps a replay of the whole log from bringing an older version back: it
  // may go only with the last of them. Its entry is emptied before its segment is removed,
  // and if the compaction stops in between, the erase record alone still says the key is
  // gone. Counted before the victims are chosen: a segment of such records frees all of
  // them and copies nothing (a store whose keys were all erased must be able to empty).
  std::set<std::string, std::less<>> forgettable;
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
    for (const std::uint64_t n : *numbers) {
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

  // 4. Victims: at most half live, not pinned, and whose blobs only victims' records use
  // (removing one may disqualify another: to a fixed point). When a put would find no room,
  // any with a sixteenth dead: the spare holds a whole victim's copies, and freeing a little
  // beats staying full (deletes spread thinly over every segment leave none half dead).
  const bool short_now = s.short_of_room();
  std::set<std::uint64_t> victims;
  const auto close_over_blobs = [&] {
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
  };
  try {
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
    close_over_blobs();
    // The copies must fit in the room left: the rest of the tail's segment, the spare, and
    // the whole segments the budget (options::max_bytes) and the volume still allow. The
    // least live first; the victims are removed only at the end, so a pass that took more
    // would fail with nothing freed, and a full store would stay full for good. Each pass
    // frees more than it copies (a victim that would need its whole size is left): compacting
    // again goes on.
    {
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
          s.compaction_segment_size.load(std::memory_order_relaxed) - disk::segment_header_size;
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
      s.compaction_keeps_off_spare.store(keeps_off_spare(), std::memory_order_relaxed);
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  if (victims.empty()) return spare_again_locked();

  // 5. Move every record still live out of each victim. Should the room run out first (a
  // volume that shows more free room than it then allocates: btrfs near full), the victims
  // emptied so far still go; the rest stay, their records moved so far named by the entries
  // in their copies, the originals dead.
  std::map<std::uint64_t, std::uint64_t> moved_from;  // record bytes moved, per victim
  std::optional<error> stopped;
  std::vector<impl::move> batch;  // of the victim walked, moved together
  std::uint64_t batch_bytes = 0;
  for (auto v = victims.begin(); v != victims.end(); ++v) {
    const std::uint64_t n = *v;
    auto seg = s.segment_at(n);
    if (!seg) return std::unexpected(seg.error());
    const auto bytes = (*seg)->bytes();
    const auto flush = [&]() -> result<void> {
      auto r = s.relocate(batch, victims, cd, st, moved_from[n]);
      batch.clear();
      batch_bytes = 0;
      return r;
    };
    auto walked = s.for_each_block(
        **seg, [&](std::uint64_t off, const disk::block_header& head) -> result<void> {
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
                forgettable.contains(std::string_view(
                    reinterpret_cast<const char*>(rec->key.data()), rec->key.size()))) {
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
              if (auto f = flush(); !f) return f;
            }
          }
          return {};
        });
    if (walked && !batch.empty()) walked = flush();
    batch.clear();
    batch_bytes = 0;
    if (!walked) {
      if (!out_of_room(walked.error())) return std::unexpected(walked.error());
      stopped = walked.error();
      try {
        const std::set<std::uint64_t> before = victims;
        victims.erase(v, victims.end());
        close_over_blobs();
        if (!stored([&] {
              for (const std::uint64_t kept : before) {
                if (!victims.contains(kept)) s.h64(header::dead_bytes).fetch_add(moved_from[kept]);
              }
            })) {
          return std::unexpected(s.index_write_refusal());
        }
      } catch (const std::bad_alloc&) {
        return errc_error(std::errc::not_enough_memory);
      }
      break;
    }
  }
  if (victims.empty() && stopped) return std::unexpected(*stopped);

  // 5b. A victim is removed only once no entry names it: a live record that could not be
  // copied (it did not check out) keeps its segment, and the segments holding its blobs.
  // Entries only ever move out of victims now (new records go to the tail), so one walk
  // after the moves decides.
  {
    std::set<std::uint64_t> named;
    auto hold = snapshot_hold::take(s, slot_use::writing);
    if (!hold) return std::unexpected(hold.error());
    try {
      auto walked = s.for_each_bucket_page(0, [&](std::uint64_t page) -> result<bool> {
        const index::bucket_ref b = s.table->page(page);
        for (std::size_t k = 0; k < index::entries_per_page; ++k) {
          const index::entry_ref e = b.entry(k);
          if (e.hi().load(std::memory_order_acquire) == 0) continue;
          const std::uint64_t seq = e.seq().load(std::memory_order_acquire);
          const std::uint64_t at = e.location().load(std::memory_order_acquire);
          if (at != 0 && victims.contains(disk::segment_of(at))) named.insert(disk::segment_of(at));
          if ((seq & index::pending) != 0) named.insert(disk::segment_of(seq & ~index::pending));
        }
        return true;
      });
      if (!walked) return std::unexpected(walked.error());
      if (std::ranges::any_of(named, [&](std::uint64_t n) { return victims.contains(n); })) {
        const std::set<std::uint64_t> before = victims;
        std::erase_if(victims, [&](std::uint64_t n) { return named.contains(n); });
        close_over_blobs();
        if (!stored([&] {
              for (const std::uint64_t kept : before) {
                if (!victims.contains(kept)) s.h64(header::dead_bytes).fetch_add(moved_from[kept]);
              }
            })) {
          return std::unexpected(s.index_write_refusal());
        }
      }
    } catch (const std::bad_alloc&) {
      return errc_error(std::errc::not_enough_memory);
    }
  }
  if (victims.empty()) return spare_again_locked();

  // 6. The copies on disk before any original goes; then nobody may still read an original
  // (a snapshot from before the moves, or one walking back to older versions).
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
  if (auto w = wait_for_transactions(); !w) return std::unexpected(w.error());

  // 7. Remove them, under the sync lock (a group sync never meets a half-removed segment).
  // The checkpoint goes first, for good: it may name originals (a rebuild without it
  // replays the whole log).
  if (auto r = s.remove_checkpoint(); !r) return std::unexpected(r.error());
  const auto free_before = s.fs->statfs(s.dir.dir);
  std::uint64_t kept_room = 0;  // victims' kept as the spare, the deletes' or the next segment
  {
    // With the `segment` lock too, which every change of the manifest holds: the victims
    // go off it first (a segment listed is one that must be there; their copies are synced,
    // so one unlisted and still there is a leftover the next lone opener removes).
    const std::array<lock::entity, 2> both{lock::entity(entity_sync), lock::entity(entity_segment)};
    auto g = s.locks->lock(both, io::deadline(cd.expiry()));
    if (!g) return std::unexpected(g.error());
    // Which rooms to keep: as seg/ has them (see next_active_segment).
    if (auto r = s.reconcile_rooms(); !r) return std::unexpected(r.error());
    if (auto r = s.unlist_segments(victims); !r) return std::unexpected(r.error());
    if (compact_unlisted_hook != nullptr) compact_unlisted_hook();
    std::uint64_t kept_spare = 0;  // sizes (0: none kept)
    std::uint64_t kept_deletes = 0;
    std::uint64_t kept_next = 0;
    std::uint64_t kept_next_size = 0;
    std::uint64_t freed_dead = 0;  // of the victims, as counted in *dead bytes*
    // Which victim becomes which room: the spare the largest; the deletes' room the smallest
    // other, no larger than the spare (an erase that takes it makes it a log segment).
    const std::vector<std::uint64_t> leaving(victims.begin(), victims.end());
    const auto victim_size = [&](std::uint64_t n) { return s.segtab(n, 1).load(); };
    std::uint64_t spare_pick = 0;
    std::uint64_t deletes_pick = 0;
    // Whether the spare, there or kept, is as large as every log segment that stays.
    bool spare_whole = true;
    {
      std::uint64_t spare_size = s.h64(header::spare).load();
      if (spare_size == 0) {
        for (const std::uint64_t n : leaving) {
          const std::uint64_t size = victim_size(n);
          if (s.log_segment_size(size) && (spare_pick == 0 || size > victim_size(spare_pick))) {
            spare_pick = n;
          }
        }
        spare_size = spare_pick == 0 ? 0 : victim_size(spare_pick);
        spare_whole = spare_size != 0 && spare_size >= s.largest_log_segment(leaving);
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
        for (const std::uint64_t n : leaving) {
          const std::uint64_t size = victim_size(n);
          if (n != spare_pick && s.log_segment_size(size) && size <= spare_size &&
              (deletes_pick == 0 || size < victim_size(deletes_pick))) {
            deletes_pick = n;
          }
        }
      }
    }
    for (const std::uint64_t n : victims) {
      auto seg = s.segment_at(n);
      if (!seg) return std::unexpected(seg.error());
      const std::uint64_t size = (*seg)->size;
      // Its entry, unless another segment holds it (one named but never entered, left by a
      // maker killed in between, shares the entry of a segment 8064 numbers apart).
      std::uint64_t holder = n;
      if (!stored([&] {
            s.segtab(n, 0).compare_exchange_strong(holder, 0, std::memory_order_seq_cst);
          })) {
        return std::unexpected(s.index_write_refusal());
      }
      // Compaction took the spare: a victim is the next one. An erase took the deletes'
      // room: another victim is that (both picked above). And one is kept as the next
      // segment, unless one is there: commits that only erase then need no room from the
      // volume, whoever else fills it.
      impl::room_kept keep;
      if (n == spare_pick) {
        keep.as = impl::room_kept::spare;
      } else if (n == deletes_pick) {
        keep.as = impl::room_kept::deletes;
      } else if (kept_next == 0 && s.abandoned_segment() == 0 && spare_whole &&
                 (s.has_room(spare_room) || spare_pick != 0)) {
        keep.as = impl::room_kept::next;
      }
      auto given = s.give_back_segment(n, size, keep);
      if (!given) return std::unexpected(given.error());
      // (Each kept at the size it has: the victim's.)
      if (given->as == impl::room_kept::spare) kept_spare = size;
      if (given->as == impl::room_kept::deletes) kept_deletes = size;
      if (given->as == impl::room_kept::next) {
        kept_next = given->number;
        kept_next_size = size;
      }
      const std::uint64_t dead = size - disk::segment_header_size > use[n].live
                                     ? size - disk::segment_header_size - use[n].live
                                     : 0;
      const std::uint64_t was = s.h64(header::dead_bytes).load();
      if (!stored([&] { s.h64(header::dead_bytes).fetch_sub(std::min(was, dead)); })) {
        return std::unexpected(s.index_write_refusal());
      }
      freed_dead += std::min(was, dead);
      st.segments_removed += 1;
      st.bytes_freed += size;
      if (given->as != impl::room_kept::volume) kept_room += size;
    }
    if (auto r = s.dir.segments.sync_all(); !r) return std::unexpected(r.error());
    if (!stored([&] {
          if (kept_spare != 0) s.h64(header::spare).store(kept_spare);
          if (kept_deletes != 0) s.h64(header::deletes_room).store(kept_deletes);
        })) {
      return std::unexpected(s.index_write_refusal());
    }
    if (kept_next != 0) {
      // Listed, then entered, as a segment made: named and not listed, it is the leftover the
      // next writer adopts (adopt_named_leftover).
      if (auto l = s.list_segment(kept_next, kept_next_size); !l) {
        return std::unexpected(l.error());
      }
      if (auto e = s.enter_segment(kept_next, kept_next_size); !e) {
        return std::unexpected(e.error());
      }
    }
    // No victim could be kept as the spare (it was taken, by this pass or one before), or one
    // smaller than a log segment that stays was: it is made, or grown, now, to the size it
    // must be, of the room the victims gave back (a pass that may take the spare frees at
    // least as much), when the volume has it.
    if (auto r = spare_again(true); !r) return std::unexpected(r.error());
    if (!stored([&] {
          s.h64(header::compactions).fetch_add(1, std::memory_order_seq_cst);
          // What was found before no longer holds (*dead bytes* went down by an estimate).
          s.h64(header::fruitless_below).store(0, std::memory_order_seq_cst);
          // And no background compaction before a segment more has died than this one left
          // (what died while it ran counts: a run that fell behind a fast writer is followed
          // by the next).
          s.h64(header::background_after)
              .store(dead_then - std::min(dead_then, freed_dead) + s.next_segment_size());
        })) {
      return std::unexpected(s.index_write_refusal());
    }
  }
  s.unmap_removed_segments();
  // Near full, the room must show before the writers that wait for it retry (where other
  // users still map a removed segment it is not free yet on any filesystem: then only
  // btrfs's own delay is worth a sync).
  if (free_before && free_before->type == io::fs_type::btrfs && s.short_of_room()) {
    if (auto r = s.show_freed_room(free_before, st.bytes_freed - kept_room); !r) {
      return std::unexpected(r.error());
    }
  }
  // A checkpoint of the entries as they are now, naming the copies. Its failure (no_space
  // on a nearly full volume, where the copy would take the room just freed) leaves a longer
  // replay after a power loss, nothing wrong: kept for stats.
  s.checkpoint_after_compaction(cd);
  return st;
}

}  // namespace keel::kv
