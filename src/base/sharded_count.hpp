#pragma once
// A count of things in progress that many threads add to and take from at a high rate, and
// that someone rarely waits to see at zero (aio's requests in flight, per controller and per
// file). One atomic would be one cache line that every submitting thread takes from every
// other, twice a request: on a host where that costs 100 ns it was a third of a small
// request's time. Here each thread adds on a line of its own (its shard), and a thing is
// taken from the shard it was added to (the caller keeps the shard), so no shard ever goes
// below zero.
//
// Waiting for zero: the waiter first sets its flag (seq_cst), then reads `sum()`. A thing
// added before that flag was set and not yet taken is in its shard when the waiter reads
// it, so a sum of 0 means that all of those were taken; a thing added after the flag must
// see the flag and end without being waited for, exactly as with one atomic. A taker that
// empties its shard and sees the flag bumps `turns` after its take and wakes the waiter, who
// reads `turns` before summing: it never sleeps through the last take.

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "base/futex.hpp"

namespace keel::base {

class sharded_count {
 public:
  static constexpr unsigned shards = 16;

  //! The calling thread's shard: threads take turns over the shards in the order they first
  //! ask, so that threads started together land on different lines.
  static unsigned shard_of_this_thread() noexcept {
    static std::atomic<unsigned> next{0};
    thread_local const unsigned mine = next.fetch_add(1, std::memory_order_relaxed) % shards;
    return mine;
  }

  void add(unsigned shard, std::uint64_t n) noexcept { slots_[shard].v.fetch_add(n); }
  //! Takes `n` added to `shard` earlier: whether that emptied the shard. Then, when the
  //! waiter's flag is set, call `wake()` (the take that brings the sum to 0 empties its own
  //! shard, as every shard is 0 then; one that leaves its shard above 0 cannot be the last).
  [[nodiscard]] bool take(unsigned shard, std::uint64_t n) noexcept {
    return slots_[shard].v.fetch_sub(n) == n;
  }
  //! Wakes a waiter (after a take that may have been the last).
  void wake() noexcept {
    turns_.fetch_add(1);
    futex_wake(turns_);
  }

  //! What was added and not taken, as seen shard by shard.
  [[nodiscard]] std::uint64_t sum() const noexcept {
    std::uint64_t s = 0;
    for (const slot& x : slots_)
      s += x.v.load();
    return s;
  }

  //! Waits until the sum is 0; the caller set its flag before (see above).
  void wait_for_zero() noexcept {
    for (;;) {
      const std::uint32_t t = turns_.load();
      if (sum() == 0) return;
      futex_wait(turns_, t, nullptr);
    }
  }
  //! The same, calling `help()` (whether it did something) before each sleep, and sleeping
  //! at most `tick` at a time (negative: no limit): for a waiter that may itself hold what
  //! the count waits for.
  template <class Help>
  void wait_for_zero(Help&& help, std::chrono::nanoseconds tick) noexcept {
    for (;;) {
      const std::uint32_t t = turns_.load();
      if (sum() == 0) return;
      if (help()) continue;
      futex_wait(detail::word_of(turns_), t, tick);
    }
  }

 private:
  struct alignas(64) slot {
    std::atomic<std::uint64_t> v{0};
  };
  std::array<slot, shards> slots_{};
  alignas(64) std::atomic<std::uint32_t> turns_{0};
};

}  // namespace keel::base
