#pragma once
// Futex wait and wake: the one place keel sleeps on a word of memory. `shared` words live in
// memory several processes map (FUTEX_WAIT without the PRIVATE flag); private ones are
// cheaper for words of one process.

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>

#include "keel/deadline.hpp"

namespace keel::base {

enum class futex_scope : std::uint8_t { process, shared };

namespace detail {
inline int futex_op(int op, futex_scope scope) noexcept {
  return scope == futex_scope::process ? (op | FUTEX_PRIVATE_FLAG) : op;
}
inline std::uint32_t* word_of(std::atomic<std::uint32_t>& w) noexcept {
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));
  return reinterpret_cast<std::uint32_t*>(&w);
}
}  // namespace detail

//! Wakes up to `n` threads sleeping on `word`.
inline void futex_wake(std::uint32_t* word, int n = INT_MAX,
                       futex_scope scope = futex_scope::process) noexcept {
  ::syscall(SYS_futex, word, detail::futex_op(FUTEX_WAKE, scope), n, nullptr, nullptr, 0);
}
inline void futex_wake(std::atomic<std::uint32_t>& word, int n = INT_MAX,
                       futex_scope scope = futex_scope::process) noexcept {
  futex_wake(detail::word_of(word), n, scope);
}

//! Sleeps while `*word` holds `expected`, at most `for_at_most` (negative: no limit). Spurious
//! returns are possible: callers re-check their condition.
inline void futex_wait(std::uint32_t* word, std::uint32_t expected,
                       std::chrono::nanoseconds for_at_most,
                       futex_scope scope = futex_scope::process) noexcept {
  timespec ts{};
  timespec* timeout = nullptr;
  if (for_at_most.count() >= 0) {
    const auto ns = for_at_most.count();
    ts.tv_sec = static_cast<time_t>(ns / 1'000'000'000);
    ts.tv_nsec = static_cast<long>(ns % 1'000'000'000);
    timeout = &ts;
  }
  ::syscall(SYS_futex, word, detail::futex_op(FUTEX_WAIT, scope), expected, timeout, nullptr, 0);
}

//! The same until `cd` expires (forever when null or infinite).
inline void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected,
                       const countdown* cd, futex_scope scope = futex_scope::process) noexcept {
  const bool forever = cd == nullptr || cd->is_infinite();
  futex_wait(detail::word_of(word), expected,
             forever ? std::chrono::nanoseconds(-1)
                     : std::chrono::duration_cast<std::chrono::nanoseconds>(cd->remaining()),
             scope);
}

}  // namespace keel::base
