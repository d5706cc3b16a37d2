#pragma once
// Who a process is, in a form another process can check: pid, the process's start time (so a
// recycled pid is not mistaken for the owner) and the boot id (so a pid from another boot or
// another machine is never judged from this machine's process table). Shared by every layer
// that records owners in files or shared memory (lock owners, the store's reader table).

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <random>

#include "keel/io/filesystem.hpp"

namespace keel::base {

struct process_identity {
  std::uint32_t pid = 0;
  std::uint64_t start_time = 0;  // clock ticks since boot (/proc/PID/stat field 22)
  std::array<std::uint8_t, 16> boot_id{};
};

//! This process (refreshed after fork).
const process_identity& self() noexcept;

enum class liveness { alive, dead, unknown };

//! Whether the process `who` still runs, read from /proc through `fs`. `unknown` when it is
//! not of this boot (another machine, or this one before a reboot: callers decide).
liveness check(const process_identity& who, io::filesystem& fs = io::os()) noexcept;

//! The start time of `pid`, or 0 if it does not exist (or cannot be read).
std::uint64_t start_time_of(pid_t pid, io::filesystem& fs = io::os()) noexcept;

//! A fast random generator for this thread, seeded from the OS.
std::minstd_rand& thread_rng() noexcept;

}  // namespace keel::base
