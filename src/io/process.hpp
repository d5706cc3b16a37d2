#pragma once
// Who a process is, in a form another process can check: pid, the process's start time (so a
// recycled pid is not mistaken for the owner), its pid namespace (so a pid is judged only in
// the namespace it means something in), the boot id and the machine id (so a pid from another
// boot or another machine is never judged from this machine's process table). Shared by every
// layer that records owners in files or shared memory (lock owners, the store's readers).
//
// Death must be proven, never presumed: anything that cannot be read (/proc hidden or
// unmounted, EMFILE, another namespace, another machine) makes a process `unknown`, which
// callers treat as alive.

#include <sys/types.h>

#include <array>
#include <cstdint>

#include "keel/io/filesystem.hpp"

namespace keel::io {

struct process_identity {
  std::uint32_t pid = 0;
  std::uint32_t pid_ns = 0;      // inode of /proc/self/ns/pid (0: unknown)
  std::uint64_t start_time = 0;  // clock ticks since boot (/proc/PID/stat field 22; 0: unknown)
  std::array<std::uint8_t, 16> boot_id{};     // all zero: unknown
  std::array<std::uint8_t, 16> machine_id{};  // /etc/machine-id; all zero: unknown
};

//! This process (refreshed after fork).
const process_identity& self() noexcept;

enum class liveness { alive, dead, unknown };

//! Where the record of `who` was found: on a filesystem only this machine writes (local), or
//! on one other machines may share (a network or cluster filesystem, FUSE, or unknown).
enum class recorded_on { local_filesystem, shared_filesystem };

//! Whether the process `who` still runs. `dead` only with a proof: this machine (machine id)
//! booted since `who` started (boot id) and the record is on a local filesystem (on a shared
//! one, machines cloned from one image share a machine id: another boot may run now), or, in
//! this boot and pid namespace, no process has its pid (kill(pid, 0) fails with ESRCH) or the
//! one that has it started at another time. Anything else it cannot tell is `unknown` (treat
//! as alive). /proc is read through `fs`.
liveness check(const process_identity& who, recorded_on where,
               io::filesystem& fs = io::os()) noexcept;

//! The start time of `pid`, or 0 if it does not exist or cannot be read.
std::uint64_t start_time_of(pid_t pid, io::filesystem& fs = io::os()) noexcept;

}  // namespace keel::io
