// Users of a map: a thread of an instance registers by taking the first free liveness byte
// (an OFD lock on the map file, held while it lives: the kernel drops it when the process
// dies, a proof of death that cannot lie), and a waiter clears what a dead user left.

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <optional>

#include "base/planted.hpp"
#include "impl.hpp"
#include "io/process.hpp"
#include "keel/io/byte_lock.hpp"

namespace keel::lock {

namespace memory_map_detail {

// Leaving with nothing held (not even a released guard's slots) spares the next user of
// this index the sweep of every slot. A forked child's copy is the parent's: hands off.
thread_user::~thread_user() {
  if (entry == nullptr || pid != io::self().pid) return;
  const auto none = [](const std::vector<std::uint32_t>& v) {
    return std::all_of(v.begin(), v.end(), [](std::uint32_t n) { return n == 0; });
  };
  if (none(exclusive_holds) && none(shared_holds)) {
    std::atomic_ref<std::uint32_t>(entry->clean).store(1);
  }
}

}  // namespace memory_map_detail

result<memory_map_detail::thread_user*> memory_map::impl::mine() noexcept {
  return threads.get<memory_map_detail::thread_user>(
      [&]() -> result<std::unique_ptr<memory_map_detail::thread_user>> {
        auto s = std::make_unique<memory_map_detail::thread_user>();
        auto lf = detail::reopen(*fs, path, io::open_flags::read_write, {dev, ino});
        if (!lf) return std::unexpected(lf.error());
        s->lock_fd = std::move(*lf);
        return s;
      });
}

result<void> memory_map::impl::register_user(memory_map_detail::thread_user& t) noexcept {
  std::optional<base::making_descriptors> making(std::in_place);  // (until map_fd is the state's)
  auto mf = detail::open_lock_file(
      *fs, nullptr, map_path.c_str(), map_path,
      io::open_flags::read_write | io::open_flags::no_follow | io::open_flags::non_blocking);
  if (!mf) return std::unexpected(mf.error());
  t.map_fd = std::move(*mf);
  making.reset();
  const auto tid = static_cast<std::uint32_t>(::syscall(SYS_gettid));
  // Registrants take indexes in turn, so each usually gets the first one it tries.
  const std::size_t start = table.next_user_word().fetch_add(1) % memory_map_detail::max_users;
  for (std::size_t k = 0; k < memory_map_detail::max_users; ++k) {
    const auto u = static_cast<std::uint32_t>((start + k) % memory_map_detail::max_users);
    auto g = io::try_lock_extent(t.map_fd, memory_map_detail::liveness_base + u, 1,
                                 io::lock_kind::exclusive);
    if (!g) {
      if (detail::is_contention(g.error())) continue;
      return std::unexpected(g.error());
    }
    g->release();  // held for as long as this thread's state lives
    memory_map_detail::user_entry* e = table.user(u);
    // A previous user of this index may have died holding slots: clear its marks.
    if (e->pid != 0 && std::atomic_ref<std::uint32_t>(e->clean).load() == 0) {
      for (std::size_t i = 0; i < memory_map_detail::slots; ++i)
        table.clear_user_in(i, u);
    }
    std::atomic_ref<std::uint32_t>(e->clean).store(0);
    // Read by other threads' degrade switches (is it the switching thread?): atomic stores.
    std::atomic_ref<std::uint32_t>(e->pid).store(io::self().pid);
    std::atomic_ref<std::uint32_t>(e->tid).store(tid);
    std::atomic_ref<std::uint64_t>(e->start_time).store(io::self().start_time);
    table.wants_word(u).store(memory_map_detail::no_slot);
    t.exclusive_holds.assign(memory_map_detail::slots, 0);
    t.shared_holds.assign(memory_map_detail::slots, 0);
    {
      const base::lock_guard lock(switch_mutex);
      if (std::find(my_users.begin(), my_users.end(), u) == my_users.end()) my_users.push_back(u);
    }
    t.index = u;
    t.entry = e;
    t.pid = io::self().pid;
    t.registered = true;
    return {};
  }
  return keel_error(errc::too_many_users);
}

// Whether user `u` (not this thread) is dead: its liveness byte is free. If so, clears its
// marks in slot `i` while holding the byte, so no new user can take the index meanwhile.
result<bool> memory_map::impl::recover_if_dead(const memory_map_detail::thread_user& t,
                                               std::uint32_t u, std::size_t i) const noexcept {
  if (u == t.index || u >= memory_map_detail::max_users) return false;
  if (base::is_planted(base::planted_bug::memory_map_skips_recovery)) return false;
  auto g = io::try_lock_extent(t.map_fd, memory_map_detail::liveness_base + u, 1,
                               io::lock_kind::exclusive);
  if (!g) {
    if (detail::is_contention(g.error())) return false;
    return std::unexpected(g.error());
  }
  table.clear_user_in(i, u);
  return true;  // the guard unlocks the byte
}

result<bool> memory_map::impl::recover_blockers(const memory_map_detail::thread_user& t,
                                                std::size_t i) const noexcept {
  const memory_map_detail::slot_ref s = table.slot(i);
  bool any = table.drop_orphans(i);
  if (const std::uint32_t w = s.writer_user(); w != memory_map_detail::no_slot) {
    auto r = recover_if_dead(t, w, i);
    if (!r) return r;
    any |= *r;
  }
  // Readers block a writer; dead sleepers keep the sleeper set busy (no spinning, wake-ups
  // sent to nobody) and, if woken to compete, stop every other wake-up.
  for (std::size_t word = 0; word < memory_map_detail::bitset_words; ++word) {
    std::uint64_t bits = s.readers(word).load() | s.waiters(word).load();
    while (bits != 0) {
      const auto b = static_cast<std::uint32_t>(__builtin_ctzll(bits));
      bits &= bits - 1;
      auto r = recover_if_dead(t, static_cast<std::uint32_t>(word * 64 + b), i);
      if (!r) return r;
      any |= *r;
    }
  }
  // Named in the woken word, it stops every other wake-up; named as the spinner, it stops
  // everyone else spinning.
  for (const std::uint64_t named : {s.woken().load(), s.spinner().load()}) {
    if (named == 0 || named > memory_map_detail::max_users) continue;
    auto r = recover_if_dead(t, static_cast<std::uint32_t>(named - 1), i);
    if (!r) return r;
    any |= *r;
  }
  return any;
}

}  // namespace keel::lock
