#include "keel/deadline.hpp"

#include <algorithm>

namespace keel {
namespace {

timespec to_timespec(std::chrono::nanoseconds ns) noexcept {
  const auto s = std::chrono::duration_cast<std::chrono::seconds>(ns);
  return {.tv_sec = static_cast<time_t>(s.count()), .tv_nsec = static_cast<long>((ns - s).count())};
}

}  // namespace

countdown deadline::start_finite() const noexcept {
  countdown c;
  switch (kind_) {
    case kind::never:
      c.infinite_ = true;
      break;
    case kind::zero:
      c.zero_ = true;
      c.expiry_ = clock::now();
      break;
    case kind::relative:
      c.expiry_ = clock::now() + std::chrono::nanoseconds(ns_);
      break;
    case kind::steady:
      c.expiry_ = clock::time_point(clock::duration(ns_));
      break;
    case kind::system: {
      // A wall-clock instant becomes the same distance from now on the steady clock; a later
      // step of the wall clock does not move it (the usual choice of timed waits).
      const auto wall_now = std::chrono::system_clock::now();
      const auto at = std::chrono::system_clock::time_point(
          std::chrono::duration_cast<std::chrono::system_clock::duration>(
              std::chrono::nanoseconds(ns_)));
      c.expiry_ = clock::now() + std::chrono::duration_cast<clock::duration>(at - wall_now);
      break;
    }
  }
  return c;
}

countdown::clock::duration countdown::remaining() const noexcept {
  if (infinite_) return clock::duration::max();
  if (zero_) return clock::duration::zero();
  return std::max(clock::duration::zero(), expiry_ - clock::now());
}

timespec countdown::monotonic_timespec() const noexcept {
  return to_timespec(expiry_.time_since_epoch());
}

timespec countdown::remaining_timespec() const noexcept {
  if (infinite_) return {.tv_sec = INT64_MAX / 2, .tv_nsec = 0};
  return to_timespec(remaining());
}

}  // namespace keel
