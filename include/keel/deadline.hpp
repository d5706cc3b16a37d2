#pragma once

#include <chrono>
#include <cstdint>
#include <ctime>

namespace keel {

class countdown;

//! When a blocking operation must give up. A value type, cheap to copy.
//!
//! - `deadline{}` / `deadline::never()`: wait as long as it takes.
//! - `deadline::zero()` (or any relative duration <= 0): try once, never block; an operation
//!   that would have had to wait fails with `std::errc::operation_would_block`.
//! - a relative duration: counted from the moment the operation starts (`start()`).
//! - an absolute time on the steady or the system clock: fixed instant; a time already past
//!   still gets one attempt, and then fails with `std::errc::timed_out`.
class deadline {
 public:
  using clock = std::chrono::steady_clock;

  constexpr deadline() noexcept = default;

  template <class Rep, class Period>
  constexpr deadline(std::chrono::duration<Rep, Period> relative) noexcept  // NOLINT: implicit
      : kind_(relative <= relative.zero() ? kind::zero : kind::relative),
        ns_(relative <= relative.zero() ? 0 : saturate(relative)) {}

  constexpr deadline(clock::time_point at) noexcept  // NOLINT: implicit by design
      : kind_(kind::steady), ns_(at.time_since_epoch().count()) {}

  constexpr deadline(std::chrono::system_clock::time_point at) noexcept  // NOLINT: implicit
      : kind_(kind::system),
        ns_(std::chrono::duration_cast<std::chrono::nanoseconds>(at.time_since_epoch()).count()) {}

  [[nodiscard]] static constexpr deadline never() noexcept { return {}; }
  [[nodiscard]] static constexpr deadline zero() noexcept { return deadline(kind::zero, 0); }

  [[nodiscard]] constexpr bool is_infinite() const noexcept { return kind_ == kind::never; }
  [[nodiscard]] constexpr bool is_zero() const noexcept { return kind_ == kind::zero; }

  //! Fixes the deadline to an absolute steady-clock instant, as of now.
  [[nodiscard]] countdown start() const noexcept;

 private:
  [[nodiscard]] countdown start_finite() const noexcept;
  enum class kind : std::uint8_t { never, zero, relative, steady, system };
  constexpr deadline(kind k, std::int64_t ns) noexcept : kind_(k), ns_(ns) {}

  template <class Rep, class Period>
  static constexpr std::int64_t saturate(std::chrono::duration<Rep, Period> d) noexcept {
    // Durations beyond ~292 years do not fit in int64 nanoseconds; they mean "never" anyway.
    using big = std::chrono::duration<long double, std::nano>;
    const auto ns = std::chrono::duration_cast<big>(d).count();
    return ns >= static_cast<long double>(INT64_MAX / 2) ? INT64_MAX / 2
                                                         : static_cast<std::int64_t>(ns);
  }

  kind kind_ = kind::never;
  std::int64_t ns_ = 0;
  friend class countdown;
};

//! A deadline fixed to an absolute steady-clock instant. Obtained from `deadline::start()`
//! at the beginning of an operation, then asked how much time is left as it goes.
class countdown {
 public:
  using clock = std::chrono::steady_clock;

  [[nodiscard]] bool is_infinite() const noexcept { return infinite_; }
  //! True when the deadline was zero: the caller asked to try once and never wait.
  [[nodiscard]] bool is_zero() const noexcept { return zero_; }
  [[nodiscard]] bool expired() const noexcept {
    return !infinite_ && (zero_ || clock::now() >= expiry_);
  }
  //! Time left, never negative; `clock::duration::max()` when infinite.
  [[nodiscard]] clock::duration remaining() const noexcept;
  [[nodiscard]] clock::time_point expiry() const noexcept { return expiry_; }
  //! The expiry as an absolute CLOCK_MONOTONIC timespec (steady_clock is CLOCK_MONOTONIC).
  [[nodiscard]] timespec monotonic_timespec() const noexcept;
  //! Time left as a relative timespec, zero when expired.
  [[nodiscard]] timespec remaining_timespec() const noexcept;

 private:
  friend class deadline;
  countdown() noexcept = default;
  clock::time_point expiry_{};
  bool infinite_ = false;
  bool zero_ = false;
};

// The common case (no deadline) inline: it starts every lock call.
inline countdown deadline::start() const noexcept {
  if (kind_ == kind::never) {
    countdown c;
    c.infinite_ = true;
    return c;
  }
  return start_finite();
}

}  // namespace keel
