// memory_map's lock path: take every slot of a set (all or none), spin a little, then sleep
// on the contended one until it is handed over, looking for dead holders now and then.

#include "keel/lock/memory_map.hpp"

#include <algorithm>
#include <new>
#include <thread>

#include "base/futex.hpp"
#include "base/thread_rng.hpp"
#include "impl.hpp"

namespace keel::lock {
namespace {

// How long a sleeper waits before it looks for dead holders again: its own doubling
// interval, but no less than 5 ms per sleeper on the slot (together they look about 200
// times a second however many they are, not in bursts that would delay the live holder),
// jittered by ±50 % so they spread out.
std::chrono::nanoseconds recovery_pause(std::chrono::milliseconds own,
                                        std::uint64_t sleepers) noexcept {
  const auto base = std::max<std::chrono::nanoseconds>(
      own, std::chrono::milliseconds(5) *
               static_cast<std::int64_t>(std::min<std::uint64_t>(sleepers, 1000)));
  std::uniform_int_distribution<std::int64_t> jitter(base.count() / 2, base.count() * 3 / 2);
  return std::chrono::nanoseconds(jitter(base::thread_rng()));
}

}  // namespace

// A waiter that leaves without the slot passes on what reached it meanwhile: a grant, or the
// wake-up to compete that another sleeper may now need.
void memory_map::impl::give_up_turn(const memory_map_detail::thread_user& me,
                                    const memory_map_detail::slot_request& r) const noexcept {
  if (r.exclusive && me.exclusive_holds[r.slot] == 0 && table.withdraw_grant(r.slot, me.index)) {
    return;
  }
  table.hand_on(r.slot, me.index);
}

// Sleeps until slot `r` is `me`'s (taken), the deadline passes, or the lock degrades.
// Holders that died are looked for every `recovery` (doubling up to 320 ms).
result<memory_map::impl::wait_outcome> memory_map::impl::wait_for(
    memory_map_detail::thread_user& me, const memory_map_detail::slot_request& r,
    const io::countdown& cd, std::chrono::milliseconds& recovery) const noexcept {
  const memory_map_detail::slot_ref s = table.slot(r.slot);
  const std::uint32_t u = me.index;
  const std::uint64_t bit = std::uint64_t{1} << (u % 64);
  std::atomic_ref<std::uint64_t>(table.user(u)->waiting_since_ns)
      .store(memory_map_detail::monotonic_ns());
  table.wants_word(u).store(r.slot | (r.exclusive ? memory_map_detail::wants_exclusive : 0));
  s.waiters(u / 64).fetch_or(bit);
  s.maybe_waiters().store(1);  // after the bit: a releaser that reads it finds us
  const auto leave = [&]() noexcept {
    s.waiters(u / 64).fetch_and(~bit);
    table.wants_word(u).store(memory_map_detail::no_slot);
    std::uint64_t me_woken = u + 1;
    s.woken().compare_exchange_strong(me_woken, 0);
  };
  auto next_recovery =
      std::chrono::steady_clock::now() + recovery_pause(recovery, s.waiter_total());
  for (;;) {
    const std::uint32_t seen = table.wake_word(u).load();
    // Our woken mark goes before we look: one set before `seen` has had its wake-up (we
    // see it in `seen`), and left on while we sleep on it, it would stop every later
    // release from waking any sleeper of this slot.
    std::uint64_t me_woken = u + 1;
    s.woken().compare_exchange_strong(me_woken, 0);
    if (table.take(me, r)) {
      leave();
      return wait_outcome::taken;
    }
    if (degraded() || cd.expired()) {
      leave();
      // Handed the slot as we left: pass it on. Or woken to compete: another may need the
      // wake-up we used.
      give_up_turn(me, r);
      return degraded() ? wait_outcome::degraded : wait_outcome::expired;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_recovery) {
      auto rec = recover_blockers(me, r.slot);
      if (!rec) {
        leave();
        give_up_turn(me, r);
        return std::unexpected(rec.error());
      }
      recovery = std::min(recovery * 2, std::chrono::milliseconds(320));
      next_recovery = now + recovery_pause(recovery, s.waiter_total());
      if (*rec) continue;
    }
    auto nap = std::chrono::duration_cast<std::chrono::nanoseconds>(next_recovery - now);
    if (!cd.is_infinite()) nap = std::min(nap, cd.remaining());
    base::futex_wait(&table.user(u)->wake, seen, std::max(nap, std::chrono::nanoseconds(1000)),
                     base::futex_scope::shared);
  }
}

// On the map: the token for do_unlock; nullopt: the lock degraded, use the fallback.
result<std::optional<std::uint64_t>> memory_map::impl::lock_on_map(std::span<const entity> sorted,
                                                                   const io::countdown& cd,
                                                                   bool spin) noexcept {
  auto t = mine();
  if (!t) return std::unexpected(t.error());
  memory_map_detail::thread_user& me = **t;
  if (!me.registered) {
    if (auto r = register_user(me); !r) return std::unexpected(r.error());
  }
  std::array<memory_map_detail::slot_request, 16> small;  // filled by collect_slots: no zeroing
  try {
    if (sorted.size() > small.size()) me.slots.reserve(sorted.size());
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  // (Within the room reserved: nothing is allocated.)
  const std::span<memory_map_detail::slot_request> want =
      memory_map_detail::collect_slots(sorted, small, me.slots);

  bool spun = false;        // a lock call spins at most once before it sleeps
  bool have_first = false;  // want[0] was handed to us while we slept
  auto recovery = std::chrono::milliseconds(10);
  auto next_recovery = std::chrono::steady_clock::time_point{};
  for (;;) {
    std::size_t k = have_first ? 1 : 0;
    while (k < want.size() && table.take(me, want[k]))
      ++k;
    if (k == want.size() && !degraded()) return reinterpret_cast<std::uint64_t>(&me);
    for (std::size_t j = 0; j < k; ++j)
      table.give(me, want[j]);
    have_first = false;
    if (degraded()) break;  // go and join the others on the fallback
    if (cd.is_zero()) {
      // A try looks for dead holders too (now and then), or a caller that only polls would
      // wait forever after a crash.
      const auto now = std::chrono::steady_clock::now();
      if (now - me.last_try_recovery >= std::chrono::milliseconds(10)) {
        me.last_try_recovery = now;
        auto rec = recover_blockers(me, want[k].slot);
        if (!rec) return std::unexpected(rec.error());
        if (*rec) continue;
      }
      return errc_error(std::errc::operation_would_block);
    }
    // The contended slot first next time, the rest reshuffled.
    std::swap(want[0], want[k]);
    if (want.size() > 2) std::shuffle(want.begin() + 1, want.end(), base::thread_rng());
    if (!spin) {
      if (!spun) {
        spun = true;
        if (table.spin_for(me, want[0], cd)) {
          have_first = true;
          continue;
        }
      }
      auto w = wait_for(me, want[0], cd, recovery);
      if (!w) return std::unexpected(w.error());
      if (*w == wait_outcome::expired) return detail::contention_error(cd);
      if (*w == wait_outcome::taken) have_first = true;
      continue;
    }
    // Spinning: yield between attempts; now and then look for dead holders.
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_recovery) {
      next_recovery = now + std::chrono::milliseconds(10);
      auto rec = recover_blockers(me, want[0].slot);
      if (!rec) return std::unexpected(rec.error());
      if (*rec) continue;
    }
    if (!cd.is_infinite() && cd.expired()) return detail::contention_error(cd);
    std::this_thread::yield();
  }
  release_map_in_use_if_idle();
  if (!cd.is_infinite() && cd.expired()) return detail::contention_error(cd);
  return std::nullopt;
}

std::optional<std::uint64_t> memory_map::impl::take_one_fast(entity e) noexcept {
  if (fallback_ready.load(std::memory_order_acquire)) return std::nullopt;
  // A state of this thread exists only in the process that made it (a forked child starts
  // without), and it is made after ensure_own_process succeeded there: no pid check needed.
  memory_map_detail::thread_user* me = threads.existing<memory_map_detail::thread_user>();
  if (me == nullptr || !me->registered) return std::nullopt;
  const memory_map_detail::slot_request r{
      static_cast<std::uint32_t>(memory_map_detail::slot_of(e.value)), e.is_exclusive()};
  if (!table.take(*me, r)) return std::nullopt;
  // Published (seq_cst), then looked: a degrade that began meanwhile waits for this mark to
  // go, or this thread sees the flag and leaves for the fallback.
  if (degraded()) [[unlikely]] {
    table.give(*me, r);
    return std::nullopt;
  }
  return reinterpret_cast<std::uint64_t>(me);
}

result<std::uint64_t> memory_map::do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                          bool spin) noexcept {
  impl& p = *impl_;
  if (sorted.size() == 1) [[likely]] {
    if (const auto token = p.take_one_fast(sorted[0])) return *token;
  }
  if (auto j = p.ensure_own_process(cd); !j) return std::unexpected(j.error());
  if (!p.fallback_ready.load(std::memory_order_acquire) && !p.degraded()) {
    auto on_map = p.lock_on_map(sorted, cd, spin);
    if (!on_map) {
      if (p.degraded()) p.release_map_in_use_if_idle();
      return std::unexpected(on_map.error());
    }
    if (*on_map) return **on_map;
  }
  // Degraded: the fallback lock, once every user has left the map.
  if (auto s = p.switch_to_fallback(cd, spin); !s) return std::unexpected(s.error());
  return p.lock_on_fallback(sorted, cd, spin);
}

result<void> memory_map::do_unlock(std::span<const entity> sorted, std::uint64_t token) noexcept {
  impl& p = *impl_;
  if (token == memory_map_detail::fallback_token) return p.unlock_on_fallback(sorted);
  // This thread's user (unlocks happen on the locking thread, which keeps its state).
  auto& me = *reinterpret_cast<memory_map_detail::thread_user*>(token);
  if (sorted.size() == 1) [[likely]] {
    p.table.give(me, {static_cast<std::uint32_t>(memory_map_detail::slot_of(sorted[0].value)),
                      sorted[0].is_exclusive()});
    if (p.degraded()) [[unlikely]]
      p.release_map_in_use_if_idle();
    return {};
  }
  std::array<memory_map_detail::slot_request, 16> small;  // filled by collect_slots: no zeroing
  // (In the room the lock call reserved for this set: an unlock allocates nothing.)
  for (const memory_map_detail::slot_request& r :
       memory_map_detail::collect_slots(sorted, small, me.slots))
    p.table.give(me, r);
  if (p.degraded()) p.release_map_in_use_if_idle();
  return {};
}

}  // namespace keel::lock
