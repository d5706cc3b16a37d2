// The safe degrade: a user that cannot share the memory marks the lock degraded, and every
// user moves to byte locks on `<path>.fallback`, but only once no live user holds a slot of
// the map, so two holders never coexist. The proof is a look at every slot after the flag
// is set: a locker publishes its slot, then reads the flag (seq_cst both), and gives the
// slot back if it is set, so a hold that a look after the flag does not find is one that
// will never be used. Users that hold nothing (idle ones) play no part: nobody waits for them.

#include <sys/syscall.h>
#include <unistd.h>

#include "impl.hpp"
#include "io/process.hpp"
#include "keel/io/byte_lock.hpp"
#include "lock/detail/common.hpp"

namespace keel::lock {

void memory_map::impl::release_map_in_use_if_idle() noexcept {
  if (io::self().pid != creator_pid.load()) return;  // the parent's marker, not ours
  const base::lock_guard lock(switch_mutex);
  if (map_in_use_released || !degraded()) return;
  if (map.size() != 0 && table.marks_of(my_users)) return;
  (void)io::unlock_extent(marker, memory_map_detail::map_in_use_byte, 1);
  map_in_use_released = true;
}

namespace memory_map_detail {

result<map_holders> holders_of(const slot_table& table, const io::file_handle& map_fd,
                               std::uint32_t me) noexcept {
  bool mine_seen = false;
  const io::process_identity& self = io::self();
  const auto tid = static_cast<std::uint32_t>(::syscall(SYS_gettid));
  // Whether user `u`, marked in slot `i`, still lives; a dead one's marks are cleared while
  // its liveness byte is held (so nobody takes the index meanwhile).
  const auto lives = [&](std::uint32_t u, std::size_t i) -> result<bool> {
    if (u >= max_users) return true;  // damaged: wait (a bounded wait, the caller's deadline)
    // This thread's own user on `map_fd`: its liveness byte is held through that very
    // descriptor, so a probe would take it and call it dead.
    if (u == me) {
      mine_seen = true;
      return false;
    }
    auto g = io::try_lock_extent(map_fd, liveness_base + u, 1, io::lock_kind::exclusive);
    if (g) {
      table.clear_user_in(i, u);  // dead (a dead thread of ours whose tid was reused, too)
      return false;
    }
    if (!detail::is_contention(g.error())) return std::unexpected(g.error());
    // Alive: this thread through another instance of the same lock, or another user. An
    // unknown start time (another pid namespace's /proc) tells nobody apart: another user.
    user_entry* e = table.user(u);
    if (self.start_time != 0 && std::atomic_ref<std::uint32_t>(e->tid).load() == tid &&
        std::atomic_ref<std::uint32_t>(e->pid).load() == self.pid &&
        std::atomic_ref<std::uint64_t>(e->start_time).load() == self.start_time) {
      mine_seen = true;
      return false;
    }
    return true;
  };
  for (std::size_t i = 0; i < slots; ++i) {
    const slot_ref s = table.slot(i);
    (void)table.drop_orphans(i);  // a grant nobody waits for holds nothing
    if (const std::uint32_t w = s.writer_user(); w != no_slot) {
      auto live = lives(w, i);
      if (!live) return std::unexpected(live.error());
      if (*live) return map_holders::others;
    }
    for (std::size_t word = 0; word < bitset_words; ++word) {
      std::uint64_t bits = s.readers(word).load();
      while (bits != 0) {
        const auto u = static_cast<std::uint32_t>(word * 64 + __builtin_ctzll(bits));
        bits &= bits - 1;
        auto live = lives(u, i);
        if (!live) return std::unexpected(live.error());
        if (*live) return map_holders::others;
      }
    }
  }
  return mine_seen ? map_holders::only_me : map_holders::none;
}

}  // namespace memory_map_detail

result<void> memory_map::impl::switch_to_fallback(const io::countdown& cd, bool spin) noexcept {
  if (fallback_ready.load(std::memory_order_acquire)) return {};
  release_map_in_use_if_idle();
  auto t = mine();
  if (!t) return std::unexpected(t.error());
  memory_map_detail::thread_user& me = **t;
  // The map to look at: ours, or (an instance that never used it, as a forced degrader) the
  // one the lock file names, if it is visible here.
  const memory_map_detail::slot_table* on = map.size() != 0 ? &table : nullptr;
  io::file_handle their_hold;
  io::mapped_file theirs;
  memory_map_detail::slot_table their_table;
  io::file_handle probe_fd;
  std::string looked_at = map_path;
  if (on == nullptr && lock_view.size() != 0) {  // (unmapped on a network filesystem)
    auto state = memory_map_detail::parse_lock_file(
        std::span(lock_view.data(), memory_map_detail::lockfile_page));
    const bool visible =
        state && !state->blank && !state->map_path.empty() && state->boot_id == io::self().boot_id;
    if (visible) {
      auto m = memory_map_detail::open_map(*fs, state->map_path, their_hold);
      if (m) {
        theirs = std::move(*m);
        their_table = memory_map_detail::slot_table(theirs.data());
        on = &their_table;
        looked_at = state->map_path;
        // The flag goes into their map before the look, as a store that orders before our
        // loads of its slots (the lock file's flag was written by pwrite: no such order).
        their_table.degraded_word().store(1);
      } else if (!memory_map_detail::map_not_ours(m.error())) {
        return std::unexpected(m.error());
      }
    }
  }
  if (on != nullptr) {
    const io::file_handle* fd = &me.map_fd;
    if (!me.map_fd.is_open()) {  // to probe the users' liveness bytes
      auto mf = detail::open_lock_file(
          *fs, nullptr, looked_at.c_str(), looked_at,
          io::open_flags::read_write | io::open_flags::no_follow | io::open_flags::non_blocking);
      if (!mf) return std::unexpected(mf.error());
      probe_fd = std::move(*mf);
      fd = &probe_fd;
    }
    detail::backoff pause(spin);
    for (;;) {
      auto holders = memory_map_detail::holders_of(
          *on, *fd, me.registered && on == &table ? me.index : memory_map_detail::no_slot);
      if (!holders) return std::unexpected(holders.error());
      if (*holders == memory_map_detail::map_holders::none) break;
      if (*holders == memory_map_detail::map_holders::only_me) {
        // This thread holds a map guard: the switch waits for it, and it for the switch.
        return errc_error(std::errc::resource_deadlock_would_occur);
      }
      if (!pause.pause(cd)) return detail::contention_error(cd);
    }
  } else {
    // The map is not visible here (another machine's memory): every user on it holds the
    // map-in-use marker shared, so getting it exclusively proves they all left it. (Idle
    // users there are waited for, within the deadline.)
    auto probe = io::lock_extent(me.lock_fd, memory_map_detail::map_in_use_byte, 1,
                                 io::lock_kind::exclusive, detail::rest_of(cd));
    if (!probe) return std::unexpected(probe.error());
    (void)probe->unlock();
  }
  fallback_ready.store(true, std::memory_order_release);
  return {};
}

result<void> memory_map::impl::mark_degraded() noexcept {
  const std::uint64_t one = 1;
  if (auto w = marker.write_at(memory_map_detail::lockfile_degraded_at,
                               std::as_bytes(std::span(&one, 1)));
      !w) {
    return w;
  }
  // Other clients of a network filesystem read the flag from the server (see open).
  if (shared_filesystem.load()) {
    if (auto s = marker.sync_data(); !s) return s;
  }
  if (map.size() != 0) table.degraded_word().store(1);
  return {};
}

// The fallback is byte_ranges' algorithm on this thread's own descriptor of the fallback
// file, called directly: no second lock object, no guard on the heap.
result<std::uint64_t> memory_map::impl::lock_on_fallback(std::span<const entity> sorted,
                                                         const io::countdown& cd,
                                                         bool spin) noexcept {
  auto t = mine();
  if (!t) return std::unexpected(t.error());
  memory_map_detail::thread_user& me = **t;
  if (!me.fallback_fd.is_open()) {
    const base::making_descriptors making;  // (opened and the state's as one step to a fork)
    auto f = detail::reopen(*fs, fallback_path, io::open_flags::read_write, fallback_id);
    if (!f) return std::unexpected(f.error());
    me.fallback_fd = std::move(*f);
  }
  if (auto r = detail::lock_entity_bytes(me.fallback_fd, sorted, cd, spin); !r) {
    return std::unexpected(r.error());
  }
  return memory_map_detail::fallback_token;
}

result<void> memory_map::impl::unlock_on_fallback(std::span<const entity> sorted) noexcept {
  auto t = mine();
  if (!t) return std::unexpected(t.error());
  return detail::unlock_entity_bytes((*t)->fallback_fd, sorted);
}

}  // namespace keel::lock
