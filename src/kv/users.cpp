// The users of a store (doc/kv-format.md, "Dead users"): each process's liveness (the open
// byte of `index`, held shared while it uses the store), the user slots of the index's slot
// pages (taken, given back, buried when their owner died) and the snapshots they hold, and
// the registry of this process's open stores that a forked child lets go of. Changes
// process_users (users.hpp: the liveness descriptor, the slots held, the idle-slot cells),
// and takes and gives back the slots (a slot's words are written by its holder too, in
// commit_write.cpp, probe.cpp, index.cpp, compaction_schedule.cpp, checkpoint.cpp and
// open.cpp).

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "base/per_thread.hpp"
#include "base/planted.hpp"
#include "io/process.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {

namespace {

// Every open store of this process, for fork: a child closes its inherited liveness
// descriptors at once, so the parent's slots read as gone the moment the parent is.

base::mutex registry_mutex;
std::vector<store::impl*>& registry() noexcept {
  static std::vector<store::impl*> r;
  return r;
}
// The descriptors openers hold bytes through before they hand them over
// (closed_in_forked_children), under registry_mutex.
std::vector<io::file_handle*>& opening() noexcept {
  static std::vector<io::file_handle*> o;
  return o;
}

void before_fork() KEEL_NO_THREAD_SAFETY_ANALYSIS {
  registry_mutex.lock();
  for (store::impl* s : registry()) {
    // A child must not inherit any of them held (the order is the one threads take them in:
    // the supplier's is held while its thread is joined, which may take the segment map's).
    s->supplier.mutex.lock();
    s->maintenance.mutex.lock();
    s->users.mutex.lock();
    s->mapped.lock_for_fork();
  }
}
void after_fork_parent() KEEL_NO_THREAD_SAFETY_ANALYSIS {
  for (store::impl* s : registry()) {
    s->mapped.unlock_after_fork();
    s->users.mutex.unlock();
    s->maintenance.mutex.unlock();
    s->supplier.mutex.unlock();
  }
  registry_mutex.unlock();
}
void after_fork_child() KEEL_NO_THREAD_SAFETY_ANALYSIS {
  // (The opener is a thread of the parent: nothing in the child hands these over. Closed
  // as the kernel's, not through the filesystem seam, whose locks the opener may have held.)
  for (io::file_handle* f : opening()) {
    if (f->is_open()) ::close(f->release());  // (the seam's locks: above)
  }
  for (store::impl* s : registry()) {
    // The parent's descriptor: closing our copy leaves its locks to the parent alone. Our
    // slots are the parent's, not ours.
    s->users.drop_live();
    s->users.forget_slots();
    s->mapped.unlock_after_fork();
    s->users.mutex.unlock();
    s->maintenance.mutex.unlock();
    s->supplier.mutex.unlock();
  }
  registry_mutex.unlock();
}

void install_fork_handlers() noexcept {
  static const bool once = [] {
    ::pthread_atfork(before_fork, after_fork_parent, after_fork_child);
    return true;
  }();
  (void)once;
}

void unregister_store(store::impl* s) noexcept {
  base::lock_guard g(registry_mutex);
  auto& r = registry();
  r.erase(std::remove(r.begin(), r.end(), s), r.end());
}

}  // namespace

closed_in_forked_children::closed_in_forked_children(io::file_handle& f) noexcept : f_(&f) {
  install_fork_handlers();
  base::lock_guard g(registry_mutex);
  opening().push_back(f_);
}

result<void> closed_in_forked_children::make(
    const std::function<result<io::file_handle>()>& how) noexcept {
  base::lock_guard g(registry_mutex);  // (what a fork's handlers take first)
  auto made = how();
  if (!made) return std::unexpected(made.error());
  *f_ = std::move(*made);
  return {};
}

closed_in_forked_children::~closed_in_forked_children() {
  base::lock_guard g(registry_mutex);
  // Closed here, not after (an open that failed still holds its bytes through it): a child
  // forked once it is off the list must find no copy to keep. (Handed over: nothing to close.)
  (void)f_->close();
  auto& o = opening();
  o.erase(std::remove(o.begin(), o.end(), f_), o.end());
}

void register_store(store::impl* s) noexcept {
  install_fork_handlers();
  base::lock_guard g(registry_mutex);
  registry().push_back(s);
}

store::impl::~impl() {
  const call_scope call(*this);
  maintenance.closing.store(true, std::memory_order_seq_cst);
  join_supplier();
  join_maintenance();
  if (closing_hook != nullptr) closing_hook();
  close_users();
  // Only now: a child forked while this store closed lets go of its descriptors (one of them
  // may hold the open byte exclusively, for the seal above) as of an open store's.
  unregister_store(this);
}

void store::impl::close_users() noexcept {
  base::lock_guard g(users.mutex);
  if (users.live_is_ours() && index_map.data()) {
    // The last user out (its shared hold of the open byte turns exclusive only when nobody
    // else holds it) leaves what it can prove durable in the manifest. Best effort: without
    // it a rebuild only knows less.
    if (!opts.read_only && !failed.load() && h64(header::sync_error).load() == 0 &&
        fs->lock(users.live, open_byte, 1, io::lock_request::exclusive, false)) {
      (void)seal_durable();
    }
    for (std::uint32_t u = 0; u < max_slots; ++u) {
      if (!users.ours[u]) continue;
      // On a volume that refuses writes through the maps (btrfs at its quota) a refused
      // write would kill the process (SIGBUS): a slot it may not write is left as a dead
      // user's, which the next user takes back once its byte is free.
      // (Written back and refused again after that, past lock_timeout: the same.)
      if (slot_write_ready(u)) {
        const slot_ref s = slot(u);
        (void)store_or_refuse([&] {
          s.snapshot().store(0);
          s.pid().store(0, std::memory_order_release);
        });
      }
      (void)fs->lock(users.live, user_byte + u, 1, io::lock_request::unlock, false);
    }
  }
  // Closing `live` drops the open byte (after this process's byte of the store file): the
  // last user out leaves the index as it is (valid, and used as it is by the next opener of
  // this boot).
  users.drop_live();
}

result<void> store::impl::ensure_live(std::uint64_t until) noexcept {
  if (users.live_is_ours()) return {};
  if (users.live.is_open()) {
    // A forked child whose atfork handler did not run (vfork-like paths): never unlock through
    // the parent's description; just stop using it.
    users.drop_live();
  }
  users.free_slots.clear();
  users.ours.fill(false);
  // (A reader with an index of its own reopens that unnamed file through the descriptor a
  // forked child inherited: permission denied to a child of one that dropped its rights.)
  const std::string reopened = "/proc/self/fd/" + std::to_string(index_file.fd());
  auto f = private_index
               ? fs->open(nullptr, reopened.c_str(), io::open_flags::read_write, 0600)
               : io::file_handle::open_at(dir.dir, "index",
                                          io::open_flags::read_write | io::open_flags::no_follow);
  if (!f) return std::unexpected(f.error().about(private_index ? reopened : path + "/index"));
  // Shared on the open byte for as long as this process uses the store: an opener that gets
  // it exclusively knows it is alone.
  if (until == 0) until = now_ms() + static_cast<std::uint64_t>(opts.lock_timeout.count());
  io::file_handle held;  // (none for an index of this process's own)
  if (!private_index) {
    auto h = open_store_hold();
    if (!h) return std::unexpected(h.error());
    held = std::move(*h);
  }
  const done_waiting_for_builds done{*this};
  for (;;) {
    auto r = fs->lock(*f, open_byte, 1, io::lock_request::shared, false);
    // (The index at the path is the one this process maps, or this process's store is gone:
    // one removed, by hand or with its store, and made anew since is another index, which
    // this process's map and what it knew would never see.)
    if (r && !private_index) {
      auto at_path = fs->stat(*f);
      auto in_map = at_path ? fs->stat(index_file) : at_path;
      if (!in_map) return std::unexpected(in_map.error().about(path + "/index"));
      if (!at_path->same_file(*in_map)) {
        return std::unexpected(
            error(std::error_code(ESTALE, std::generic_category())).about(path + "/index"));
      }
    }
    // (A forked child's first call: a private reader may have started since its parent let
    // go, and a lone opener may have rebuilt the index. One that died rebuilding left it cut
    // short, or cut to nothing: an opener alone rebuilds it, which this one waits for, as an
    // opener that is not alone does, rather than read it.)
    if (r && private_index) break;  // (nobody rebuilds another process's index)
    if (r && !waits_for_private_build(*f)) {
      auto valid = index_valid_or_let_go(*f);
      if (!valid) return std::unexpected(valid.error());
      if (*valid) {
        if (auto in = take_presence_byte(held); !in) return in;
        break;
      }
    }
    if (r) r = errc_error(std::errc::operation_would_block);
    if (r.error() != std::errc::operation_would_block &&
        r.error() != std::errc::resource_unavailable_try_again) {
      return std::unexpected(r.error());
    }
    if (now_ms() > until) return errc_error(std::errc::timed_out);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!private_index) {
    if (auto at = index_at_path_is(*f); !at) return at;
  }
  users.adopt(std::move(*f), std::move(held));
  // What this process saw of readers' snapshots may be from before a rebuild, which can
  // start the seqs lower.
  forget_horizon();
  return {};
}

result<void> store::impl::hold_open_byte() noexcept {
  if (users.holds_open_byte()) return {};
  // The call's own deadline, taken before the mutex: the threads of a child that wait for
  // an index to be rebuilt wait together, not one lock_timeout after another.
  const std::uint64_t until = now_ms() + static_cast<std::uint64_t>(opts.lock_timeout.count());
  base::lock_guard g(users.mutex);
  return ensure_live(until);
}

namespace {

// The idle cell a thread tries first: threads spread over the cells in the order they came.
std::size_t my_idle_cell(std::size_t cells) noexcept {
  static std::atomic<std::size_t> next{0};
  thread_local const std::size_t mine = next.fetch_add(1, std::memory_order_relaxed);
  return mine % cells;
}

}  // namespace

result<slot_lease> store::impl::acquire_slot(slot_use use) noexcept {
  // Refused a moment ago: a reader does not ask again at every call (each asking writes a
  // page of a file made for it, to learn why).
  // (The clock is read only once a refusal was seen: a get reads no clock.)
  if (use == slot_use::reading) {
    const std::uint64_t until = users.slots_refused_until_ms.load(std::memory_order_relaxed);
    if (until != 0 && now_ms() < until) return take_slotless();
  }
  // A reader does not wait out a refusal that may be a moment's: it goes on without a slot.
  const bool patient = use == slot_use::writing;
  auto lease = take_slot(patient);
  if (lease) {
    // Every call writes its slot, and the header: where the volume may refuse a write fault,
    // a call that would write fails here instead.
    auto w = slot_write_ready(lease->index, patient);
    if (w) {
      if (slot_ready_hook != nullptr) slot_ready_hook();
      return lease;
    }
    release_slot(*lease);
    lease = std::unexpected(w.error());
  }
  // One that only reads goes on without a slot (a qgroup at its limit takes no write).
  if (use == slot_use::reading &&
      (lease.error() == std::errc::no_space_on_device || lease.error() == std::errc::bad_address ||
       lease.error() == std::error_code(EDQUOT, std::system_category()))) {
    users.slots_refused_until_ms.store(now_ms() + users.slots_refused_ms,
                                       std::memory_order_relaxed);
    return take_slotless();
  }
  return lease;
}

result<slot_lease> store::impl::take_slotless() noexcept {
  if (auto r = hold_open_byte(); !r) return std::unexpected(r.error());
  unmap_removed_segments();  // as take_slot does: maps of segments removed since go first
  base::lock_guard g(users.mutex);
  if (auto r = ensure_live(); !r) return std::unexpected(r.error());
  const std::uint64_t gen = base::fork_generation();
  if (users.slotless_generation != gen) {  // a forked child's count is not its own
    users.slotless_generation = gen;
    users.slotless_readers = 0;
  }
  // (Shared: nobody takes it exclusively, it is only tested; a file lock needs no room.)
  if (users.slotless_readers == 0) {
    if (auto r = fs->lock(users.live, slotless_byte, 1, io::lock_request::shared, false); !r) {
      return std::unexpected(r.error().about(path + "/index"));
    }
  }
  ++users.slotless_readers;
  return slot_lease{max_slots, gen, true};
}

bool store::impl::no_slotless_readers() noexcept {
  // Through the index's own descriptor, not `live`: this process's readers count too.
  auto free = fs->lock_is_free(index_file, slotless_byte, 1, io::lock_request::exclusive);
  return free && *free;
}

result<slot_lease> store::impl::take_slot(bool patient) noexcept {
  if (auto r = hold_open_byte(); !r) return std::unexpected(r.error());
  unmap_removed_segments();
  const std::uint64_t gen = base::fork_generation();
  // The fast way: an idle slot of ours from the cells, without the mutex.
  if (users.idle_generation.load(std::memory_order_acquire) == gen) {
    const std::size_t first = my_idle_cell(process_users::idle_cells);
    for (std::size_t k = 0; k < process_users::idle_cells; ++k) {
      auto& cell = users.idle_slots[(first + k) % process_users::idle_cells].slot;
      if (cell.load(std::memory_order_relaxed) == max_slots) continue;
      const std::uint32_t u = cell.exchange(max_slots, std::memory_order_acquire);
      if (u != max_slots) return slot_lease{u, gen};
    }
  }
  base::lock_guard g(users.mutex);
  if (auto r = ensure_live(); !r) return std::unexpected(r.error());
  if (users.idle_generation.load() != gen) users.forget_idle_slots();  // a forked child's copies
  if (!users.free_slots.empty()) {
    const std::uint32_t u = users.free_slots.back();
    users.free_slots.pop_back();
    return slot_lease{u, gen};
  }
  // A slot taken is written (and a dead user's cleared first): all of them writable now
  // where the volume may refuse it.
  if (auto w = write_ready(index_map, base(),
                           slot_first_page * disk::page_size + max_slots * slot_size, {}, patient);
      !w) {
    return std::unexpected(w.error().about(path + "/index"));
  }
  // Slots their users closed (pid 0) first: with many users open, trying each live one's
  // byte would cost a lock call each, every one a walk of the file's lock list.
  const std::uint32_t start = static_cast<std::uint32_t>(::getpid()) % max_slots;
  for (std::uint32_t k = 0; k < 2 * max_slots; ++k) {
    const std::uint32_t u = (start + k) % max_slots;
    if (users.ours[u]) continue;
    const slot_ref s = slot(u);
    if (k < max_slots && s.pid().load(std::memory_order_acquire) != 0) continue;
    if (!slot_reclaimable(s)) continue;  // in use, or a dead writer's still needed
    auto got = fs->lock(users.live, user_byte + u, 1, io::lock_request::exclusive, false);
    if (!got) {
      if (got.error() == std::errc::operation_would_block ||
          got.error() == std::errc::resource_unavailable_try_again) {
        continue;  // a live user's
      }
      return std::unexpected(got.error());
    }
    // Its byte is ours: whoever had the slot is gone. A dead writer's slot is left to the
    // commits that settle it while they need what it says.
    if (!slot_reclaimable(s)) {
      (void)fs->lock(users.live, user_byte + u, 1, io::lock_request::unlock, false);
      continue;
    }
    // Its page and the header's asked for again now that the byte is ours (the volume may
    // have written them back meanwhile), and stored escapably all the same: refused, the
    // byte goes back and the slot is a dead user's still, as if we had died taking it.
    result<void> taken = slot_write_ready(u, patient);
    if (taken) bury_unsealed(s);
    const std::uint32_t tid = static_cast<std::uint32_t>(::syscall(SYS_gettid));
    if (taken && !stored_escapably(io::deadline(opts.lock_timeout).start(), [&] {
          s.state().store(static_cast<std::uint64_t>(commit_state::idle));
          s.snapshot().store(0);
          s.seq().store(0);
          s.block().store(0);
          s.block_length().store(0);
          // A dead user's charge stays charged (safe); an evicted one's cost is no longer
          // written off.
          if (ledger) {
            ledger->leave(u);
          } else {
            s.ledger_pin().store(0);
          }
          // A user killed while it closed a delta: nobody closes it now.
          if (std::uint64_t closer = h64(header::ledger_closer).load(); (closer >> 32) == u + 1) {
            h64(header::ledger_closer).compare_exchange_strong(closer, 0);
          }
          s.start_time().store(io::self().start_time);
          s.tid().store(tid);
          s.pid().store(static_cast<std::uint32_t>(::getpid()), std::memory_order_release);
        })) {
      taken = std::unexpected(index_write_refusal());
    }
    if (!taken) {
      (void)fs->lock(users.live, user_byte + u, 1, io::lock_request::unlock, false);
      return std::unexpected(taken.error());
    }
    users.ours[u] = true;
    return slot_lease{u, gen};
  }
  return keel_error(errc::too_many_users);
}

void store::impl::release_slot(slot_lease s) noexcept {
  if (s.slotless) {
    base::lock_guard g(users.mutex);
    // (One leased before a fork is the parent's: its byte is held through the parent's.)
    if (s.generation != base::fork_generation() || users.slotless_generation != s.generation ||
        users.slotless_readers == 0) {
      return;
    }
    if (--users.slotless_readers == 0) {
      (void)fs->lock(users.live, slotless_byte, 1, io::lock_request::unlock, false);
    }
    return;
  }
  if (!s.held()) return;
  const std::uint64_t gen = base::fork_generation();
  // A slot leased before a fork is the parent's: the child forgets it and leaves it alone
  // (even if the child has since leased the same slot afresh, after the parent died).
  if (s.generation != gen) return;
  if (s.generation == gen && users.idle_generation.load(std::memory_order_acquire) == gen) {
    // Ours (leased in this generation, so users.ours[s.index] holds): back to a free cell.
    if (!clear_snapshot(s.index)) return forsake_slot(s);
    const std::size_t first = my_idle_cell(process_users::idle_cells);
    for (std::size_t k = 0; k < process_users::idle_cells; ++k) {
      auto& cell = users.idle_slots[(first + k) % process_users::idle_cells].slot;
      std::uint32_t none = max_slots;
      if (cell.load(std::memory_order_relaxed) == max_slots &&
          cell.compare_exchange_strong(none, s.index, std::memory_order_release)) {
        return;
      }
    }
  }
  {
    base::lock_guard g(users.mutex);
    if (users.generation != gen || !users.ours[s.index]) return;
    if (clear_snapshot(s.index)) {
      users.free_slots.push_back(s.index);
      return;
    }
  }
  forsake_slot(s);
}

bool store::impl::clear_snapshot(std::uint32_t u) noexcept {
  // Only the slot's holder writes its snapshot. Not written when there is none: a slot given
  // back because its page could not be made writable (acquire_slot) would fault here.
  const slot_ref me = slot(u);
  if (me.snapshot().load(std::memory_order_relaxed) != 0) {
    // Its page written back since the call began, the volume may refuse the write now (a
    // qgroup at its limit): then the snapshot stays, instead of a SIGBUS, and the caller
    // gives the slot up (forsake_slot): kept, it would hold every compaction back until the
    // slot's next call, which an idle process never makes.
    // (And refused again after that, written back in between, past the deadline: the same.)
    if (!slot_write_ready(u, false)) return false;
    return stored_escapably_by_call([&] { me.snapshot().store(0, std::memory_order_release); });
  }
  return true;
}

bool store::impl::slot_reclaimable(const slot_ref& s) noexcept {
  switch (static_cast<commit_state>(s.state().load(std::memory_order_acquire))) {
    case commit_state::idle:
      return true;
    case commit_state::reserved:
      // No seq taken: the entries it marked are resolved by their pages' holders from its
      // block alone, which will never be complete.
      return true;
    case commit_state::writing:
      // Its seq is settled once visible (by itself before it died, or by a settler).
      return s.seq().load(std::memory_order_acquire) <=
             h64(header::visible).load(std::memory_order_acquire);
    case commit_state::taking:
      // It may have taken a seq it never wrote down; once every seq handed out is visible,
      // that one is settled too (a hole).
      return h64(header::visible).load(std::memory_order_acquire) + 1 >=
             h64(header::next_seq).load(std::memory_order_acquire);
  }
  return false;  // not a state: never touched
}

void store::impl::bury_unsealed(const slot_ref& s) noexcept {
  const auto state = static_cast<commit_state>(s.state().load(std::memory_order_acquire));
  if (state == commit_state::idle) return;
  // Its block is known once its length is (the location is written first).
  const std::uint64_t length = s.block_length().load(std::memory_order_acquire);
  const std::uint64_t at = s.block().load(std::memory_order_acquire);
  if (length == 0 || at == 0) return;
  auto bytes = bytes_at(at);
  // (Its pages asked for, and buried escapably: refused, it is left as not buried.)
  bool buried = false;
  if (!opts.read_only && bytes && segment_write_ready(at, length, false) &&
      store_or_refuse([&] { buried = disk::bury_block(*bytes, length, salt); }) && buried) {
    return;
  }
  if (bytes && disk::block_seq(*bytes) != 0 && disk::block_seq(*bytes) != disk::void_seq) return;
  // Not buried (read-only, or its segment cannot be reached now): no close may record it as
  // durable; the next writable rebuild steps over it above durable below.
  std::uint64_t first = h64(header::unvoided_torn).load();
  (void)store_or_refuse([&] {
    while ((first == 0 || at < first) &&
           !h64(header::unvoided_torn).compare_exchange_weak(first, at)) {
    }
  });
}

void store::impl::free_dead_slot(std::uint32_t u) noexcept {
  // Under its byte, so this never frees a slot someone just took (and no commit's escape
  // may leave with the byte held: io/map_guard.hpp).
  // Its pages writable first (a commit's escape leaves its slot and block to whoever settles
  // them, often while the volume still refuses it): refused, the slot stays a dead user's,
  // reclaimed later, instead of a SIGBUS here.
  as_dead_users_byte(u, [&] {
    const slot_ref s = slot(u);
    if (!slot_write_ready(u, false)) return;
    if (slot_reclaimable(s)) {
      bury_unsealed(s);
      // (Refused again past the deadline, it stays a dead user's, as refused above.)
      (void)stored_escapably(io::deadline(opts.lock_timeout).start(), [&] {
        s.snapshot().store(0);
        s.state().store(static_cast<std::uint64_t>(commit_state::idle), std::memory_order_release);
      });
    }
  });
}

void store::impl::forsake_slot(slot_lease& s) noexcept {
  // Its byte let go and not ours any more: to every user, this process included, the slot's
  // user is dead, and what it holds is settled as a dead writer's. The lease holds nothing.
  if (s.held() && s.generation == base::fork_generation()) {
    base::lock_guard g(users.mutex);
    if (users.generation == s.generation && users.ours[s.index]) {
      users.ours[s.index] = false;
      (void)fs->lock(users.live, user_byte + s.index, 1, io::lock_request::unlock, false);
    }
  }
  s.index = max_slots;
}

bool store::impl::slot_owner_dead(std::uint32_t u) noexcept {
  const io::map_guard::no_escape held_back;
  base::lock_guard g(users.mutex);
  if (!ensure_live()) return false;
  if (users.ours[u]) return false;
  auto is_free = fs->lock_is_free(users.live, user_byte + u, 1, io::lock_request::exclusive);
  return is_free && *is_free;  // unknown: alive
}

result<std::uint64_t> store::impl::take_snapshot(slot_lease& lease, slot_use use) noexcept {
  // Without a slot: its byte is held already (slotless_byte).
  if (lease.slotless) return h64(header::visible).load(std::memory_order_seq_cst);
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
        snap = h64(header::visible).load(std::memory_order_acquire);
        for (;;) {
          me.snapshot().store(snap + 1, std::memory_order_seq_cst);  // 0 means none held
          const std::uint64_t again = h64(header::visible).load(std::memory_order_seq_cst);
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
  return h64(header::visible).load(std::memory_order_seq_cst);
}

}  // namespace keel::kv
