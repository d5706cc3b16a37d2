// How commits become visible (doc/kv-format.md, "Committing", "Dead users"): in seq order,
// each writer publishing its own after the ones before it; a waiter that finds the writer in
// front dead settles that writer's commit (whole or absent, by its block) and goes on. Moves
// *visible* of the index header (recovery sets it when it rebuilds).

#include <bitset>
#include <chrono>
#include <thread>

#include "base/futex.hpp"
#include "base/planted.hpp"
#include "base/spin.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {
namespace {

using clock = std::chrono::steady_clock;

constexpr auto u64 = [](auto v) { return static_cast<std::uint64_t>(v); };

}  // namespace

bool store::impl::settle_commit(std::uint64_t v, bool abandon_live) noexcept {
  const std::uint64_t next = h64(header::next_seq).load(std::memory_order_acquire);
  if (v >= next) return false;  // not handed out yet
  // (Nothing here needs a destructor: a commit's escape may leave from a store in here.)
  std::optional<std::uint32_t> owner;
  std::bitset<max_slots> live_takers;
  std::bitset<max_slots> dead_takers;
  for (std::uint32_t u = 0; u < max_slots; ++u) {
    const slot_ref s = slot(u);
    const auto state = s.state().load(std::memory_order_acquire);
    if (state == u64(commit_state::writing) && s.seq().load(std::memory_order_acquire) == v) {
      owner = u;
      break;
    }
    if (state == u64(commit_state::taking)) (slot_owner_dead(u) ? dead_takers : live_takers).set(u);
  }
  std::uint64_t expect = v - 1;
  const auto make_visible = [&] {
    if (!h64(header::visible).compare_exchange_strong(expect, v, std::memory_order_acq_rel)) {
      return false;  // another settler did it (and frees what it may)
    }
    wake_visible(v);
    return true;
  };
  if (owner) {
    const bool dead = slot_owner_dead(*owner);
    if (!dead) {
      if (!abandon_live) return false;
      // Alive, and too slow to wait for (stopped, or starved of CPU past the waiters'
      // deadline): its block is abandoned unless it is sealed already. Sealed, the commit
      // is made (its writer publishes it when it goes on; readers read its block meanwhile);
      // abandoned, it is a hole (its writer finds its seal refused, undoes its marks and
      // fails). Either way v is settled now.
      auto block = bytes_at(slot(*owner).block().load(std::memory_order_acquire));
      if (!block) return false;
      (void)disk::void_block(*block);
      return make_visible();
    }
    // Dead: complete or not, its seq is settled now, holding whatever its block holds (its
    // entries are settled by the next holders of their pages, and readers check its block
    // meanwhile).
    if (make_visible()) free_dead_slot(*owner);
    return true;
  }
  if (live_takers.any()) {
    if (!abandon_live) return false;  // its taker is about to say so
    // One of them took v (or will: each takes a seq from next_seq, above v) and has not
    // written it down. Every one's block is abandoned, so none of their commits happens: v
    // is a hole. One sealed meanwhile went on to write its seq: look again later.
    for (std::uint32_t u = 0; u < max_slots; ++u) {
      if (!live_takers.test(u)) continue;
      auto block = bytes_at(slot(u).block().load(std::memory_order_acquire));
      if (!block) return false;
      const std::uint64_t was = disk::void_block(*block);
      if (was != 0 && was != disk::void_seq) return false;
    }
  } else if (dead_takers.none()) {
    return false;  // its taker is about to say so
  }
  // Nobody claims v and its taker will never write it: a hole.
  if (!make_visible()) return true;
  // A dead taker's seq is below the next seq as of now; once all of those are visible, none
  // is owed any more and its slot can go (free_dead_slot checks).
  for (std::uint32_t u = 0; u < max_slots; ++u) {
    if (dead_takers.test(u)) free_dead_slot(u);
  }
  return true;
}

bool store::impl::wait_visible(std::uint64_t seq, const io::countdown& cd,
                               past_deadline then) noexcept {
  auto visible = h64(header::visible);
  if (visible.load(std::memory_order_acquire) >= seq) return true;
  // The commits in front already hold their seqs and are past waiting for anybody: a spin
  // usually sees them through. Not when more wait than there are CPUs: the spinners would
  // take the CPUs those commits need.
  static const unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
  if (h64(header::visible_waiters).load(std::memory_order_relaxed) < cpus &&
      base::spin_until([&] { return visible.load(std::memory_order_acquire) >= seq; },
                       std::chrono::microseconds(50))) {
    return true;
  }
  // Asleep on the gate of our seq: *visible* moves by one at a time, and each step wakes only
  // the waiters of its own gate (with a thousand writers queued, waking all of them at every
  // commit would cost more than the commits). The sleep is bounded: the commit in front may
  // be a dead writer's, which nobody else settles; the bound grows while it is alive. Once
  // the caller's deadline has passed, a writer in front that is alive and has not made its
  // commit visible is not waited for any more either: its commit is settled as its block
  // says (settle_commit), so no call waits much past options::lock_timeout for a writer
  // that is stopped. Or, where the caller says so, the wait gives up there.
  std::uint32_t* const word = visible_gate(seq);
  const std::atomic_ref<std::uint32_t> gate(*word);
  auto waiters = h64(header::visible_waiters);
  auto interval = std::chrono::milliseconds(2);
  auto last_check = clock::now();
  for (;;) {
    const std::uint32_t g = gate.load(std::memory_order_seq_cst);
    if (visible.load(std::memory_order_seq_cst) >= seq) return true;
    waiters.fetch_add(1, std::memory_order_seq_cst);
    if (visible.load(std::memory_order_seq_cst) < seq) {
      base::futex_wait(word, g, interval, base::futex_scope::shared);
    }
    waiters.fetch_sub(1);
    const bool late = cd.expired();
    if (late && then == past_deadline::give_up) {
      return visible.load(std::memory_order_seq_cst) >= seq;
    }
    if (late || clock::now() - last_check >= interval) {
      last_check = clock::now();
      const std::uint64_t now = visible.load(std::memory_order_acquire);
      if (now < seq && (late ? !settle_commit(now + 1, true)
                             : dead_check_is_taken() || !settle_commit(now + 1, false))) {
        interval = std::min<std::chrono::milliseconds>(2 * interval, std::chrono::milliseconds(64));
      }
      if (late) interval = std::chrono::milliseconds(2);
    }
  }
}

bool store::impl::dead_check_is_taken() noexcept {
  // One waiter asks at a time: each look asks the kernel about writers' locks, and the
  // kernel walks the file's list of them, a thousand long with a thousand users. With a
  // thousand waiters each looking every few milliseconds, that took a fifth of the machine.
  // A time ahead of this clock (another boot's, another time namespace's) is no one's turn.
  auto word = h64(header::dead_check_ns);
  const std::uint64_t t = now_ns();
  std::uint64_t last = word.load(std::memory_order_relaxed);
  if (t - last < 2'000'000) return true;  // (a time ahead of t: a huge difference)
  return !word.compare_exchange_strong(last, t, std::memory_order_relaxed);
}

void store::impl::publish_visible(std::uint64_t seq, counter_delta d,
                                  const io::countdown& cd) noexcept {
  wait_visible(seq - 1, cd);
  // The counters change in the ordered step, marked: a reader that sees *visible* = v
  // before and after reading them, and the mark not past v, read them exactly as of v.
  h64(header::counting).store(seq, std::memory_order_seq_cst);
  h64(header::live_records)
      .fetch_add(static_cast<std::uint64_t>(d.records), std::memory_order_seq_cst);
  h64(header::live_bytes).fetch_add(static_cast<std::uint64_t>(d.live), std::memory_order_seq_cst);
  h64(header::dead_bytes).fetch_add(d.dead, std::memory_order_seq_cst);
  // Made visible already by a waiter that found this writer too slow to wait for, its block
  // sealed (settle_commit): *visible* never goes back. (Its counters then come late.)
  std::uint64_t before = seq - 1;
  if (h64(header::visible).compare_exchange_strong(before, seq, std::memory_order_seq_cst)) {
    wake_visible(seq);
  }
}

result<std::uint64_t> store::impl::escaped_commit(slot_lease& lease, impl*& ledger_hold,
                                                  std::uint64_t seq, std::uint64_t block,
                                                  durability d, const io::countdown& cd) noexcept {
  forsake_slot(lease);
  ledger_hold = nullptr;
  // No seq taken (the block perhaps not even reserved): nothing of it will ever be seen.
  if (seq == 0) return std::unexpected(index_write_refusal());
  auto bytes = bytes_at(block);
  if (!bytes || disk::block_seq(*bytes) != seq) {
    // Not sealed: never will be (only its writer seals it), so it is a hole, and the marks
    // go back as their pages' next holders meet them.
    return std::unexpected(index_write_refusal());
  }
  // Made: visible once settled, which our own wait does at once (the slot's user is dead to
  // it, and the deadline has passed), unless that too meets a refusal; then the next commit
  // of any user settles it. Not visible yet, it is not acknowledged (a read now would not
  // see it, nor this caller's next read): the call fails with what the volume says, as a
  // sync commit whose sync is refused does, the commit perhaps seen later.
  io::map_guard::escape again;
  if (sigsetjmp(again.at, 0) == 0) {
    io::map_guard::arm(again, std::min(cd.expiry(), call_expiry()));
    wait_visible(seq, cd);
    io::map_guard::disarm();
  }
  if (h64(header::visible).load(std::memory_order_acquire) < seq) {
    return std::unexpected(index_write_refusal());
  }
  // Its segment's dirty bit may never have been set after the block landed (the refusal
  // may have been that very store): synced here, so that no later sync claims it without
  // it being on disk. Failed, the error is the call's (never retried).
  auto seg = segment_at(disk::segment_of(block));
  if (!seg) return std::unexpected(seg.error());
  if (auto r = (*seg)->sync(); !r) return std::unexpected(r.error());
  if (d == durability::sync) {
    // (Within what is left of the commit's deadline: nothing.)
    if (auto r = group_sync(false, cd); !r) return std::unexpected(r.error());
  }
  return seq;
}

void store::impl::wake_visible(std::uint64_t seq) noexcept {
  // The gate moves first: a waiter that read it before and *visible* below seq finds it
  // moved and does not sleep.
  std::uint32_t* const word = visible_gate(seq);
  std::atomic_ref(*word).fetch_add(1, std::memory_order_seq_cst);
  if (h64(header::visible_waiters).load(std::memory_order_seq_cst) != 0) {
    base::futex_wake(word, INT_MAX, base::futex_scope::shared);
  }
}

}  // namespace keel::kv
