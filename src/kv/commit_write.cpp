// A commit's writing, its keys' pages locked (doc/kv-format.md, "Committing", steps 5 to 10
// and 8): the block's room reserved, the entries marked, the seq taken, the block written
// and sealed, the entries published, the commit made visible in seq order and, for
// durability::sync, durable. See commit_run.hpp: from reserve_block to make_visible these
// run with the escape armed.

#include <algorithm>
#include <atomic>

#include "io/map_guard.hpp"
#include "kv/commit_run.hpp"

namespace keel::kv {
namespace {

constexpr auto u64 = [](auto v) { return static_cast<std::uint64_t>(v); };

}  // namespace

std::unexpected<error> commit_run::fail_unmarked(const error& e) noexcept {
  io::map_guard::disarm();
  const slot_ref slot = me();
  // (Written back between the ask and the store, the store escapes, in a frame of its own.)
  const bool idle = s->slot_write_ready(t.lease.index, false) &&
                    s->stored_escapably(cd, [&] { slot.state().store(u64(commit_state::idle)); });
  if (!idle) {
    s->forsake_slot(t.lease);
    charged.s = nullptr;  // (its charge stays, a dead user's, as escaped_commit leaves it)
  }
  return std::unexpected(e);
}

// The slot says *reserved* before the space is taken, with a location at or below the one
// it will get (the tail only grows): a checkpointer that sees neither the slot nor the
// tail move knows where replay must start (doc/kv-format.md, "Checkpoints"). Then the room,
// and the block's pages faulted in.
result<void> commit_run::reserve_block() noexcept {
  const slot_ref slot = me();
  slot.block().store(s->h64(header::tail).load(std::memory_order_seq_cst),
                     std::memory_order_seq_cst);
  slot.block_length().store(0);
  slot.state().store(u64(commit_state::reserved), std::memory_order_seq_cst);
  {
    // (Reserving may make a segment or room, under mutexes and locks.)
    const io::map_guard::no_escape held_back;
    auto room = s->reserve(length, only_erases ? room_for::erase : room_for::put);
    if (!room) return std::unexpected(room.error());
    location = *room;
  }
  reserved = location;
  charged.used = true;
  slot.block().store(location);
  slot.block_length().store(length);
  commit_step_reached(commit_step::reserved);
  {
    const io::map_guard::no_escape held_back;
    auto at = s->bytes_at(location);
    if (!at) return std::unexpected(at.error());
    bytes = *at;
  }
  // The block's pages faulted in now, while nobody waits for us: from the seq on, every
  // later commit waits for this one to be visible, and a page fault (a fresh page of the
  // segment, zeroed) would be in that wait. Zeros are what the space holds anyway. Where
  // the volume may refuse the faults, they are asked for writable, and a refusal fails the
  // commit here.
  if (escapable) {
    const io::map_guard::no_escape held_back;  // (for `w`: nothing here stores to a map)
    if (auto w = s->segment_write_ready(location, length); !w) return w;
    return {};
  }
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
  return {};
}

// 5. Mark: each written key's entry is pending on our block (new keys take an entry).
void commit_run::mark() noexcept {
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
}

// 6. Sequence.
void commit_run::take_seq() noexcept {
  const slot_ref slot = me();
  slot.state().store(u64(commit_state::taking), std::memory_order_seq_cst);
  seq = s->h64(header::next_seq).fetch_add(1, std::memory_order_seq_cst);
  taken = seq;
  commit_step_reached(commit_step::took_seq);
  slot.seq().store(seq, std::memory_order_seq_cst);
  slot.state().store(u64(commit_state::writing), std::memory_order_seq_cst);
  commit_step_reached(commit_step::recorded);
}

// 7. Write the block (header last), noting its segment for the next group sync.
// Sealed last (its seq word, from 0): a waiter that found us too slow to wait for may have
// abandoned it first (settle_commit); then this commit never happens.
bool commit_run::write_block() noexcept {
  const bool sealed = s->write_dirty(location, [&] {
    disk::encode_block(bytes.first(length), disk::block_kind::commit, seq, records, s->salt, false);
    return disk::seal_block(bytes, seq);
  });
  if (sealed) commit_step_reached(commit_step::written);
  return sealed;
}

result<std::uint64_t> commit_run::give_up_marks() noexcept {
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
  me().state().store(u64(commit_state::idle), std::memory_order_release);
  io::map_guard::disarm();
  return errc_error(std::errc::timed_out);
}

// 9. Publish: each entry names the new record, then the seq (the pending mark goes last).
// Returns what the commit changed in the counters.
store::impl::counter_delta commit_run::publish() noexcept {
  store::impl::counter_delta delta;
  std::size_t ri = 0;
  for (key_plan& k : keys) {
    if (k.w == nullptr) continue;
    const std::uint64_t size =
        disk::record_size(records[ri++]) +
        (k.blob.location != 0 ? disk::blob_block_size(k.w->value.size()) : 0);
    if (k.prev_size != 0) {
      --delta.records;
      delta.live -= static_cast<std::int64_t>(k.prev_size);
      delta.dead += k.prev_size;
    }
    if (k.w->erase) {
      delta.dead += size;
    } else {
      ++delta.records;
      delta.live += static_cast<std::int64_t>(size);
    }
    const index::entry_ref e = *k.entry;
    index::change_entry(s->table->page_holding(e), e, [&] {
      e.location().store(k.record_at, std::memory_order_release);
      e.seq().store(seq, std::memory_order_release);
    });
    if (ri == 1) commit_step_reached(commit_step::published_one);
  }
  commit_step_reached(commit_step::published);
  return delta;
}

// 10. Visible, in seq order; then the slot idle, the escape disarmed, the keys' pages let
// go, the ledger left.
void commit_run::make_visible(const store::impl::counter_delta& delta) noexcept {
  s->publish_visible(seq, delta, cd);
  commit_step_reached(commit_step::visible);
  me().state().store(u64(commit_state::idle), std::memory_order_release);
  io::map_guard::disarm();
  (void)held.unlock();
  commit_step_reached(commit_step::leaving);
  charged.done();
}

// 8. Durable: a sync that starts after every commit up to ours is written covers it.
result<std::uint64_t> commit_run::make_durable() noexcept {
  if (d == durability::sync) {
    if (auto r = s->group_sync(); !r) return std::unexpected(r.error());
  }
  s->maybe_maintain();
  return seq;
}

}  // namespace keel::kv
