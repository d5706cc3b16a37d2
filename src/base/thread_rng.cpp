#include "thread_rng.hpp"

#include <sys/random.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>

namespace keel::base {

std::minstd_rand& thread_rng() noexcept {
  static thread_local std::minstd_rand rng = [] {
    std::uint32_t seed = 0;
    if (::getrandom(&seed, sizeof seed, GRND_NONBLOCK) != sizeof seed) {
      seed =
          static_cast<std::uint32_t>(::getpid()) ^
          static_cast<std::uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    return std::minstd_rand(seed | 1);
  }();
  return rng;
}

}  // namespace keel::base
