// The commit protocol (doc/kv-format.md, "Committing"): a transaction's writes validated
// against its snapshot, its block reserved and written, its entries marked and published, and
// the commit made visible in seq order (visible.cpp) and, for durability::sync, durable
// (group_sync.cpp).

#include <algorithm>
#include <array>
#include <bit>
#include <bitset>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "base/futex.hpp"
#include "base/per_thread.hpp"
#include "base/planted.hpp"
#include "base/spin.hpp"
#include "io/map_guard.hpp"
#include "kv/store_impl.hpp"
#include "kv/transaction_impl.hpp"

namespace keel::kv {
namespace {

constexpr auto u64 = [](auto v) { return static_cast<std::uint64_t>(v); };

}  // namespace

namespace {

// One key of a commit as it goes through the protocol.
struct key_plan {
  std::string_view key;
  disk::key_hash h{};
  const transaction::impl::write* w = nullptr;  // null: only read
  std::uint64_t page = 0;
  std::optional<index::entry_ref> entry;  // its entry, if it has one
  std::uint64_t prev = 0;                 // the entry's location and seq at validation
  std::uint64_t prev_seq = 0;
  std::uint64_t prev_size = 0;  // bytes of the previous version, 0 if none or an erase
  disk::blob_ref blob{};
  bool own_segment = false;  // its blob in a segment of its own
  std::uint64_t record_at = 0;
};

}  // namespace

// GCC's -Wclobbered flags locals held across the escape's sigsetjmp below that nothing
// changes after it (length, only_erases, escapable), which C11 7.13.2.1 keeps as they were;
// after a jump only held, lease, charged.s, taken, reserved, d and cd are read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wclobbered"
result<std::uint64_t> transaction::impl::commit(durability d) noexcept {
  // Begun before a fork: the slot it would commit through is the parent's.
  if (lease.generation != base::fork_generation()) return errc_error(std::errc::invalid_argument);
  if (writes.empty()) return snapshot;  // a reader: serialised at its snapshot
  if (auto w = s->writable(); !w) return std::unexpected(w.error());
  if (!lease.held()) return errc_error(std::errc::invalid_argument);  // (slotless: reads only)
  const io::countdown cd = io::deadline(s->opts.lock_timeout).start();
  std::vector<key_plan> keys;
  try {
    keys.reserve(writes.size() + reads.size());
    const auto plan = [this](std::string_view k, const write* w) {
      key_plan p;
      p.key = k;
      p.h = s->hash_of(as_bytes(k));
      p.w = w;
      return p;
    };
    for (const auto& [k, w] : writes)
      keys.push_back(plan(k, &w));
    for (const auto& k : reads) {
      if (!writes.contains(k)) keys.push_back(plan(k, nullptr));
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }

  // 1. Room, then blobs, before any lock.
  const std::uint64_t threshold = s->dir.params.blob_threshold;
  // A commit that only erases may use the segment of room puts leave: deletes work on a
  // volume (or budget) puts have filled.
  const bool only_erases = std::all_of(
      keys.begin(), keys.end(), [](const key_plan& k) { return k.w == nullptr || k.w->erase; });
  bool has_blobs = false;
  std::uint64_t need = sizeof(disk::block_header);  // its block and blobs, ideally placed
  // Of that, blobs larger than a segment (each in a segment file of its own, header and all),
  // and what each takes of the room for puts, counted in whole segments less their headers:
  // up to one segment more than its file's size, by rounding.
  std::uint64_t own_segments = 0;
  std::uint64_t own_room = 0;
  std::uint64_t puts = 0;
  std::uint64_t block = sizeof(disk::block_header);  // the commit block alone
  // The segments made now: a blob larger gets a segment of its own, so that no log segment
  // grows past them for it (a 700 KB blob in a 1 MiB log segment beside 256 KiB ones made
  // the spare 1 MiB, and segments made of the spare after were as large: once another
  // program on the volume took the room a pass gave back, the spare shrank to a 256 KiB
  // victim, the 1 MiB segments could never be copied, and erases failed with no_space).
  const std::uint64_t log_room = s->next_segment_size() - disk::segment_header_size;
  for (key_plan& k : keys) {
    if (k.w == nullptr) continue;
    disk::record_in r;
    r.key = as_bytes(k.key);
    if (k.w->erase) {
      r.what = disk::op::erase;
    } else if (k.w->value.size() >= threshold) {
      r.what = disk::op::put_blob;
      const std::uint64_t len = disk::blob_block_size(k.w->value.size());
      need += len;
      const std::uint64_t seg_size = log_room + disk::segment_header_size;
      if (len > log_room) {
        k.own_segment = true;
        own_segments += len;
        own_room += ((disk::segment_header_size + len + seg_size - 1) / seg_size + 1) *
                    (seg_size - disk::segment_header_size);
      }
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
  // The ledger: a commit that puts is charged its worst case before anything of it is
  // written. Its block and each blob may leave up to their own length unused at the end of a
  // segment they do not fit (a blob in a segment of its own: that segment, see own_room);
  // each new key may split a page in two.
  struct ledger_hold {
    store::impl* s = nullptr;
    slot_lease* lease = nullptr;
    const io::countdown* cd = nullptr;
    std::uint32_t who = 0;
    space::charge c;
    bool used = false;  // space was taken: it stays charged
    void done() noexcept {
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
    ~ledger_hold() { done(); }
  } charged;
  if (!only_erases && s->opts.ledger && !s->opts.read_only) {
    // (The directory's next doubling is held back from every delta's room once, in
    // room_for_puts: charged to each commit, it made a 1 KiB put cost 40 KiB at 100 000
    // keys, and a thousand writers closed deltas ten times as often, each close waiting for
    // the commits of the one before.)
    const std::uint64_t index_pages = 2 * puts;
    const std::uint64_t cost = 2 * (need - own_segments) + own_room + index_pages * disk::page_size;
    commit_step_reached(commit_step::charging);
    auto c =
        s->charge(lease, static_cast<std::int64_t>(std::min<std::uint64_t>(cost, INT64_MAX)), cd);
    if (!c) return std::unexpected(c.error());
    charged.c = *c;
    charged.who = lease.index;
    charged.lease = &lease;
    charged.cd = &cd;
    charged.s = s;  // last: a hold with no store does nothing
    commit_step_reached(commit_step::charged);
  }
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
      // Larger than a segment: a segment of its own, never a log segment's size (a page
      // more if it would be one: the log's tail is never placed in it).
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
    auto bytes = s->bytes_at(at);
    if (!bytes) return std::unexpected(bytes.error());
    // (Its pages written back and refused again before the copy ends, past the deadline: the
    // blob is dead space, as a writer's killed here.)
    std::uint64_t sum = 0;
    if (auto w = s->store_or_refuse([&] {
          sum = s->write_dirty(
              at, [&] { return disk::encode_blob_block(bytes->first(len), value, s->salt); });
        });
        !w) {
      return std::unexpected(w.error());
    }
    k.blob = {at, sum};
  }

  // 2-4. Lock the keys' pages, check the directory still names them, validate, make room.
  lock::entities_guard held;
  std::vector<disk::record_in> records;
  for (;;) {
    std::vector<lock::entity> want;
    try {
      want.reserve(keys.size());
    } catch (const std::bad_alloc&) {
      return errc_error(std::errc::not_enough_memory);
    }
    for (key_plan& k : keys) {
      k.page = s->table->page_of(k.h);
      want.emplace_back(k.page, k.w != nullptr);
    }
    auto g = s->locks->lock(want, io::deadline(cd.expiry()));
    if (!g) return std::unexpected(g.error());
    held = std::move(*g);
    bool moved = false;
    for (const key_plan& k : keys)
      moved |= s->table->page_of(k.h) != k.page;
    if (moved) {
      (void)held.unlock();
      continue;
    }
    // A split a splitter died in the middle of: nobody may change its pages before it is
    // finished (index.hpp, table::split).
    if (const index::split_journal j = s->table->pending_split(); j.old != 0) {
      const bool touched = std::ranges::any_of(keys, [&](const key_plan& k) {
        return k.page == j.old || k.page == j.low || k.page == j.high;
      });
      if (touched) {
        (void)held.unlock();
        if (auto r = s->settle_split(cd); !r) return std::unexpected(r.error());
        continue;
      }
    }
    std::map<std::uint64_t, std::size_t> new_keys;  // per page
    for (key_plan& k : keys) {
      k.entry.reset();
      k.prev = k.prev_seq = k.prev_size = 0;
      // Its entry (the dead writers' marks of its hash settled first: only theirs can be
      // pending while we hold the page), told from other keys of its hash by its bytes.
      auto found = s->find_locked(k.page, k.h, as_bytes(k.key));
      if (!found) return std::unexpected(found.error());
      if (*found) {
        const index::entry_ref e = **found;
        const std::uint64_t at = e.location().load(std::memory_order_acquire);
        // Its header alone: what it says is all a commit over it needs (a damaged value may
        // be overwritten or erased).
        // (Whose header is damaged too: its size is unknown, the counters miss it.)
        auto rec = s->record_head_at(at);
        if (!rec && rec.error() != errc::corrupt) return std::unexpected(rec.error());
        k.entry = e;
        k.prev = at;
        k.prev_seq = e.seq().load(std::memory_order_acquire);
        if (rec && rec->rec.head.op != static_cast<std::uint8_t>(disk::op::erase)) {
          k.prev_size = disk::stored_size(rec->rec);
        }
      }
      // Anything newer than the snapshot (visible or not yet) was committed by somebody else.
      // (Still pending: its block could not be read; never build on it.)
      if (k.entry && ((k.prev_seq & index::pending) != 0 || k.prev_seq > snapshot)) {
        // Not visible yet: wait until it is (settling it if its writer died), so that the
        // retry's snapshot sees it rather than conflicting with it again.
        // (Escapably: settling a dead writer's commit stores to the index.)
        if ((k.prev_seq & index::pending) == 0 &&
            !s->stored_escapably(cd, [&] { s->wait_visible(k.prev_seq, cd); })) {
          return std::unexpected(s->index_write_refusal());
        }
        return keel_error(errc::conflict);
      }
      if (!k.entry && k.w != nullptr) {
        try {
          ++new_keys[k.page];
        } catch (const std::bad_alloc&) {
          return errc_error(std::errc::not_enough_memory);
        }
      }
    }
    // A page's chain with fewer free entries (empty, or holding nothing: an undone insert,
    // an erased key compaction forgot) than the commit's new keys in it must grow: every
    // such page before the keys are locked and looked up again (one page a round made a
    // transaction's cost grow with its square: 65 536 new keys took about a thousand rounds,
    // 2 000 puts/s against 670 000 in transactions of 16).
    struct growth {
      std::uint64_t page = 0;
      std::size_t wanted = 0;              // its new keys
      std::vector<disk::key_hash> coming;  // its keys the commit writes
    };
    std::vector<growth> grow;
    try {
      std::map<std::uint64_t, std::size_t> growing;  // page -> its place in `grow`
      for (const auto& [page, count] : new_keys) {
        if (s->table->has_room(page, count)) continue;
        growing.emplace(page, grow.size());
        grow.push_back({page, count, {}});
      }
      for (const key_plan& k : keys) {
        if (k.w == nullptr) continue;
        if (auto at = growing.find(k.page); at != growing.end()) {
          grow[at->second].coming.push_back(k.h);
        }
      }
    } catch (const std::bad_alloc&) {
      return errc_error(std::errc::not_enough_memory);
    }
    if (grow.empty()) break;
    (void)held.unlock();
    charged.used = true;  // the split's pages are taken, whatever the commit does next
    for (const growth& one : grow) {
      // (A page split by an earlier one here, or by another writer, routes its keys elsewhere:
      // grow_page then does nothing, and the next round looks again.)
      if (auto r = s->grow_page(one.page, one.coming.front(), one.coming, one.wanted, cd); !r) {
        return std::unexpected(r.error());
      }
    }
  }

  // The index pages the marks go into, writable now where the volume may refuse it (the
  // pages of each written key's chain: a new key takes an entry anywhere along it).
  if (s->writes_refusable.load(std::memory_order_relaxed)) {
    for (const key_plan& k : keys) {
      if (k.w == nullptr) continue;
      result<void> ready;
      s->table->for_page_chain(k.page, [&](std::uint64_t q) {
        ready = s->index_write_ready(q);
        return static_cast<bool>(ready);
      });
      if (!ready) return std::unexpected(ready.error());
    }
  }

  commit_step_reached(commit_step::locked);
  // The block: its records (in the write set's order: nothing reads them by key order).
  try {
    records.reserve(keys.size());
    for (const key_plan& k : keys) {
      if (k.w == nullptr) continue;
      disk::record_in r;
      r.key = as_bytes(k.key);
      r.prev = k.prev;
      r.prev_seq = k.prev_seq;
      if (k.w->erase) {
        r.what = disk::op::erase;
      } else if (k.blob.location != 0) {
        r.what = disk::op::put_blob;
        r.blob = k.blob;
        r.value_length = k.w->value.size();
      } else {
        r.what = disk::op::put;
        r.value = as_bytes(k.w->value);
      }
      records.push_back(r);
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  const std::uint64_t length = disk::block_size(records);
  const slot_ref me = s->slot(lease.index);

  // From the slot's first store on, a write fault the volume refuses (btrfs at a qgroup's
  // limit, the pages written back since they were made writable) and still refuses at our
  // deadline jumps back here (io/map_guard.hpp, "A way out"): this commit then ends as if its
  // writer had been killed at that store (settled by whoever meets it next,
  // doc/kv-format.md), and the call fails with what the volume says, or, its block sealed
  // already and made visible, returns its seq. Nothing made from here to the disarm needs a
  // destructor run (what does lives in a scope that holds the escape back); settlers that take a
  // byte lock hold it back too (free_dead_slot).
  io::map_guard::escape way_out;
  volatile std::uint64_t taken = 0;     // the seq, once taken
  volatile std::uint64_t reserved = 0;  // the block's location, once reserved
  const bool escapable = s->writes_refusable.load(std::memory_order_relaxed);
  if (escapable) {
    if (sigsetjmp(way_out.at, 0) != 0) {
      (void)held.unlock();  // (the locks live in memory no volume refuses)
      return s->escaped_commit(lease, charged.s, taken, reserved, d, cd);
    }
    io::map_guard::arm(way_out, std::min(cd.expiry(), s->call_expiry()));
  }
  // Failed before the marks: nothing of the commit is seen (its space, if reserved, is dead,
  // as a writer's that died here). No jump out of here (`e` needs its destructor run): a
  // slot whose page the volume refuses now is given up instead, a dead writer's that every
  // user settles.
  const auto fail_unmarked = [&](const error& e) {
    io::map_guard::disarm();
    // (Written back between the ask and the store, the store escapes, in a frame of its own.)
    const bool idle = s->slot_write_ready(lease.index, false) &&
                      s->stored_escapably(cd, [&] { me.state().store(u64(commit_state::idle)); });
    if (!idle) {
      s->forsake_slot(lease);
      charged.s = nullptr;  // (its charge stays, a dead user's, as escaped_commit leaves it)
    }
    return std::unexpected(e);
  };
  // The slot says *reserved* before the space is taken, with a location at or below the one
  // it will get (the tail only grows): a checkpointer that sees neither the slot nor the
  // tail move knows where replay must start (doc/kv-format.md, "Checkpoints").
  me.block().store(s->h64(header::tail).load(std::memory_order_seq_cst), std::memory_order_seq_cst);
  me.block_length().store(0);
  me.state().store(u64(commit_state::reserved), std::memory_order_seq_cst);
  std::uint64_t location = 0;
  std::span<std::byte> bytes;
  {
    // (Reserving may make a segment or room, under mutexes and locks.)
    const io::map_guard::no_escape held_back;
    auto room = s->reserve(length, only_erases ? room_for::erase : room_for::put);
    if (!room) return fail_unmarked(room.error());
    location = *room;
  }
  reserved = location;
  charged.used = true;
  me.block().store(location);
  me.block_length().store(length);
  commit_step_reached(commit_step::reserved);
  {
    const io::map_guard::no_escape held_back;
    auto at = s->bytes_at(location);
    if (!at) return fail_unmarked(at.error());
    bytes = *at;
  }
  // The block's pages faulted in now, while nobody waits for us: from the seq on, every
  // later commit waits for this one to be visible, and a page fault (a fresh page of the
  // segment, zeroed) would be in that wait. Zeros are what the space holds anyway. Where
  // the volume may refuse the faults, they are asked for writable, and a refusal fails the
  // commit here.
  if (escapable) {
    const io::map_guard::no_escape held_back;  // (for `w`: nothing here stores to a map)
    if (auto w = s->segment_write_ready(location, length); !w) return fail_unmarked(w.error());
  } else {
    // A large block (a transaction of thousands of puts) past what reserve faulted in ahead:
    // the kernel faults its pages in one call, not one trap each (a fifth of the time of a
    // commit of 65 536 puts went to the traps).
    if (length > store::impl::prefault_chunk)
      s->prefault(disk::segment_of(location), disk::offset_of(location), length);
    for (std::uint64_t off = 0; off < length; off += 4096) {
      std::atomic_ref(reinterpret_cast<unsigned char&>(bytes[off]))
          .store(0, std::memory_order_relaxed);
    }
    std::atomic_ref(reinterpret_cast<unsigned char&>(bytes[length - 1]))
        .store(0, std::memory_order_relaxed);
  }

  // 5. Mark: each written key's entry is pending on our block (new keys take an entry).
  std::uint64_t at = location + sizeof(disk::block_header);
  std::size_t ri = 0;
  for (key_plan& k : keys) {
    if (k.w == nullptr) continue;
    k.record_at = at;
    at += disk::record_size(records[ri++]);
    if (!k.entry) {
      // A new key takes an empty entry, or one that holds nothing, pending on our block.
      // Room was made under this lock: an entry is always found.
      k.entry = s->table->claim(k.page, k.h, 0, index::pending | location);
    } else {
      const index::entry_ref e = *k.entry;
      index::change_entry(s->table->page_holding(e), e, [&] {
        e.seq().store(index::pending | location, std::memory_order_release);
      });
    }
  }

  commit_step_reached(commit_step::marked);

  // 6. Sequence.
  me.state().store(u64(commit_state::taking), std::memory_order_seq_cst);
  const std::uint64_t seq = s->h64(header::next_seq).fetch_add(1, std::memory_order_seq_cst);
  taken = seq;
  commit_step_reached(commit_step::took_seq);
  me.seq().store(seq, std::memory_order_seq_cst);
  me.state().store(u64(commit_state::writing), std::memory_order_seq_cst);
  commit_step_reached(commit_step::recorded);

  // 7. Write the block (header last), noting its segment for the next group sync.
  // Sealed last (its seq word, from 0): a waiter that found us too slow to wait for may have
  // abandoned it first (settle_commit); then this commit never happens.
  const bool sealed = s->write_dirty(location, [&] {
    disk::encode_block(bytes.first(length), disk::block_kind::commit, seq, records, s->salt, false);
    return disk::seal_block(bytes, seq);
  });
  if (!sealed) {
    // Every mark goes back (the entries hold what they held); our seq is a hole, made
    // visible by whoever abandoned the block (or by us in order); the block is dead space.
    for (const key_plan& k : keys) {
      if (k.w == nullptr) continue;
      const index::entry_ref e = *k.entry;
      index::change_entry(s->table->page_holding(e), e, [&] {
        e.seq().store(k.prev != 0 ? k.prev_seq : 0, std::memory_order_release);
      });
    }
    s->publish_visible(seq, {0, 0, length}, cd);
    me.state().store(u64(commit_state::idle), std::memory_order_release);
    io::map_guard::disarm();
    return errc_error(std::errc::timed_out);
  }
  commit_step_reached(commit_step::written);

  // 9. Publish: each entry names the new record, then the seq (the pending mark goes last).
  std::int64_t d_records = 0;
  std::int64_t d_live = 0;
  std::uint64_t d_dead = 0;
  ri = 0;
  for (key_plan& k : keys) {
    if (k.w == nullptr) continue;
    const std::uint64_t size =
        disk::record_size(records[ri++]) +
        (k.blob.location != 0 ? disk::blob_block_size(k.w->value.size()) : 0);
    if (k.prev_size != 0) {
      --d_records;
      d_live -= static_cast<std::int64_t>(k.prev_size);
      d_dead += k.prev_size;
    }
    if (k.w->erase) {
      d_dead += size;
    } else {
      ++d_records;
      d_live += static_cast<std::int64_t>(size);
    }
    const index::entry_ref e = *k.entry;
    index::change_entry(s->table->page_holding(e), e, [&] {
      e.location().store(k.record_at, std::memory_order_release);
      e.seq().store(seq, std::memory_order_release);
    });
    if (ri == 1) commit_step_reached(commit_step::published_one);
  }
  commit_step_reached(commit_step::published);

  // 10. Visible, in seq order.
  s->publish_visible(seq, {d_records, d_live, d_dead}, cd);
  commit_step_reached(commit_step::visible);
  me.state().store(u64(commit_state::idle), std::memory_order_release);
  io::map_guard::disarm();
  (void)held.unlock();
  commit_step_reached(commit_step::leaving);
  charged.done();

  // 8. Durable: a sync that starts after every commit up to ours is written covers it.
  if (d == durability::sync) {
    if (auto r = s->group_sync(); !r) return std::unexpected(r.error());
  }
  s->maybe_maintain();
  return seq;
}

#pragma GCC diagnostic pop

transaction::transaction() noexcept = default;
transaction::transaction(std::unique_ptr<impl> p) noexcept : impl_(std::move(p)) {}

}  // namespace keel::kv
