#pragma once
// The parts of keel::lock::inspect (inspect.cpp scans the processes and the kernel's locks):
// the readers of the algorithms that keep their holders in their own structures, and what
// they share with the scan. Each reader reads, never writes or locks: a lock call racing it
// meets nothing of it.
//   inspect_log.cpp         atomic_append: the chunks of its log
//   inspect_map.cpp         memory_map: the slots of its shared map
//   inspect_semaphores.cpp  sysv: the counts of its semaphore set

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "detail/common.hpp"
#include "keel/io/filesystem.hpp"
#include "keel/lock/inspect.hpp"

namespace keel::lock::inspecting {

//! One lock of /proc/locks: a held one, or a request blocked behind one.
struct kernel_range {
  std::uint64_t start = 0;
  std::uint64_t end = 0;  //!< inclusive ("EOF" reads as the largest value)
  bool exclusive = false;
  bool blocked = false;
  bool ofd = false;  //!< OFDLCK (keel's byte locks), else POSIX or FLOCK
};

//! What the scan found that the readers use. Owned by inspect(), for one call.
struct context {
  explicit context(io::filesystem& f) : fs(f) {}
  io::filesystem& fs;
  std::string host;          //!< this machine's name
  std::uint64_t booted = 0;  //!< this boot's start, seconds since the epoch (0: unknown)
  //! /proc/locks by the kernel's name of each file ("MAJ:MIN:INO"); read: whether it could be
  //! read at all (it shows every pid namespace's OFD locks, unlike /proc/PID/fdinfo).
  std::map<std::string, std::vector<kernel_range>> kernel_locks;
  bool kernel_locks_read = false;
  //! The kernel's names of files, learnt from the lock lines of descriptors open on them
  //! (btrfs names a file by another device than stat's): (dev, ino) → name.
  std::map<std::pair<std::uint64_t, std::uint64_t>, std::string> names;
  //! The process that holds the OFD lock starting at a byte of a file: (name, start) → pid,
  //! from the fdinfo of the processes this one can see.
  std::map<std::pair<std::string, std::uint64_t>, std::uint32_t> lock_owner;

  //! Reads /proc/locks (again): each reader does after it copied its structure, so that a
  //! mark it copied of a user alive now shows that user's lock.
  void refresh_kernel_locks();
  //! The kernel's name of a file: learnt, else made of stat's device and inode.
  [[nodiscard]] std::string kernel_name(std::uint64_t dev, std::uint64_t ino) const;
  //! Whether the kernel shows a held lock covering byte `at` of the file named `name`.
  [[nodiscard]] bool locked(const std::string& name, std::uint64_t at) const;
  //! Seconds since the epoch at which a process started `ticks` after this boot (0: unknown).
  [[nodiscard]] std::uint64_t started_at(std::uint64_t ticks) const noexcept;
};

//! atomic_append at `path`: each live chunk of its log, an entity per row, held (no earlier
//! live chunk conflicts with it), waiting, or stale (its owner died and nobody has marked it
//! yet). What cannot be read is said in `out.not_shown`. Whether `path` is a log (false,
//! and nothing said: it has no log header).
bool read_log(context& ctx, const std::string& path, lock_state& out) noexcept;

//! The map file memory_map's lock file at `path` names, or "" (none: blank, degraded, not
//! memory_map's).
[[nodiscard]] std::string map_of(io::filesystem& fs, const std::string& path) noexcept;

//! memory_map on the map file `map`: each slot held, granted or waited for, by user (stale
//! where the user's liveness byte is free: it died). Slots, not entities: entity_known false.
void read_map(context& ctx, const std::string& map, lock_state& out) noexcept;

//! The id of sysv's semaphore set for the lock file (dev, ino), or -1 if there is none.
[[nodiscard]] int semaphore_set_of(detail::file_id id) noexcept;

//! sysv's set `semid`: each slot held exclusively (by the last process that changed it: the
//! holder) or shared (counted, not named).
void read_semaphores(const context& ctx, int semid, lock_state& out) noexcept;

}  // namespace keel::lock::inspecting
