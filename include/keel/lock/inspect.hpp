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
    waits,  //!< waiting for it: asleep in the kernel, or queued in the algorithm's own
            //!< structure (a waiter that polls, as on a network filesystem, is not seen)
    stale,  //!< an owner proven dead whose mark is still there (lock_files' record,
            //!< atomic_append's chunk, memory_map's slot): the next locker clears it
  };
  role what = role::holds;
  std::string algorithm;  //!< as the lock shows it: "byte_ranges or fcntl", "flock", ...
  std::uint32_t pid = 0;  //!< 0: unknown
  std::string host;       //!< where known (this host for kernel locks; a lock_files record's)
  //! When the process started, seconds since the epoch (0: unknown). The kernel does not
  //! record when a lock was taken: a holder has held it at most since then.
  std::uint64_t process_started = 0;
  bool whole_file = false;  //!< flock(2) on the lock file itself (flock(1), `keel lock` no NAME)
  //! false: a waiter whose entity could not be told, or a slot's holder (below)
  bool entity_known = true;
  std::uint64_t entity = 0;  //!< its value (entity::from_string's hash for a name)
  bool exclusive = true;
  bool mode_known = true;  //!< false: a waiter whose shared or exclusive could not be told
  //! memory_map and sysv lock slots, which several entities share: the slot held, or -1.
  //! `could_be` tells which entities it may be.
  std::int64_t slot = -1;
  std::uint64_t slots = 0;  //!< how many slots the lock has
  //! sysv's shared holders of a slot are counted by the kernel, not named: how many (pid 0
  //! then), else 1.
  std::uint32_t count = 1;

  //! Whether this row may be a hold of (or a wait for) the entity of `value`: its entity, or
  //! for a slot, an entity of that slot. A row whose entity is unknown may be any.
  [[nodiscard]] bool could_be(std::uint64_t value) const noexcept;
};

//! What `inspect` found at a lock path.
struct lock_state {
  bool directory = false;              //!< a lock directory (lock_files, flock)
  std::vector<std::string> open_with;  //!< the algorithms that have it open now
  std::vector<std::uint32_t> users;    //!< processes of this machine that have it open
  std::vector<lock_holder> holders;    //!< holders, waiters and stale records
  //! What could not be shown, and why (processes of other machines; /proc entries not
  //! readable; a log or map that could not be read).
  std::vector<std::string> not_shown;
};

//! The holders and waiters of the keel lock at `path` (a lock file or directory), for every
//! algorithm: kernel locks of processes of this machine, read from /proc (needs the right
//! to read other users' /proc/PID/fd: root sees all); lock_files' owner records (which name
//! processes of other machines too, and are judged stale as a locker would); the live
//! chunks of atomic_append's log; the slots of memory_map's shared map; the counts of sysv's
//! semaphores. It only reads: it takes no lock and writes nothing (it opens a regular file at
//! `path`, so, as any open and close of the file does, it drops classic POSIX F_SETLK locks
//! the calling process holds on it; keel takes none). Errors: those of looking at `path`
//! (no_such_file_or_directory, ...).
[[nodiscard]] result<lock_state> inspect(const std::string& path,
                                         io::filesystem& fs = io::os()) noexcept;

}  // namespace keel::lock
