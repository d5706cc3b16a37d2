// Transactions and the commit protocol (doc/kv-format.md, "Committing", "Dead users",
// "Growth").

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

using clock = std::chrono::steady_clock;

constexpr auto u64 = [](auto v) { return static_cast<std::uint64_t>(v); };

void step(commit_step at) noexcept {
  if (commit_hook != nullptr) commit_hook(at);
}

}  // namespace

// ---- Settling what dead writers left ----

bool store::impl::settle_commit(std::uint64_t v, bool abandon_live) noexcept {
  const std::uint64_t next = h64(hdr::next_seq).load(std::memory_order_acquire);
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
    if (!h64(hdr::visible).compare_exchange_strong(expect, v, std::memory_order_acq_rel)) {
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
      (void)fmt::void_block(*block);
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
      const std::uint64_t was = fmt::void_block(*block);
      if (was != 0 && was != fmt::void_seq) return false;
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

void store::impl::wait_visible(std::uint64_t seq, const io::countdown& cd) noexcept {
  auto visible = h64(hdr::visible);
  if (visible.load(std::memory_order_acquire) >= seq) return;
  // The commits in front already hold their seqs and are past waiting for anybody: a spin
  // usually sees them through. Not when more wait than there are CPUs: the spinners would
  // take the CPUs those commits need.
  static const unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
  if (h64(hdr::visible_waiters).load(std::memory_order_relaxed) < cpus &&
      base::spin_until([&] { return visible.load(std::memory_order_acquire) >= seq; },
                       std::chrono::microseconds(50))) {
    return;
  }
  // Asleep on the gate of our seq: *visible* moves by one at a time, and each step wakes only
  // the waiters of its own gate (with a thousand writers queued, waking all of them at every
  // commit would cost more than the commits). The sleep is bounded: the commit in front may
  // be a dead writer's, which nobody else settles; the bound grows while it is alive. Once
  // the caller's deadline has passed, a writer in front that is alive and has not made its
  // commit visible is not waited for any more either: its commit is settled as its block
  // says (settle_commit), so no call waits much past options::lock_timeout for a writer
  // that is stopped.
  std::uint32_t* const word = visible_gate(seq);
  const std::atomic_ref<std::uint32_t> gate(*word);
  auto waiters = h64(hdr::visible_waiters);
  auto interval = std::chrono::milliseconds(2);
  auto last_check = clock::now();
  for (;;) {
    const std::uint32_t g = gate.load(std::memory_order_seq_cst);
    if (visible.load(std::memory_order_seq_cst) >= seq) return;
    waiters.fetch_add(1, std::memory_order_seq_cst);
    if (visible.load(std::memory_order_seq_cst) < seq) {
      base::futex_wait(word, g, interval, base::futex_scope::shared);
    }
    waiters.fetch_sub(1);
    const bool late = cd.expired();
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
  auto word = h64(hdr::dead_check_ns);
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
  h64(hdr::counting).store(seq, std::memory_order_seq_cst);
  h64(hdr::live_records)
      .fetch_add(static_cast<std::uint64_t>(d.records), std::memory_order_seq_cst);
  h64(hdr::live_bytes).fetch_add(static_cast<std::uint64_t>(d.live), std::memory_order_seq_cst);
  h64(hdr::dead_bytes).fetch_add(d.dead, std::memory_order_seq_cst);
  // Made visible already by a waiter that found this writer too slow to wait for, its block
  // sealed (settle_commit): *visible* never goes back. (Its counters then come late.)
  std::uint64_t before = seq - 1;
  if (h64(hdr::visible).compare_exchange_strong(before, seq, std::memory_order_seq_cst)) {
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
  if (!bytes || fmt::block_seq(*bytes) != seq) {
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
  if (h64(hdr::visible).load(std::memory_order_acquire) < seq) {
    return std::unexpected(index_write_refusal());
  }
  // Its segment's dirty bit may never have been set after the block landed (the refusal
  // may have been that very store): synced here, so that no later sync claims it without
  // it being on disk. Failed, the error is the call's (never retried).
  auto seg = segment_at(fmt::segment_of(block));
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
  if (h64(hdr::visible_waiters).load(std::memory_order_seq_cst) != 0) {
    base::futex_wake(word, INT_MAX, base::futex_scope::shared);
  }
}

// ---- Group commit ----

void store::impl::gather_sync_batch() noexcept {
  // A leader that syncs as soon as it can takes only the commits that were quick to come
  // back after the last sync woke them: the rest wait a whole sync more. So when the last
  // batch had company, wait (yielding) until as many have asked again, for at most half a
  // sync's time: a writer gone for good costs a few half-syncs until the batch shrinks.
  const std::uint64_t mark = h64(hdr::sync_mark).load(std::memory_order_relaxed);
  const std::uint64_t want = h64(hdr::sync_batch).load(std::memory_order_relaxed);
  if (want > 1) {
    const auto limit =
        clock::now() + std::min(std::chrono::nanoseconds(h64(hdr::sync_ns).load() / 2),
                                std::chrono::nanoseconds(std::chrono::milliseconds(1)));
    while (h64(hdr::sync_joined).load(std::memory_order_relaxed) - mark < want &&
           clock::now() < limit)
      std::this_thread::yield();
  }
  const std::uint64_t joined = h64(hdr::sync_joined).load(std::memory_order_relaxed);
  h64(hdr::sync_batch).store(joined - mark, std::memory_order_relaxed);
  h64(hdr::sync_mark).store(joined, std::memory_order_relaxed);
}

result<void> store::impl::group_sync(bool every_segment) noexcept {
  return group_sync(every_segment, io::deadline(opts.lock_timeout).start());
}

result<void> store::impl::group_sync(bool every_segment, const io::countdown& cd) noexcept {
  // Its stores to the header escape a write fault the volume still refuses at the deadline
  // (btrfs at a qgroup's limit: io/map_guard.hpp): the call then fails with what the volume
  // says, the commit visible but not known to be durable. A leader that escapes is a dead
  // leader to the next (sync_started ahead of sync_done: it syncs every segment).
  const auto stored = [&](auto&& stores) { return stored_escapably(cd, stores); };
  // Everything this commit depends on is written (every seq up to ours is visible): a sync
  // that starts from now on covers it.
  std::uint64_t s = 0;
  if (!stored([&] {
        h64(hdr::sync_joined).fetch_add(1, std::memory_order_relaxed);
        s = h64(hdr::sync_started).load(std::memory_order_seq_cst);
      })) {
    return std::unexpected(index_write_refusal());
  }
  step(commit_step::sync_waiting);
  auto* const done_word = futex_word(hdr::sync_done);
  for (;;) {
    const std::uint64_t done = h64(hdr::sync_done).load(std::memory_order_acquire);
    if (done > s) break;
    // One leader syncs for everyone waiting. The others do not queue on the lock (handing it
    // on one by one only to find their sync done costs a wake-up each): they sleep until
    // sync_done moves. A leader that dies lets the lock go without waking anyone, so the
    // sleep is short and the lock is tried again.
    auto g = locks->try_lock({lock::entity(entity_sync)});
    if (!g) {
      if (g.error() != std::errc::operation_would_block) return std::unexpected(g.error());
      if (cd.expired()) return sync_without_leader();
      base::futex_wait(done_word, static_cast<std::uint32_t>(done), std::chrono::milliseconds(2),
                       base::futex_scope::shared);
      continue;
    }
    if (h64(hdr::sync_done).load(std::memory_order_acquire) > s) break;
    // A leader whose header stores escaped: gone as a dead one (the lock let go, no wake).
    const auto refused = [&] {
      (void)g->unlock();
      base::futex_wake(done_word, INT_MAX, base::futex_scope::shared);
      return std::unexpected(index_write_refusal());
    };
    clock::time_point began{};
    bool all = false;
    std::uint64_t mine = 0;
    // Each entry whose dirty bit is set, or every entry in use (each segment has an entry of
    // its own: make_segment skips numbers whose entry a live segment holds).
    std::array<std::uint64_t, dirty_words> taken{};
    if (!stored([&] {
          gather_sync_batch();
          began = clock::now();
          // A leader before us that started and never finished died, maybe after clearing
          // dirty words and before syncing: then sync every segment, dirty or not.
          all = every_segment || h64(hdr::sync_started).load() != h64(hdr::sync_done).load();
          mine = h64(hdr::sync_started).fetch_add(1, std::memory_order_seq_cst) + 1;
          for (std::uint64_t w = 0; w < dirty_words; ++w) {
            const auto word = dirty_word(w * 64);
            if (word.load(std::memory_order_seq_cst) != 0)
              taken[w] = word.exchange(0, std::memory_order_seq_cst);
            if (all) taken[w] = ~std::uint64_t{0};
          }
        })) {
      return refused();
    }
    step(commit_step::syncing);
    result<void> r;
    // Bits whose segments are not synced yet: given back if a segment cannot be reached.
    std::array<std::uint64_t, dirty_words> left = taken;
    std::uint64_t failed_segment = 0;
    error unreached;
    for (std::uint64_t w = 0; w < dirty_words && r && !unreached; ++w) {
      for (std::uint64_t bits = taken[w]; bits != 0; bits &= bits - 1) {
        const std::uint64_t bit = bits & (~bits + 1);
        const std::uint64_t i = w * 64 + static_cast<std::uint64_t>(std::countr_zero(bits));
        if (i >= segtab_entries) break;
        const std::uint64_t n = segtab(i, 0).load();
        if (n != 0 && n % segtab_entries == i) {
          auto seg = segment_at(n);
          if (!seg) {
            unreached = seg.error();
            break;
          }
          if (!base::is_planted(base::planted_bug::kv_skips_sync)) r = (*seg)->sync();
          if (!r) {
            failed_segment = n;
            break;
          }
        }
        left[w] &= ~bit;
      }
    }
    if (unreached) {
      // A segment this process cannot reach (EMFILE, ENOMEM mapping it): nothing failed to
      // sync, and the store stays writable. The segments not synced go back to the dirty
      // bitmap, and `done` stays behind `started`, so the next leader (of any process)
      // syncs every segment. This commit, visible, is not known to be durable: its error.
      // (Bits the volume refuses to give back are covered by that too.)
      (void)stored([&] {
        for (std::uint64_t w = 0; w < dirty_words; ++w) {
          if (left[w] != 0) dirty_word(w * 64).fetch_or(left[w], std::memory_order_seq_cst);
        }
      });
      (void)g->unlock();
      base::futex_wake(done_word, INT_MAX, base::futex_scope::shared);
      return std::unexpected(unreached);
    }
    const std::uint64_t sync_errno = r ? 0 : static_cast<std::uint64_t>(r.error().value());
    const auto ns = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - began).count());
    const bool recorded = stored([&] {
      if (sync_errno != 0) {
        // Never retried: the kernel may have dropped the pages it could not write. Every
        // commit of this group and after fails; the store is read-only until reopened alone.
        h64(hdr::sync_error_segment).store(failed_segment);
        h64(hdr::sync_error).store(sync_errno);
      }
      h64(hdr::sync_ns).store(ns);
      h64(hdr::sync_done).store(mine, std::memory_order_release);
    });
    if (!r) {
      // (Not recorded, the failure is this process's alone: its later commits fail, and
      // other users' next leader syncs every segment, sync_done left behind.)
      failed.store(true);
      (void)g->unlock();
      base::futex_wake(done_word, INT_MAX, base::futex_scope::shared);
      return std::unexpected(r.error());
    }
    if (!recorded) return refused();
    (void)g->unlock();
    base::futex_wake(done_word, INT_MAX, base::futex_scope::shared);
  }
  return writable();
}

error store::impl::index_write_refusal() noexcept {
  error why = why_writes_refused(path + "/index");
  if (why == std::errc::bad_address) return error(std::make_error_code(std::errc::timed_out));
  return why;
}

result<void> store::impl::sync_without_leader() noexcept {
  // The leader is too slow to wait for (stopped, or starved of CPU): this commit is already
  // visible, so failing it with timed_out would have its caller retry a commit that went in.
  // It syncs for itself instead, without the lock (a sync covers what was written before it,
  // whoever asks), every segment in use: the leader may hold the dirty bits it took. A
  // failed sync is reported as a leader's is, never retried.
  for (std::uint64_t i = 0; i < segtab_entries; ++i) {
    const std::uint64_t n = segtab(i, 0).load();
    if (n == 0 || n % segtab_entries != i) continue;
    auto seg = segment_at(n);
    if (!seg) return std::unexpected(seg.error());
    if (base::is_planted(base::planted_bug::kv_skips_sync)) continue;
    if (auto r = (*seg)->sync(); !r) {
      h64(hdr::sync_error_segment).store(n);
      h64(hdr::sync_error).store(static_cast<std::uint64_t>(r.error().value()));
      failed.store(true);
      return std::unexpected(r.error());
    }
  }
  return writable();
}

result<void> store::impl::writable() noexcept {
  if (opts.read_only) return keel_error(errc::read_only);
  if (h64(hdr::sync_error).load(std::memory_order_acquire) == 0 && !failed.load()) return {};
  failed.store(true);
  // Which sync failed: its segment, named (the number is written before the errno), or, for
  // 0, the manifest's directory (write_manifest).
  const std::uint64_t n = h64(hdr::sync_error_segment).load();
  if (n == 0) return std::unexpected(error(errc::sync_failed).about(path + "/manifest"));
  return std::unexpected(error(errc::sync_failed).about(path + "/seg/" + segment_name(n)));
}

result<std::uint64_t> store::impl::take_snapshot(slot_lease& lease, slot_use use) noexcept {
  // Without a slot: its byte is held already (slotless_byte).
  if (lease.slotless) return h64(hdr::visible).load(std::memory_order_seq_cst);
  // Published in the slot before it is used, so nothing it reads is reclaimed under it
  // (compaction and page reuse look at every slot's snapshot).
  const slot_ref me = slot(lease.index);
  std::uint64_t snap = 0;
  // (The slot's page was asked for by acquire_slot, but may have been written back since:
  // refused past the call's deadline, the stores escape.)
  if (stored_escapably_by_call([&] {
        // Only this slot's holder writes it: a store, not a locked read-modify-write.
        me.snapshots().store(me.snapshots().load(std::memory_order_relaxed) + 1,
                             std::memory_order_seq_cst);
        snap = h64(hdr::visible).load(std::memory_order_acquire);
        for (;;) {
          me.snapshot().store(snap + 1, std::memory_order_seq_cst);  // 0 means none held
          const std::uint64_t again = h64(hdr::visible).load(std::memory_order_seq_cst);
          if (again == snap) return;
          snap = again;
        }
      })) {
    return snap;
  }
  // Refused: the slot is given up, a dead user's (its snapshot perhaps half published, which
  // every user settles as such), and a call that only reads reads without one.
  forsake_slot(lease);
  if (use == slot_use::writing) return std::unexpected(index_write_refusal());
  auto slotless = take_slotless();
  if (!slotless) return std::unexpected(slotless.error());
  lease = *slotless;
  return h64(hdr::visible).load(std::memory_order_seq_cst);
}

// ---- Growth ----

result<void> store::impl::settle_split(const io::countdown& cd) noexcept {
  for (;;) {
    const ix::split_journal j = table->pending_split();
    if (j.old == 0) return {};
    const std::array<lock::entity, 4> want{lock::entity(entity_directory), lock::entity(j.old),
                                           lock::entity(j.low), lock::entity(j.high)};
    auto g = locks->lock(want, io::deadline(cd.expiry()));
    if (!g) return std::unexpected(g.error());
    // Still the same split (a live splitter finishes its own before it lets go): finish it.
    if (table->pending_split() == j) table->finish_split(*this);
  }
}

result<void> store::impl::grow_page(std::uint64_t page, const fmt::key_hash& h,
                                    std::span<const fmt::key_hash> coming, std::size_t wanted,
                                    const io::countdown& cd) noexcept {
  for (;;) {
    if (auto r = settle_split(cd); !r) return r;
    const std::array<lock::entity, 2> want{lock::entity(page), lock::entity(entity_directory)};
    auto g = locks->lock(want, io::deadline(cd.expiry()));
    if (!g) return std::unexpected(g.error());
    if (table->pending_split().old != 0) continue;  // a splitter died since: finish it first
    // Split by someone else meanwhile: the key is routed elsewhere now.
    if (table->page_of(h) != page) return {};
    if (table->has_room(page, wanted)) return {};  // grown by someone else meanwhile
    // A split that separates nothing (keys of one hash) would only double the directory:
    // the page's chain gets a page more instead.
    if (table->split_separates(page, coming)) return table->split(page, *this);
    return table->add_overflow(page, *this);
  }
}

// ---- Transactions ----

result<bool> transaction::impl::contains(std::string_view key) noexcept {
  if (auto k = check_key(key); !k) return std::unexpected(k.error());
  if (lease.generation != base::fork_generation()) return errc_error(std::errc::invalid_argument);
  if (auto w = writes.find(key); w != writes.end()) return !w->second.erase;
  try {
    reads.emplace(key);
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  const auto kb = as_bytes(key);
  auto r = s->read_at_snapshot(kb, s->hash_of(kb), snapshot, false);
  if (!r) return std::unexpected(r.error());
  return r->has_value();
}

result<std::span<const std::byte>> transaction::impl::view(std::string_view key) noexcept {
  if (auto k = check_key(key); !k) return std::unexpected(k.error());
  // Begun before a fork: its snapshot is held by the parent's slot, not ours.
  if (lease.generation != base::fork_generation()) return errc_error(std::errc::invalid_argument);
  if (auto w = writes.find(key); w != writes.end()) {
    if (w->second.erase) return keel_error(errc::not_found);
    return as_bytes(w->second.value);
  }
  try {
    reads.emplace(key);
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  const auto kb = as_bytes(key);
  auto r = s->read_at_snapshot(kb, s->hash_of(kb), snapshot, s->opts.verify_checksums);
  if (!r) return std::unexpected(r.error());
  if (!*r) return keel_error(errc::not_found);
  return s->value_of(**r, s->opts.verify_checksums);
}

namespace {

// One key of a commit as it goes through the protocol.
struct key_plan {
  std::string_view key;
  fmt::key_hash h{};
  const transaction::impl::write* w = nullptr;  // null: only read
  std::uint64_t page = 0;
  std::optional<ix::entry_ref> entry;  // its entry, if it has one
  std::uint64_t prev = 0;              // the entry's location and seq at validation
  std::uint64_t prev_seq = 0;
  std::uint64_t prev_size = 0;  // bytes of the previous version, 0 if none or an erase
  fmt::blob_ref blob{};
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
  std::uint64_t need = sizeof(fmt::block_header);  // its block and blobs, ideally placed
  // Of that, blobs larger than a segment (each in a segment file of its own, header and all),
  // and what each takes of the room for puts, counted in whole segments less their headers:
  // up to one segment more than its file's size, by rounding.
  std::uint64_t own_segments = 0;
  std::uint64_t own_room = 0;
  std::uint64_t puts = 0;
  std::uint64_t block = sizeof(fmt::block_header);  // the commit block alone
  // The segments made now: a blob larger gets a segment of its own, so that no log segment
  // grows past them for it (a 700 KB blob in a 1 MiB log segment beside 256 KiB ones made
  // the spare 1 MiB, and segments made of the spare after were as large: once another
  // program on the volume took the room a pass gave back, the spare shrank to a 256 KiB
  // victim, the 1 MiB segments could never be copied, and erases failed with no_space).
  const std::uint64_t log_room = s->next_segment_size() - fmt::segment_header_size;
  for (key_plan& k : keys) {
    if (k.w == nullptr) continue;
    fmt::record_in r;
    r.key = as_bytes(k.key);
    if (k.w->erase) {
      r.what = fmt::op::erase;
    } else if (k.w->value.size() >= threshold) {
      r.what = fmt::op::put_blob;
      const std::uint64_t len = fmt::blob_block_size(k.w->value.size());
      need += len;
      const std::uint64_t seg_size = log_room + fmt::segment_header_size;
      if (len > log_room) {
        k.own_segment = true;
        own_segments += len;
        own_room += ((fmt::segment_header_size + len + seg_size - 1) / seg_size + 1) *
                    (seg_size - fmt::segment_header_size);
      }
      has_blobs = true;
    } else {
      r.value = as_bytes(k.w->value);
    }
    puts += k.w->erase ? 0 : 1;
    need += fmt::record_size(r);
    block += fmt::record_size(r);
  }
  // A block never spans two segments: one that cannot fit a segment is too large whatever
  // room is left (before any check of the room, which would call it no_space near full).
  if (block > s->dir.params.segment_size - fmt::segment_header_size) {
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
    const std::uint64_t cost = 2 * (need - own_segments) + own_room + index_pages * fmt::page_size;
    step(commit_step::charging);
    auto c =
        s->charge(lease, static_cast<std::int64_t>(std::min<std::uint64_t>(cost, INT64_MAX)), cd);
    if (!c) return std::unexpected(c.error());
    charged.c = *c;
    charged.who = lease.index;
    charged.lease = &lease;
    charged.cd = &cd;
    charged.s = s;  // last: a hold with no store does nothing
    step(commit_step::charged);
  }
  for (key_plan& k : keys) {
    if (k.w == nullptr || k.w->erase || k.w->value.size() < threshold) continue;
    const auto value = as_bytes(k.w->value);
    const std::uint64_t len = fmt::blob_block_size(value.size());
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
      std::uint64_t size = fmt::segment_header_size + len;
      if (s->log_segment_size(size)) size += fmt::page_size;
      // The rooms as seg/ has them (see next_active_segment).
      if (auto r = s->reconcile_rooms(); !r) return std::unexpected(r.error());
      // (Its last page is allocated whole: counted so under a budget.)
      const std::uint64_t pages = (size + fmt::page_size - 1) / fmt::page_size * fmt::page_size;
      if (auto r = s->ready_for_put(pages, true); !r) return std::unexpected(r.error());
      auto n = s->make_segment(size);
      if (!n) return std::unexpected(n.error());
      at = fmt::make_location(*n, fmt::segment_header_size);
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
              at, [&] { return fmt::encode_blob_block(bytes->first(len), value, s->salt); });
        });
        !w) {
      return std::unexpected(w.error());
    }
    k.blob = {at, sum};
  }

  // 2-4. Lock the keys' pages, check the directory still names them, validate, make room.
  lock::entities_guard held;
  std::vector<fmt::record_in> records;
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
    if (const ix::split_journal j = s->table->pending_split(); j.old != 0) {
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
        const ix::entry_ref e = **found;
        const std::uint64_t at = e.location().load(std::memory_order_acquire);
        // Its header alone: what it says is all a commit over it needs (a damaged value may
        // be overwritten or erased).
        // (Whose header is damaged too: its size is unknown, the counters miss it.)
        auto rec = s->record_head_at(at);
        if (!rec && rec.error() != errc::corrupt) return std::unexpected(rec.error());
        k.entry = e;
        k.prev = at;
        k.prev_seq = e.seq().load(std::memory_order_acquire);
        if (rec && rec->rec.head.op != static_cast<std::uint8_t>(fmt::op::erase)) {
          k.prev_size = fmt::stored_size(rec->rec);
        }
      }
      // Anything newer than the snapshot (visible or not yet) was committed by somebody else.
      // (Still pending: its block could not be read; never build on it.)
      if (k.entry && ((k.prev_seq & ix::pending) != 0 || k.prev_seq > snapshot)) {
        // Not visible yet: wait until it is (settling it if its writer died), so that the
        // retry's snapshot sees it rather than conflicting with it again.
        // (Escapably: settling a dead writer's commit stores to the index.)
        if ((k.prev_seq & ix::pending) == 0 &&
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
      std::size_t wanted = 0;             // its new keys
      std::vector<fmt::key_hash> coming;  // its keys the commit writes
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

  step(commit_step::locked);
  // The block: its records (in the write set's order: nothing reads them by key order).
  try {
    records.reserve(keys.size());
    for (const key_plan& k : keys) {
      if (k.w == nullptr) continue;
      fmt::record_in r;
      r.key = as_bytes(k.key);
      r.prev = k.prev;
      r.prev_seq = k.prev_seq;
      if (k.w->erase) {
        r.what = fmt::op::erase;
      } else if (k.blob.location != 0) {
        r.what = fmt::op::put_blob;
        r.blob = k.blob;
        r.value_length = k.w->value.size();
      } else {
        r.what = fmt::op::put;
        r.value = as_bytes(k.w->value);
      }
      records.push_back(r);
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  const std::uint64_t length = fmt::block_size(records);
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
  me.block().store(s->h64(hdr::tail).load(std::memory_order_seq_cst), std::memory_order_seq_cst);
  me.block_length().store(0);
  me.state().store(u64(commit_state::reserved), std::memory_order_seq_cst);
  std::uint64_t location = 0;
  std::span<std::byte> bytes;
  {
    // (Reserving may make a segment or room, under mutexes and locks.)
    const io::map_guard::no_escape held_back;
    auto L = s->reserve(length, only_erases ? room_for::erase : room_for::put);
    if (!L) return fail_unmarked(L.error());
    location = *L;
  }
  reserved = location;
  charged.used = true;
  me.block().store(location);
  me.block_length().store(length);
  step(commit_step::reserved);
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
      s->prefault(fmt::segment_of(location), fmt::offset_of(location), length);
    for (std::uint64_t off = 0; off < length; off += 4096) {
      std::atomic_ref(reinterpret_cast<unsigned char&>(bytes[off]))
          .store(0, std::memory_order_relaxed);
    }
    std::atomic_ref(reinterpret_cast<unsigned char&>(bytes[length - 1]))
        .store(0, std::memory_order_relaxed);
  }

  // 5. Mark: each written key's entry is pending on our block (new keys take an entry).
  std::uint64_t at = location + sizeof(fmt::block_header);
  std::size_t ri = 0;
  for (key_plan& k : keys) {
    if (k.w == nullptr) continue;
    k.record_at = at;
    at += fmt::record_size(records[ri++]);
    if (!k.entry) {
      // A new key takes an empty entry, or one that holds nothing, pending on our block.
      // Room was made under this lock: an entry is always found.
      k.entry = s->table->claim(k.page, k.h, 0, ix::pending | location);
    } else {
      const ix::entry_ref e = *k.entry;
      ix::change_entry(s->table->page_holding(e), e,
                       [&] { e.seq().store(ix::pending | location, std::memory_order_release); });
    }
  }

  step(commit_step::marked);

  // 6. Sequence.
  me.state().store(u64(commit_state::taking), std::memory_order_seq_cst);
  const std::uint64_t seq = s->h64(hdr::next_seq).fetch_add(1, std::memory_order_seq_cst);
  taken = seq;
  step(commit_step::took_seq);
  me.seq().store(seq, std::memory_order_seq_cst);
  me.state().store(u64(commit_state::writing), std::memory_order_seq_cst);
  step(commit_step::recorded);

  // 7. Write the block (header last), noting its segment for the next group sync.
  // Sealed last (its seq word, from 0): a waiter that found us too slow to wait for may have
  // abandoned it first (settle_commit); then this commit never happens.
  const bool sealed = s->write_dirty(location, [&] {
    fmt::encode_block(bytes.first(length), fmt::block_kind::commit, seq, records, s->salt, false);
    return fmt::seal_block(bytes, seq);
  });
  if (!sealed) {
    // Every mark goes back (the entries hold what they held); our seq is a hole, made
    // visible by whoever abandoned the block (or by us in order); the block is dead space.
    for (const key_plan& k : keys) {
      if (k.w == nullptr) continue;
      const ix::entry_ref e = *k.entry;
      ix::change_entry(s->table->page_holding(e), e, [&] {
        e.seq().store(k.prev != 0 ? k.prev_seq : 0, std::memory_order_release);
      });
    }
    s->publish_visible(seq, {0, 0, length}, cd);
    me.state().store(u64(commit_state::idle), std::memory_order_release);
    io::map_guard::disarm();
    return errc_error(std::errc::timed_out);
  }
  step(commit_step::written);

  // 9. Publish: each entry names the new record, then the seq (the pending mark goes last).
  std::int64_t d_records = 0;
  std::int64_t d_live = 0;
  std::uint64_t d_dead = 0;
  ri = 0;
  for (key_plan& k : keys) {
    if (k.w == nullptr) continue;
    const std::uint64_t size = fmt::record_size(records[ri++]) +
                               (k.blob.location != 0 ? fmt::blob_block_size(k.w->value.size()) : 0);
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
    const ix::entry_ref e = *k.entry;
    ix::change_entry(s->table->page_holding(e), e, [&] {
      e.location().store(k.record_at, std::memory_order_release);
      e.seq().store(seq, std::memory_order_release);
    });
    if (ri == 1) step(commit_step::published_one);
  }
  step(commit_step::published);

  // 10. Visible, in seq order.
  s->publish_visible(seq, {d_records, d_live, d_dead}, cd);
  step(commit_step::visible);
  me.state().store(u64(commit_state::idle), std::memory_order_release);
  io::map_guard::disarm();
  (void)held.unlock();
  step(commit_step::leaving);
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
transaction::transaction(transaction&&) noexcept = default;
transaction& transaction::operator=(transaction&&) noexcept = default;
transaction::~transaction() = default;

result<std::string> transaction::get(std::string_view key) noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  auto v = impl_->view(key);
  if (!v) return std::unexpected(v.error());
  try {
    return std::string(reinterpret_cast<const char*>(v->data()), v->size());
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
}

result<std::span<const std::byte>> transaction::get_view(std::string_view key) noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  return impl_->view(key);
}

result<std::size_t> transaction::get_into(std::string_view key, std::span<std::byte> out) noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  auto v = impl_->view(key);
  if (!v) return std::unexpected(v.error());
  std::memcpy(out.data(), v->data(), std::min(out.size(), v->size()));
  return v->size();
}

result<void> transaction::put(std::string_view key, std::string_view value) noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  if (auto k = check_key(key); !k) return k;
  if (value.size() > max_value_size) return keel_error(errc::too_large);
  if (impl_->s->opts.read_only) return keel_error(errc::read_only);
  if (impl_->scanned) return errc_error(std::errc::invalid_argument);
  try {
    auto& w = impl_->writes[std::string(key)];
    w.erase = false;
    w.value.assign(value);
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return {};
}

result<scan_page> transaction::scan(std::string_view cursor, std::size_t limit,
                                    bool keys_only) noexcept {
  if (!impl_ || !impl_->writes.empty()) return errc_error(std::errc::invalid_argument);
  if (impl_->lease.generation != base::fork_generation()) {
    return errc_error(std::errc::invalid_argument);
  }
  impl_->scanned = true;
  return impl_->s->scan_at(cursor, limit, keys_only, impl_->snapshot);
}

result<void> transaction::erase(std::string_view key) noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  if (auto k = check_key(key); !k) return k;
  if (impl_->s->opts.read_only) return keel_error(errc::read_only);
  if (impl_->scanned) return errc_error(std::errc::invalid_argument);
  try {
    auto& w = impl_->writes[std::string(key)];
    w.erase = true;
    w.value.clear();
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return {};
}

result<std::uint64_t> transaction::commit() noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  return commit(impl_->s->opts.durable);
}

result<std::uint64_t> transaction::commit(durability d) noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  const call_scope call(*impl_->s);
  store::impl& s = *impl_->s;
  // A commit that only erases is tried again after a compaction makes room, as store::erase
  // is (one failed for room changed nothing of the transaction): else, once the deletes' room
  // was spent, every erase in a transaction failed with no_space, and nothing made room. Its
  // snapshot's slot is let go meanwhile (compaction waits for every open transaction, this
  // one too) and taken again after: the commit is judged from the same snapshot (a key
  // committed since by another is a conflict), and reads only what entries name now. One
  // that read keys returns conflict instead, once room is made: retried, it goes in.
  const bool only_erases =
      !impl_->writes.empty() &&
      std::ranges::all_of(impl_->writes, [](const auto& w) { return w.second.erase; });
  auto r = erase_with_room(
      s, [&] { return impl_->commit(d); },
      [&] {
        if (!only_erases || !impl_->lease.held()) return false;
        s.release_slot(impl_->lease);
        impl_->lease = {};
        return true;
      },
      [&]() -> result<void> {
        // One that read keys can no longer be judged from its snapshot: without its slot, the
        // compaction may have forgotten a key it read that was erased since (its entry
        // emptied: nothing left to conflict with), and its commit wrote a skew (two
        // transactions that each read two keys and erased one erased both). It is retried
        // from a new snapshot by its caller, in the room made.
        if (!impl_->reads.empty()) return keel_error(errc::conflict);
        auto lease = s.acquire_slot(slot_use::writing);
        if (!lease) return std::unexpected(lease.error());
        impl_->lease = *lease;
        auto snap = s.take_snapshot(impl_->lease, slot_use::writing);
        if (!snap) {
          impl_->lease = {};  // (given up already)
          return std::unexpected(snap.error());
        }
        return {};
      });
  impl_.reset();
  return r;
}

void transaction::abort() noexcept {
  impl_.reset();
}

std::uint64_t transaction::snapshot() const noexcept {
  return impl_ ? impl_->snapshot : 0;
}

}  // namespace keel::kv
