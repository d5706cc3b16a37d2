#include "keel/space/ledger.hpp"

#include <algorithm>
#include <cassert>
#include <limits>

namespace keel::space {

static_assert(static_cast<double>(ledger::max_writers) * ledger::max_amount <
              static_cast<double>(std::numeric_limits<std::int64_t>::max()));

std::atomic_ref<std::uint64_t> ledger::front_word() const noexcept {
  return std::atomic_ref(w_->front);
}
std::atomic_ref<std::uint64_t> ledger::pin(std::size_t who) const noexcept {
  assert(who < writers_ && reinterpret_cast<std::uintptr_t>(pins_) % 8 == 0 && stride_ % 8 == 0 &&
         stride_ >= sizeof(writer_words));
  return std::atomic_ref(reinterpret_cast<writer_words*>(pins_ + who * stride_)->pin);
}
std::atomic_ref<std::int64_t> ledger::cost(std::size_t who) const noexcept {
  return std::atomic_ref(reinterpret_cast<writer_words*>(pins_ + who * stride_)->cost);
}
std::uint64_t ledger::unpin(std::size_t who, std::memory_order order) noexcept {
  // An exchange, not a store: an eviction between the writer's last look and now is seen.
  const std::uint64_t was = pin(who).exchange(0, order);
  if ((was & evicted) != 0) {
    std::atomic_ref(w_->written_off)
        .fetch_sub(cost(who).load(std::memory_order_relaxed), std::memory_order_seq_cst);
  }
  return was;
}
std::atomic_ref<std::int64_t> ledger::balance(std::uint64_t d) const noexcept {
  return std::atomic_ref(w_->balance[d % 2]);
}
std::atomic_ref<std::int64_t> ledger::budget(std::uint64_t d) const noexcept {
  return std::atomic_ref(w_->budget[d % 2]);
}

result<std::optional<charge>> ledger::try_charge(std::size_t who, std::int64_t cost) noexcept {
  if (cost < 0 || cost > max_amount || who >= writers_ ||
      pin(who).load(std::memory_order_relaxed) != 0) {
    return errc_error(std::errc::invalid_argument);
  }
  // The cost first: an evictor that sees the pin reads it.
  this->cost(who).store(cost, std::memory_order_relaxed);
  for (;;) {
    const std::uint64_t d = front_word().load(std::memory_order_seq_cst);
    if (d == 0) return std::nullopt;  // no delta opened yet
    // Pinned, then still the front: the back end, which moves the front on before it reads
    // the pins, sees us inside. Otherwise d may be closed and quiet already: never touch it.
    pin(who).store(d, std::memory_order_seq_cst);
    if (front_word().load(std::memory_order_seq_cst) != d) {
      unpin(who, std::memory_order_seq_cst);
      continue;
    }
    // (Evicted from here on, we may charge words another delta uses by then: that delta
    // counts our cost too, until its next transition, which errs on the safe side.)
    if (balance(d).fetch_sub(cost, std::memory_order_seq_cst) - cost < 0) {
      balance(d).fetch_add(cost, std::memory_order_seq_cst);
      unpin(who, std::memory_order_seq_cst);
      return std::nullopt;
    }
    return charge{d, cost};
  }
}

void ledger::leave(std::size_t who) noexcept {
  // Release: whatever the writer did with its space comes before the back end sees it gone.
  unpin(who, std::memory_order_acq_rel);
}

result<void> ledger::refund(std::size_t who, const charge& c) noexcept {
  // Only the charge the writer holds: another's (or one already given back) would land in
  // whatever delta uses those words now.
  if (who >= writers_ || c.delta == 0) return errc_error(std::errc::invalid_argument);
  const std::uint64_t p = pin(who).load(std::memory_order_seq_cst);
  if (p != c.delta && p != (c.delta | evicted)) return errc_error(std::errc::invalid_argument);
  if (p == c.delta) {
    // Given back while still inside: the delta cannot be quiet, so its words are its own...
    balance(c.delta).fetch_add(c.cost, std::memory_order_seq_cst);
    std::uint64_t expect = c.delta;
    if (pin(who).compare_exchange_strong(expect, 0, std::memory_order_seq_cst)) return {};
    // ...unless we were evicted meanwhile (stopped before the add, say), and the words now
    // serve another delta: taken back before our cost leaves *written off*, which covered
    // the moment it was counted twice.
    balance(c.delta).fetch_sub(c.cost, std::memory_order_seq_cst);
  }
  unpin(who, std::memory_order_seq_cst);
  return {};
}

bool ledger::evict(std::size_t who, std::uint64_t d) noexcept {
  if (who >= writers_ || d == 0) return false;
  std::uint64_t expect = d;
  // Written off before the pin is marked: whoever reads the room after the mark counts it.
  // (If the writer leaves in between, it finds no mark and takes nothing off: done here.)
  const std::int64_t c = cost(who).load(std::memory_order_seq_cst);
  std::atomic_ref(w_->written_off).fetch_add(c, std::memory_order_seq_cst);
  if (pin(who).compare_exchange_strong(expect, d | evicted, std::memory_order_seq_cst)) return true;
  std::atomic_ref(w_->written_off).fetch_sub(c, std::memory_order_seq_cst);
  return false;
}

std::int64_t ledger::written_off() const noexcept {
  return std::max<std::int64_t>(0,
                                std::atomic_ref(w_->written_off).load(std::memory_order_seq_cst));
}

std::uint64_t ledger::front() const noexcept {
  return front_word().load(std::memory_order_seq_cst);
}

std::int64_t ledger::balance() const noexcept {
  return balance(front()).load(std::memory_order_seq_cst);
}

result<std::uint64_t> ledger::transition(std::int64_t provisional) noexcept {
  if (provisional < 0 || provisional > max_amount) {
    return errc_error(std::errc::invalid_argument);
  }
  const std::uint64_t next = front() + 1;
  // next − 2 shares next's words. Quiet, nobody touches them again (see try_charge).
  if (next >= 3 && !quiet(next - 2)) return errc_error(std::errc::resource_unavailable_try_again);
  budget(next).store(provisional, std::memory_order_seq_cst);
  balance(next).store(provisional, std::memory_order_seq_cst);
  front_word().store(next, std::memory_order_seq_cst);
  return next;
}

bool ledger::quiet(std::uint64_t d) const noexcept {
  if (d == 0) return true;
  for (std::size_t who = 0; who < writers_; ++who) {
    if (pin(who).load(std::memory_order_seq_cst) == d) return false;
  }
  return true;
}

std::int64_t ledger::charged(std::uint64_t d) const noexcept {
  if (d == 0) return 0;
  assert(d + 1 >= front());  // older deltas' words are reused
  return budget(d).load(std::memory_order_seq_cst) - balance(d).load(std::memory_order_seq_cst);
}

std::int64_t ledger::budget_of(std::uint64_t d) const noexcept {
  if (d == 0) return 0;
  assert(d + 1 >= front());
  return budget(d).load(std::memory_order_seq_cst);
}

result<void> ledger::correct(std::int64_t exact) noexcept {
  const std::uint64_t f = front();
  const std::int64_t was = budget(f).load(std::memory_order_seq_cst);
  if (f == 0 || exact < was || exact > max_amount) return errc_error(std::errc::invalid_argument);
  // Raising the balance by the difference is, for every writer, the same as having had
  // `exact` from the start: a charge kept before this was kept against less. The budget
  // first: a back end killed in between leaves the balance short, not raised twice when it
  // corrects again.
  budget(f).store(exact, std::memory_order_seq_cst);
  balance(f).fetch_add(exact - was, std::memory_order_seq_cst);
  return {};
}

}  // namespace keel::space
