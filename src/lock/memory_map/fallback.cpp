// The safe degrade: a user that cannot share the memory marks the lock degraded, and every
// user moves to byte locks on `<path>.fallback`, but only once every user has left the map
// (an exclusive lock on the map-in-use marker proves it), so two holders never coexist.

#include "base/process.hpp"
#include "impl.hpp"
#include "keel/io/byte_lock.hpp"

namespace keel::lock {

bool memory_map::impl::degraded() const noexcept {
  const auto* lv = reinterpret_cast<std::uint64_t*>(lock_view.data() + mm::lockfile_degraded_at);
  if (std::atomic_ref<std::uint64_t>(*const_cast<std::uint64_t*>(lv)).load() != 0) return true;
  if (map.size() == 0) return true;
  return table.degraded_word().load() != 0;
}

void memory_map::impl::release_map_in_use_if_idle() noexcept {
  if (base::self().pid != creator_pid.load()) return;  // the parent's marker, not ours
  const base::lock_guard lock(switch_mutex);
  if (map_in_use_released || !degraded()) return;
  if (map.size() != 0 && table.marks_of(my_users)) return;
  (void)io::unlock_extent(marker, mm::map_in_use_byte, 1);
  map_in_use_released = true;
}

result<void> memory_map::impl::switch_to_fallback(const io::countdown& cd, bool spin) noexcept {
  if (fallback_ready.load(std::memory_order_acquire)) return {};
  detail::backoff pause(spin);
  for (;;) {
    release_map_in_use_if_idle();
    {
      const base::lock_guard lock(switch_mutex);
      if (map_in_use_released || map.size() == 0) break;
    }
    // Another thread of this instance still holds map guards.
    if (!pause.pause(cd)) return detail::contention_error(cd);
  }
  auto t = mine();
  if (!t) return std::unexpected(t.error());
  // Every user on the map holds the marker shared: getting it exclusively proves that all of
  // them have left it (and will use the fallback from now on).
  auto probe = io::lock_extent((*t)->lock_fd, mm::map_in_use_byte, 1, io::lock_kind::exclusive,
                               detail::rest_of(cd));
  if (!probe) return std::unexpected(probe.error());
  (void)probe->unlock();
  fallback_ready.store(true, std::memory_order_release);
  return {};
}

result<void> memory_map::impl::mark_degraded() noexcept {
  const std::uint64_t one = 1;
  if (auto w = marker.write_at(mm::lockfile_degraded_at, std::as_bytes(std::span(&one, 1))); !w) {
    return w;
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
  mm::thread_user& me = **t;
  if (!me.fallback_fd.is_open()) {
    auto f = detail::reopen(*fs, fallback_path, io::open_flags::read_write, fallback_id);
    if (!f) return std::unexpected(f.error());
    me.fallback_fd = std::move(*f);
  }
  if (auto r = detail::lock_entity_bytes(me.fallback_fd, sorted, cd, spin); !r) {
    return std::unexpected(r.error());
  }
  return mm::fallback_token;
}

result<void> memory_map::impl::unlock_on_fallback(std::span<const entity> sorted) noexcept {
  auto t = mine();
  if (!t) return std::unexpected(t.error());
  return detail::unlock_entity_bytes((*t)->fallback_fd, sorted);
}

}  // namespace keel::lock
