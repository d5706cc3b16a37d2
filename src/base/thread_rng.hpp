#pragma once

// A fast random generator per thread, for backoff jitter and temporary names: not for anything
// that must be unpredictable.

#include <random>

namespace keel::base {

//! A fast random generator for this thread, seeded from the OS.
std::minstd_rand& thread_rng() noexcept;

}  // namespace keel::base
