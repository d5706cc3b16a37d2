#pragma once
// Who owns a lock, in a form another process can check: pid, the process's start time (so a
// recycled pid is not mistaken for the owner) and the boot id (so a pid from another boot or
// another machine is never judged from this machine's process table).

#include <sys/types.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <random>

#include "keel/io/deadline.hpp"

namespace keel::lock::detail {

struct process_identity {
  std::uint32_t pid = 0;
  std::uint64_t start_time = 0;  // clock ticks since boot (/proc/PID/stat field 22)
  std::array<std::uint8_t, 16> boot_id{};
};

//! This process (refreshed after fork).
const process_identity& self() noexcept;

enum class liveness { alive, dead, unknown };

//! Whether the process `who` still runs. `unknown` when it is not of this boot (another
//! machine, or this one before a reboot: callers decide), never `dead` on a guess.
liveness check(const process_identity& who) noexcept;

//! The start time of `pid`, or 0 if it does not exist (or cannot be read).
std::uint64_t start_time_of(pid_t pid) noexcept;

//! A fast random generator for this thread, seeded from the OS.
std::minstd_rand& thread_rng() noexcept;

//! Waits a little before retrying contended work: yields when spinning, else sleeps with an
//! exponential backoff (from 1 µs up to `cap`, jittered) that never passes the deadline.
//! Returns false once the deadline has expired.
class backoff {
 public:
  explicit backoff(bool spin, std::chrono::microseconds cap = std::chrono::microseconds(2000))
      : spin_(spin), cap_(cap) {}
  bool pause(const io::countdown& cd) noexcept;

 private:
  bool spin_;
  std::chrono::microseconds cap_;
  std::chrono::nanoseconds next_{1000};
};

}  // namespace keel::lock::detail
