#pragma once
// Who holds a keel lock, and who waits for it: what `keel locks` shows. lslocks(8) shows the
// kernel's locks only; keel's algorithms keep theirs in files, bytes and records, read here.

#include <cstdint>
#include <string>
#include <vector>

#include "keel/io/filesystem.hpp"
#include "keel/result.hpp"

namespace keel::lock {

//! One process's hold on (or wait for) an entity, or a whole file.
struct lock_holder {
  enum class role : std::uint8_t {
    holds,  //!< holds it
    waits,  //!< asleep in the kernel waiting for it (a polling waiter is not seen)
    stale,  //!< lock_files: the record of an owner proven dead, removed by the next locker
  };
  role what = role::holds;
  std::string algorithm;  //!< as the lock shows it: "byte_ranges or fcntl", "flock", ...
  std::uint32_t pid = 0;  //!< 0: unknown
  std::string host;       //!< where known (this host for kernel locks; a lock_files record's)
  //! When the process started, seconds since the epoch (0: unknown). The kernel does not
  //! record when a lock was taken: a holder has held it at most since then.
  std::uint64_t process_started = 0;
  bool whole_file = false;   //!< flock(2) on the lock file itself (flock(1), `keel lock` no NAME)
  bool entity_known = true;  //!< false: a waiter whose entity could not be told
  std::uint64_t entity = 0;  //!< its value (entity::from_string's hash for a name)
  bool exclusive = true;
  bool mode_known = true;  //!< false: a waiter whose shared or exclusive could not be told
};

//! What `inspect` found at a lock path.
struct lock_state {
  bool directory = false;              //!< a lock directory (lock_files, flock)
  std::vector<std::string> open_with;  //!< the algorithms that have it open now
  std::vector<std::uint32_t> users;    //!< processes of this machine that have it open
  std::vector<lock_holder> holders;    //!< holders, waiters and stale records
  //! What could not be shown, and why (an algorithm whose holders live in a shared map, a
  //! log or semaphores; processes of other machines; /proc entries not readable).
  std::vector<std::string> not_shown;
};

//! The holders and waiters of the keel lock at `path` (a lock file or directory), for every
//! algorithm: kernel locks of processes of this machine, read from /proc (needs the right
//! to read other users' /proc/PID/fd: root sees all), and lock_files' owner records (which
//! name processes of other machines too, and are judged stale as a locker would). Errors:
//! those of looking at `path` (no_such_file_or_directory, ...).
[[nodiscard]] result<lock_state> inspect(const std::string& path,
                                         io::filesystem& fs = io::os()) noexcept;

}  // namespace keel::lock
