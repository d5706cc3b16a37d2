// This process's background maintenance of a store (doc/kv-format.md, "Checkpoints and
// recovery", "Compaction"): the thread a commit starts when a checkpoint or a compaction is
// due (maybe_maintain), and the maintenance byte that one checkpointer or compactor of all
// the store's users holds at a time (take_checkpoint_byte). Changes process_maintenance
// (maintenance.hpp).

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <thread>

#include "kv/store_impl.hpp"

namespace keel::kv {

namespace {

//! The least checkpoint interval by default (options::checkpoint_bytes).
constexpr std::uint64_t default_checkpoint_bytes = std::uint64_t{128} << 20;

}  // namespace

void store::impl::maybe_maintain() noexcept {
  // The flag holds the fork generation (+1) of the process whose thread claimed it: a forked
  // child's copy of its parent's claim is no claim in the child.
  const std::uint64_t mine = base::fork_generation() + 1;
  // seq_cst, like the thread's giving up of the flag and the commits' taking of space: a
  // commit that finds the flag taken is seen by the thread's check after it gives it up.
  if (opts.read_only || failed.load(std::memory_order_relaxed) ||
      maintenance.closing.load(std::memory_order_relaxed) ||
      maintenance.running.load(std::memory_order_seq_cst) == mine) {
    return;
  }
  const std::uint64_t interval =
      opts.checkpoint_bytes != 0
          ? opts.checkpoint_bytes
          : std::max<std::uint64_t>(
                default_checkpoint_bytes,
                h64(header::pages_used).load(std::memory_order_relaxed) * disk::page_size);
  const auto due = [this, interval] {
    const std::uint64_t tail = h64(header::tail).load(std::memory_order_seq_cst);
    // Not again before the log has grown by half the interval since the last one began: a
    // replay start held back by a long commit, or a failure, does not make every commit
    // write one.
    const std::uint64_t attempt = h64(header::checkpoint_attempt).load(std::memory_order_acquire);
    return log_distance(h64(header::checkpoint_from).load(std::memory_order_acquire), tail) >=
               interval &&
           (attempt == 0 || log_distance(attempt, tail) >= interval / 2);
  };
  // (The clock last: most commits find nothing due.)
  if ((!due() && !compaction_due()) ||
      now_ms() < maintenance.busy_until.load(std::memory_order_relaxed)) {
    return;
  }
  base::lock_guard g(maintenance.mutex);
  // The flag is claimed, not set: the thread may claim it back to go on (below).
  if (std::uint64_t seen = maintenance.running.load();
      seen == mine || !maintenance.running.compare_exchange_strong(seen, mine)) {
    return;
  }
  // Off the committing thread: the commit that crossed the mark has returned its result. (One
  // of this process's that was there is done: it gave up the flag last; start joins it.)
  try {
    maintenance.thread.start([this, due, mine] {
      for (;;) {
        // The compaction first: it removes the checkpoint (which may name the records it
        // moves), and the one written next is then a copy of the compacted store.
        if (compaction_due()) compact_in_background();
        // One checkpointer at a time; compaction holds the byte while it works.
        const io::countdown cd = io::deadline(opts.lock_timeout).start();
        bool wrote = false;
        const std::uint64_t from_before = h64(header::checkpoint_from).load();
        if (!due()) {
          // Nothing to write.
        } else if (!take_checkpoint_byte(cd, byte_claim::background)) {
          // Another user's checkpoint, compaction or verify, which checks again when it is
          // done. Not again from this process for a while (not for every commit meanwhile).
          maintenance.busy_until.store(now_ms() + process_maintenance::busy_backoff_ms,
                                       std::memory_order_relaxed);
        } else {
          // (The header's words escapably, where the volume may refuse their page: refused
          // past the deadline, no checkpoint is tried, or its error goes unnoted.)
          const auto note_error = [&](const error& e) {
            (void)stored_escapably(cd, [&] {
              h64(header::checkpoint_error).store(static_cast<std::uint64_t>(e.value()));
            });
          };
          if (due() && stored_escapably(cd, [&] {
                h64(header::checkpoint_attempt)
                    .store(std::max<std::uint64_t>(1, h64(header::tail).load()),
                           std::memory_order_release);
              })) {
            if (auto room = room_for_checkpoint(); !room) {
              note_error(room.error());
            } else if (auto r = checkpoint_locked(cd); !r) {
              // The commits went on; the failure is kept for stats.
              note_error(r.error());
            } else {
              wrote = true;
            }
          }
          release_checkpoint_byte();
        }
        maintenance.running.store(0, std::memory_order_seq_cst);
        // The commits that came while this one worked found the flag taken and went on: if
        // they took the log past the interval again, or made a compaction due, work for them,
        // unless a commit has claimed the flag meanwhile (it starts a thread of its own). Not
        // for a checkpoint when the replay start did not move (a commit in flight holds it
        // back: the next commit tries again), nor once the store is closing.
        const bool checkpoint_again =
            wrote && h64(header::checkpoint_from).load() != from_before && due();
        std::uint64_t idle = 0;
        if (maintenance.closing.load() || (!checkpoint_again && !compaction_due()) ||
            !maintenance.running.compare_exchange_strong(idle, mine)) {
          return;
        }
      }
    });
  } catch (const std::exception&) {
    maintenance.running.store(0);  // no thread to be had: the next commit tries again
  }
}

result<void> store::impl::take_checkpoint_byte(const io::countdown& cd, byte_claim how) noexcept {
  const bool wait = how == byte_claim::wait;
  const auto busy = [] { return errc_error(std::errc::resource_unavailable_try_again); };
  // A waiter says so while it waits: background work that would take the byte from under it
  // again and again (compactions of several processes, one after another) stands aside.
  // (A hint: not from a read-only user, nor where the volume refuses the header's write.)
  auto wanted = h64(header::maintenance_wanted);
  int may_want = -1;  // asked at the first want
  const auto want = [&] {
    if (may_want < 0) {
      may_want = !opts.read_only && write_ready(index_map, base() + header::maintenance_wanted,
                                                sizeof(std::uint64_t), {}, false)
                     ? 1
                     : 0;
    }
    // (A hint: refused past the deadline, no more of them.)
    if (may_want == 1 &&
        !stored_escapably(cd, [&] { wanted.store(now_ns(), std::memory_order_relaxed); })) {
      may_want = 0;
    }
  };
  if (how == byte_claim::background) {
    const std::uint64_t then = wanted.load(std::memory_order_relaxed);
    const std::uint64_t now = now_ns();
    // A time ahead of ours is no waiter's (a hint: the clock is the machine's).
    if (then != 0 && then <= now && now - then < maintenance_yield_ns) return busy();
  }
  // This process's claim first (its threads share the byte's lock), then the byte. A claim
  // left by the parent of a forked child is not a claim in the child.
  const std::uint64_t mine = base::fork_generation() + 1;
  for (;;) {
    std::uint64_t seen = maintenance.byte_holder.load();
    if ((seen == 0 || seen != mine) &&
        maintenance.byte_holder.compare_exchange_strong(seen, mine)) {
      break;
    }
    if (!wait) return busy();
    if (cd.expired()) return errc_error(std::errc::timed_out);
    want();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (;;) {
    result<void> r;
    {
      base::lock_guard g(users.mutex);
      r = ensure_live();
      if (r) r = fs->lock(users.live, checkpoint_byte, 1, io::lock_request::exclusive, false);
    }
    if (r) {
      // A compactor killed in step 7 removed segments without counting its run: their maps
      // here would be read past their files' ends (SIGBUS) by a walk of the segments.
      unmap_removed_segments(true);
      return {};
    }
    const bool held = held_elsewhere(r.error());
    if (!held || !wait || cd.expired()) {
      maintenance.byte_holder.store(0);
      return held && wait ? errc_error(std::errc::timed_out) : r;
    }
    want();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void store::impl::release_checkpoint_byte() noexcept {
  {
    base::lock_guard g(users.mutex);
    if (users.live_is_ours()) {
      (void)fs->lock(users.live, checkpoint_byte, 1, io::lock_request::unlock, false);
    }
  }
  maintenance.byte_holder.store(0);
}

void store::impl::join_maintenance() noexcept {
  base::lock_guard g(maintenance.mutex);
  maintenance.thread.join();
}

}  // namespace keel::kv
