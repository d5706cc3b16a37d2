#pragma once
// Spinning before sleeping: the one policy keel uses wherever a wait may end in microseconds.

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace keel::base {

//! Tells the CPU this is a spin loop (PAUSE): the sibling hyper-thread runs, power drops.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

//! Spins until `done()` or `budget` passed; returns done(). The clock is read every 32
//! rounds only.
template <class Done>
bool spin_until(Done&& done, std::chrono::nanoseconds budget) noexcept {
  const auto until = std::chrono::steady_clock::now() + budget;
  for (unsigned i = 1;; ++i) {
    if (done()) return true;
    cpu_relax();
    if (i % 32 == 0 && std::chrono::steady_clock::now() >= until) return done();
  }
}

//! The adaptive rule for a spin budget: doubled when spinning won (waits are short: a spin
//! beats a sleep and a wake-up), halved when it ran out (waits are long: sleep at once),
//! kept within [least, most].
[[nodiscard]] constexpr std::uint64_t next_spin_budget(std::uint64_t budget, bool won,
                                                       std::uint64_t least,
                                                       std::uint64_t most) noexcept {
  return won ? std::min(std::max(budget * 2, least), most) : std::max(budget / 2, least);
}

//! A spin budget of one waiter that follows what spinning achieves (next_spin_budget from
//! 1 µs to `most`). Near the bottom, only one wait in 16 still probes with 1 µs, to notice
//! when waits get short again: waits for a device then stop costing a spinning core (on a
//! 2-core machine, the core the I/O needs).
class adaptive_spin {
 public:
  static constexpr std::chrono::nanoseconds most{20'000};

  template <class Done>
  bool spin(Done&& done) noexcept {
    std::chrono::nanoseconds budget = budget_;
    if (budget < std::chrono::nanoseconds(1000)) {
      if (++skipped_ % 16 != 0) return done();
      budget = std::chrono::nanoseconds(1000);
    }
    const bool won = spin_until(done, budget);
    budget_ = won ? std::chrono::nanoseconds(
                        next_spin_budget(static_cast<std::uint64_t>(budget_.count()), true, 1000,
                                         static_cast<std::uint64_t>(most.count())))
                  : budget_ / 2;
    return won;
  }

 private:
  std::chrono::nanoseconds budget_{most};
  unsigned skipped_ = 0;
};

}  // namespace keel::base
