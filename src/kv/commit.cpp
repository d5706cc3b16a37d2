// The commit protocol's driver (doc/kv-format.md, "Committing"): the steps of commit_run.hpp in
// order, and the escape from a volume that refuses write faults armed around those that
// store to the maps. A transaction's writes are validated against its snapshot, its block
// reserved and written, its entries marked and published, and the commit made visible in seq
// order (visible.cpp) and, for durability::sync, durable (group_sync.cpp).

#include <csetjmp>

#include "base/fork.hpp"
#include "io/map_guard.hpp"
#include "kv/commit_run.hpp"

namespace keel::kv {

// GCC's -Wclobbered flags locals held across the escape's sigsetjmp below; the run's state
// read after a jump (held, charged.s, taken, reserved) lives in `run`, in memory, the two
// set while the escape is armed volatile.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wclobbered"
result<std::uint64_t> transaction::impl::commit(durability d) noexcept {
  // Begun before a fork: the slot it would commit through is the parent's.
  if (lease.generation != base::fork_generation()) return errc_error(std::errc::invalid_argument);
  if (writes.empty()) return snapshot;  // a reader: serialised at its snapshot
  if (auto w = s->writable(); !w) return std::unexpected(w.error());
  if (!lease.held()) return errc_error(std::errc::invalid_argument);  // (slotless: reads only)
  const io::countdown cd = io::deadline(s->opts.lock_timeout).start();
  commit_run run(*this, d, cd);
  if (auto r = run.plan_keys(); !r) return std::unexpected(r.error());
  // 1. Room, then blobs, before any lock.
  if (auto r = run.size_up(); !r) return std::unexpected(r.error());
  auto charged = run.charge();
  if (!charged && out_of_room(charged.error()) && run.chose_own) {
    // Segments of their own are charged whole segments: where the room is short of that, the
    // log takes the blobs, as a commit short of room did before there were such segments.
    run.blobs_in_log = true;
    if (auto r = run.size_up(); !r) return std::unexpected(r.error());
    charged = run.charge();
  }
  if (!charged) return std::unexpected(charged.error());
  if (auto r = run.write_blobs(); !r) return std::unexpected(r.error());
  // 2-4. Lock the keys' pages, check the directory still names them, validate, make room.
  if (auto r = run.lock_and_validate(); !r) return std::unexpected(r.error());
  if (auto r = run.ready_index_pages(); !r) return std::unexpected(r.error());
  commit_step_reached(commit_step::locked);
  if (auto r = run.build_records(); !r) return std::unexpected(r.error());

  // From the slot's first store on, a write fault the volume refuses (btrfs at a qgroup's
  // limit, the pages written back since they were made writable) and still refuses at our
  // deadline jumps back here (io/map_guard.hpp, "A way out"): this commit then ends as if its
  // writer had been killed at that store (settled by whoever meets it next,
  // doc/kv-format.md), and the call fails with what the volume says, or, its block sealed
  // already and made visible, returns its seq. Nothing made from here to the disarm needs a
  // destructor run (what does lives in a scope that holds the escape back); settlers that take a
  // byte lock hold it back too (free_dead_slot).
  io::map_guard::escape way_out;
  run.escapable = s->writes_refusable.load(std::memory_order_relaxed);
  if (run.escapable) {
    if (sigsetjmp(way_out.at, 0) != 0) {
      (void)run.held.unlock();  // (the locks live in memory no volume refuses)
      return s->escaped_commit(lease, run.charged.s, run.taken, run.reserved, d, cd);
    }
    io::map_guard::arm(way_out, std::min(cd.expiry(), s->call_expiry()));
  }
  // Failed before the marks: no jump out of here (the error needs its destructor run).
  if (auto r = run.reserve_block(); !r) return run.fail_unmarked(r.error());
  run.mark();
  run.take_seq();
  if (!run.write_block()) return run.give_up_marks();
  run.make_visible(run.publish());
  return run.make_durable();
}
#pragma GCC diagnostic pop

transaction::transaction() noexcept = default;
transaction::transaction(std::unique_ptr<impl> p) noexcept : impl_(std::move(p)) {}

}  // namespace keel::kv
