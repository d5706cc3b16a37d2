#include "slot_table.hpp"

#include <algorithm>
#include <ctime>

#include "base/futex.hpp"
#include "base/spin.hpp"

namespace keel::lock::memory_map_detail {

std::atomic<hand_on_hook> test_hand_on_hook{nullptr};

namespace {

void reached(hand_on_point p, std::size_t slot, std::uint32_t target) noexcept {
  if (const hand_on_hook h = test_hand_on_hook.load(std::memory_order_relaxed); h != nullptr) {
    h(p, slot, target);
  }
}

bool is_waiting(const slot_ref& s, std::uint32_t u) noexcept {
  return (s.waiters(u / 64).load() & (std::uint64_t{1} << (u % 64))) != 0;
}

// The one reader in `s`, or no_slot when there is none or more than one.
std::uint32_t sole_reader(const slot_ref& s) noexcept {
  std::uint32_t found = no_slot;
  for (std::size_t w = 0; w < bitset_words; ++w) {
    const std::uint64_t bits = s.readers(w).load();
    if (bits == 0) continue;
    if (found != no_slot || (bits & (bits - 1)) != 0) return no_slot;
    found = static_cast<std::uint32_t>(w * 64 + __builtin_ctzll(bits));
  }
  return found;
}

}  // namespace

std::uint32_t slot_ref::writer_user() const noexcept {
  const std::uint64_t w = writer().load() & ~granted;
  return w == 0 ? no_slot : static_cast<std::uint32_t>(w - 1);
}

std::uint64_t slot_ref::waiter_total() const noexcept {
  std::uint64_t n = 0;
  for (std::size_t w = 0; w < bitset_words; ++w)
    n += static_cast<std::uint64_t>(__builtin_popcountll(waiters(w).load()));
  return n;
}

bool slot_ref::other_readers_slow(std::uint32_t u) const noexcept {
  for (std::size_t w = 0; w < bitset_words; ++w) {
    std::uint64_t bits = readers(w).load();
    if (w == u / 64) bits &= ~(std::uint64_t{1} << (u % 64));
    if (bits != 0) return true;
  }
  return false;
}

std::uint64_t monotonic_ns() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000 +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

std::span<slot_request> collect_slots(std::span<const entity> sorted,
                                      std::array<slot_request, 16>& small,
                                      std::vector<slot_request>& big) {
  if (sorted.size() == 1) {  // the common case, without the merging loop
    small[0] = {static_cast<std::uint32_t>(slot_of(sorted[0].value)), sorted[0].is_exclusive()};
    return std::span(small.data(), 1);
  }
  std::size_t n = 0;
  if (sorted.size() <= small.size()) {
    // A few: each against those kept so far.
    for (const entity e : sorted) {
      const auto s = static_cast<std::uint32_t>(slot_of(e.value));
      bool merged = false;
      for (std::size_t k = 0; k < n; ++k) {
        if (small[k].slot == s) {
          small[k].exclusive |= e.is_exclusive();
          merged = true;
          break;
        }
      }
      if (!merged) small[n++] = {s, e.is_exclusive()};
    }
    return std::span(small.data(), n);
  }
  // Many: sorted by slot and merged where adjacent. Each against all kept so far cost a
  // transaction of 65 536 keys (a lock call of as many index pages) about 2^28 compares,
  // and loading in such transactions ran at half the rate per put of single puts. (The
  // order is free: a lock call takes all its slots or gives back those it took.)
  big.resize(sorted.size());
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    big[i] = {static_cast<std::uint32_t>(slot_of(sorted[i].value)), sorted[i].is_exclusive()};
  }
  std::ranges::sort(big, {}, &slot_request::slot);
  for (const slot_request& r : big) {
    if (n != 0 && big[n - 1].slot == r.slot) {
      big[n - 1].exclusive |= r.exclusive;
    } else {
      big[n++] = r;
    }
  }
  return std::span(big.data(), n);
}

void slot_table::wake(std::uint32_t u) const noexcept {
  wake_word(u).fetch_add(1);
  base::futex_wake(&user(u)->wake, 1, base::futex_scope::shared);
}

std::uint32_t slot_table::next_waiter(const slot_ref& s, std::uint32_t from) noexcept {
  const std::uint32_t start = (from + 1) % max_users;
  const std::uint64_t from_start = ~std::uint64_t{0} << (start % 64);
  for (std::size_t k = 0; k <= bitset_words; ++k) {
    const std::size_t w = (start / 64 + k) % bitset_words;
    std::uint64_t bits = s.waiters(w).load();
    if (k == 0) bits &= from_start;
    if (k == bitset_words) bits &= ~from_start;  // the wrap-around: before `start`
    if (w == from / 64) bits &= ~(std::uint64_t{1} << (from % 64));
    if (bits != 0) return static_cast<std::uint32_t>(w * 64 + __builtin_ctzll(bits));
  }
  return no_slot;
}

void slot_table::hand_on_to_waiters(std::size_t i, std::uint32_t from) const noexcept {
  const slot_ref s = slot(i);
  const auto slot_index = static_cast<std::uint32_t>(i);
  const auto wants_it_exclusive = [&](std::uint32_t u) {
    return wants_word(u).load() == (slot_index | wants_exclusive);
  };
  // A target woken to compete that turned out to have left already: choose again (it may
  // have left after its own hand_on saw our mark and woke nobody). Bounded: waiters that
  // keep coming and going are left to their own timers.
  for (int round = 0; round < 4; ++round) {
    if (!s.has_waiters()) {
      // Nobody: clear the hint, then look again, as a sleeper may have set its bit between
      // the look and the clear (its own store of the hint may have come first).
      std::uint64_t set = 1;
      s.maybe_waiters().compare_exchange_strong(set, 0);
      if (!s.has_waiters()) return;
      s.maybe_waiters().store(1);
    }
    if (s.writer().load() != 0) return;  // taken (or granted) again: its holder hands on
    std::uint32_t target = no_slot;
    if (s.other_readers(no_slot)) {
      // Readers in: the last one out hands on, unless the one reader left waits for the slot
      // exclusively itself (an upgrade from shared): then it goes next.
      const std::uint32_t r = sole_reader(s);
      if (r == no_slot || r >= max_users || !is_waiting(s, r) || !wants_it_exclusive(r)) return;
      target = r;
    } else {
      target = next_waiter(s, from);
      if (target == no_slot) return;
    }
    if (!wants_it_exclusive(target)) {
      // Shared sleepers: all woken to take their bits.
      for (std::size_t w = 0; w < bitset_words; ++w) {
        std::uint64_t bits = s.waiters(w).load();
        while (bits != 0) {
          const auto u = static_cast<std::uint32_t>(w * 64 + __builtin_ctzll(bits));
          bits &= bits - 1;
          if (!wants_it_exclusive(u)) wake(u);
        }
      }
      return;
    }
    reached(hand_on_point::chose_exclusive_target, i, target);
    const std::uint64_t since =
        std::atomic_ref<std::uint64_t>(user(target)->waiting_since_ns).load();
    if (monotonic_ns() - since >= hand_over_after_ns) {
      std::uint64_t expected = 0;
      if (!s.writer().compare_exchange_strong(expected, (target + 1) | granted)) return;
      reached(hand_on_point::made_grant, i, target);
      // The target may have given up meanwhile: then the grant is withdrawn, by it or here
      // (only an uncollected grant matches, never the lock it became).
      if (!is_waiting(s, target)) {
        withdraw_grant(i, target);
        return;
      }
      wake(target);
      return;
    }
    // Not waited long: wake it to compete, unless a woken sleeper is on its way already
    // (one wake-up per round, not one per release).
    std::uint64_t none = 0;
    if (!s.woken().compare_exchange_strong(none, target + 1)) return;
    // Set after the target left, the mark would never be cleared, and no release would wake
    // a sleeper of this slot again: take it back and choose again.
    if (!is_waiting(s, target)) {
      std::uint64_t mark = target + 1;
      s.woken().compare_exchange_strong(mark, 0);
      from = target;
      continue;
    }
    wake(target);
    return;
  }
}

bool slot_table::withdraw_grant(std::size_t i, std::uint32_t u) const noexcept {
  std::uint64_t grant = (u + 1) | granted;
  if (!slot(i).writer().compare_exchange_strong(grant, 0)) return false;
  hand_on(i, u);
  return true;
}

bool slot_table::drop_orphans(std::size_t i) const noexcept {
  const slot_ref s = slot(i);
  bool dropped = false;
  // Only an uncollected grant matches withdraw_grant's compare-and-swap: if the target
  // collects it first (its lock), it stays.
  if (const std::uint64_t w = s.writer().load(); (w & granted) != 0) {
    const auto u = static_cast<std::uint32_t>((w & ~granted) - 1);
    if (u < max_users && !is_waiting(s, u)) dropped |= withdraw_grant(i, u);
  }
  if (std::uint64_t mark = s.woken().load(); mark != 0) {
    const bool orphan = mark > max_users || !is_waiting(s, static_cast<std::uint32_t>(mark - 1));
    if (orphan && s.woken().compare_exchange_strong(mark, 0)) {
      // The wake-up it held back.
      hand_on(i, mark <= max_users ? static_cast<std::uint32_t>(mark - 1) : 0);
      dropped = true;
    }
  }
  return dropped;
}

void slot_table::clear_user_in(std::size_t i, std::uint32_t u) const noexcept {
  const slot_ref s = slot(i);
  const std::uint64_t bit = std::uint64_t{1} << (u % 64);
  s.waiters(u / 64).fetch_and(~bit);
  std::uint64_t was_woken = u + 1;
  s.woken().compare_exchange_strong(was_woken, 0);
  std::uint64_t spinning = u + 1;
  s.spinner().compare_exchange_strong(spinning, 0);
  std::uint64_t held = u + 1;
  std::uint64_t grant = (u + 1) | granted;
  bool freed =
      s.writer().compare_exchange_strong(held, 0) || s.writer().compare_exchange_strong(grant, 0);
  freed |= (s.readers(u / 64).fetch_and(~bit) & bit) != 0;
  if (freed) hand_on(i, u);
}

bool slot_table::take(slot_user& me, const slot_request& r) const noexcept {
  const slot_ref s = slot(r.slot);
  const std::uint32_t u = me.index;
  if (r.exclusive) {
    std::uint32_t& held = me.exclusive_holds[r.slot];
    if (held != 0) {
      ++held;
      return true;
    }
    std::uint64_t expected = 0;
    if (!s.writer().compare_exchange_strong(expected, u + 1)) {
      // Granted to us by the last holder: collect it (unless it is withdrawn first). A word
      // naming us already (a hold this thread's counts lost track of) is ours too.
      if (expected == ((u + 1) | granted)) {
        if (!s.writer().compare_exchange_strong(expected, u + 1)) return false;
      } else if (expected != u + 1) {
        return false;
      }
    }
    if (s.other_readers(u)) {
      s.writer().store(0);
      hand_on(r.slot, u);
      return false;
    }
    ++held;
    return true;
  }
  std::uint32_t& held = me.shared_holds[r.slot];
  if (held != 0) {
    ++held;
    return true;
  }
  const std::uint64_t bit = std::uint64_t{1} << (u % 64);
  s.readers(u / 64).fetch_or(bit);
  const std::uint64_t w = s.writer().load();
  if (w == 0 || (w == u + 1 && me.exclusive_holds[r.slot] != 0)) {
    ++held;
    return true;
  }
  s.readers(u / 64).fetch_and(~bit);
  hand_on(r.slot, u);  // our bit may have turned a writer away
  return false;
}

void slot_table::give(slot_user& me, const slot_request& r) const noexcept {
  const slot_ref s = slot(r.slot);
  if (r.exclusive) {
    if (--me.exclusive_holds[r.slot] != 0) return;
    s.writer().store(0);  // seq_cst: published before the waiter count is read
  } else {
    if (--me.shared_holds[r.slot] != 0) return;
    s.readers(me.index / 64).fetch_and(~(std::uint64_t{1} << (me.index % 64)));
  }
  hand_on(r.slot, me.index);
}

bool slot_table::spin_for(slot_user& me, const slot_request& r,
                          const io::countdown& cd) const noexcept {
  using std::chrono::nanoseconds;
  constexpr std::uint64_t least = 1'000, most = 200'000, initial = 20'000;
  const slot_ref s = slot(r.slot);
  if (s.maybe_waiters().load() != 0) return false;
  std::uint64_t none = 0;
  if (!s.spinner().compare_exchange_strong(none, me.index + 1)) return false;
  // The budget lives in the shared map: bound what is read, not only what is written, or a
  // word damaged by another process (or a build with other bounds) spins for hours.
  std::uint64_t budget = s.spin_budget_ns().load(std::memory_order_relaxed);
  budget = budget == 0 ? initial : std::clamp(budget, least, most);
  const auto until = std::chrono::steady_clock::now() + nanoseconds(budget);
  bool got = false;
  for (unsigned i = 1;; ++i) {
    const std::uint64_t w = s.writer().load(std::memory_order_relaxed);
    if ((w == 0 || (w & ~granted) == me.index + 1) && take(me, r)) {
      got = true;
      break;
    }
    base::cpu_relax();
    if (i % 16 == 0) {
      if (s.maybe_waiters().load(std::memory_order_relaxed) != 0) break;
      const auto now = std::chrono::steady_clock::now();
      if (now >= until || (!cd.is_infinite() && now >= cd.expiry())) break;
    }
  }
  s.spin_budget_ns().store(base::next_spin_budget(budget, got, least, most),
                           std::memory_order_relaxed);
  s.spinner().store(0);
  return got;
}

bool slot_table::marks_of(std::span<const std::uint32_t> users) const noexcept {
  for (std::size_t i = 0; i < slots; ++i) {
    const slot_ref s = slot(i);
    const std::uint64_t w = s.writer().load() & ~granted;
    for (const std::uint32_t u : users) {
      if (w == u + 1) return true;
      if ((s.readers(u / 64).load() & (std::uint64_t{1} << (u % 64))) != 0) return true;
    }
  }
  return false;
}

}  // namespace keel::lock::memory_map_detail
