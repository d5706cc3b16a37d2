// Durable commits (doc/kv-format.md, "Committing", durability::sync): one leader syncs the
// files a batch of commits dirtied, its followers wait for its count; a failed sync is
// reported, never retried, and the store turns read-only. Writes the sync words of the index
// header (*sync count*, *sync error*, the dirty bits).

#include <algorithm>
#include <chrono>
#include <thread>

#include "base/futex.hpp"
#include "base/planted.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {
namespace {

using clock = std::chrono::steady_clock;

}  // namespace

void store::impl::gather_sync_batch() noexcept {
  // A leader that syncs as soon as it can takes only the commits that were quick to come
  // back after the last sync woke them: the rest wait a whole sync more. So when the last
  // batch had company, wait (yielding) until as many have asked again, for at most half a
  // sync's time: a writer gone for good costs a few half-syncs until the batch shrinks.
  const std::uint64_t mark = h64(header::sync_mark).load(std::memory_order_relaxed);
  const std::uint64_t want = h64(header::sync_batch).load(std::memory_order_relaxed);
  if (want > 1) {
    const auto limit =
        clock::now() + std::min(std::chrono::nanoseconds(h64(header::sync_ns).load() / 2),
                                std::chrono::nanoseconds(std::chrono::milliseconds(1)));
    while (h64(header::sync_joined).load(std::memory_order_relaxed) - mark < want &&
           clock::now() < limit)
      std::this_thread::yield();
  }
  const std::uint64_t joined = h64(header::sync_joined).load(std::memory_order_relaxed);
  h64(header::sync_batch).store(joined - mark, std::memory_order_relaxed);
  h64(header::sync_mark).store(joined, std::memory_order_relaxed);
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
        h64(header::sync_joined).fetch_add(1, std::memory_order_relaxed);
        s = h64(header::sync_started).load(std::memory_order_seq_cst);
      })) {
    return std::unexpected(index_write_refusal());
  }
  commit_step_reached(commit_step::sync_waiting);
  auto* const done_word = futex_word(header::sync_done);
  for (;;) {
    const std::uint64_t done = h64(header::sync_done).load(std::memory_order_acquire);
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
    if (h64(header::sync_done).load(std::memory_order_acquire) > s) break;
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
          all = every_segment || h64(header::sync_started).load() != h64(header::sync_done).load();
          mine = h64(header::sync_started).fetch_add(1, std::memory_order_seq_cst) + 1;
          for (std::uint64_t w = 0; w < dirty_words; ++w) {
            const auto word = dirty_word(w * 64);
            if (word.load(std::memory_order_seq_cst) != 0)
              taken[w] = word.exchange(0, std::memory_order_seq_cst);
            if (all) taken[w] = ~std::uint64_t{0};
          }
        })) {
      return refused();
    }
    commit_step_reached(commit_step::syncing);
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
        h64(header::sync_error_segment).store(failed_segment);
        h64(header::sync_error).store(sync_errno);
      }
      h64(header::sync_ns).store(ns);
      h64(header::sync_done).store(mine, std::memory_order_release);
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
      h64(header::sync_error_segment).store(n);
      h64(header::sync_error).store(static_cast<std::uint64_t>(r.error().value()));
      failed.store(true);
      return std::unexpected(r.error());
    }
  }
  return writable();
}

result<void> store::impl::writable() noexcept {
  if (opts.read_only) return keel_error(errc::read_only);
  if (h64(header::sync_error).load(std::memory_order_acquire) == 0 && !failed.load()) return {};
  failed.store(true);
  // Which sync failed: its segment, named (the number is written before the errno), or, for
  // 0, the manifest's directory (write_manifest).
  const std::uint64_t n = h64(header::sync_error_segment).load();
  if (n == 0) return std::unexpected(error(errc::sync_failed).about(path + "/manifest"));
  return std::unexpected(error(errc::sync_failed).about(path + "/seg/" + segment_name(n)));
}

}  // namespace keel::kv
