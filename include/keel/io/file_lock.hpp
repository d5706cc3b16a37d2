#pragma once

#include <string>

#include "keel/io/byte_lock.hpp"
#include "keel/io/deadline.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/result.hpp"

//! flock(2) on a whole file: the lock flock(1), `keel lock FILE`, Python's filelock and
//! portalocker take, so that keel excludes, and is excluded by, each of them on the same file.
//!
//! A flock lock belongs to the open file description, as an OFD byte-range lock does
//! (byte_lock.hpp): two descriptors opened separately conflict even in one thread, dup(2) and
//! fork(2) share one, and the kernel releases it when the last descriptor of the description
//! closes, the holder's death included. It has no timed wait either: deadlines are kept as
//! byte_lock.hpp says (a per-thread timer signal, polling where the filesystem is not known
//! local or the signal is the application's). On NFS the kernel emulates flock with a
//! whole-file byte-range lock; on a FUSE filesystem it is whatever the filesystem does.
//!
//! flock(2) is reached directly, not through the io seam: a lock has no data to lose, and the
//! kernel primitive is the point (as for lock::flock_files).
namespace keel::io {

//! Locks `file` whole with flock(2) as `kind`, waiting until `d`. Errors:
//! operation_would_block (zero deadline, held), timed_out (finite deadline passed),
//! bad_file_descriptor (`file` is not open), no_lock_available (the filesystem's lock table
//! is full, or NFS refused), and any other errno of flock(2). A signal of the application's
//! own during a wait for ever is not returned: the wait goes on.
[[nodiscard]] result<void> lock_file(const file_handle& file, lock_kind kind,
                                     deadline d = {}) noexcept;

//! Unlocks what `file`'s open file description holds (flock(2) LOCK_UN).
[[nodiscard]] result<void> unlock_file(const file_handle& file) noexcept;

//! Opens `path` as flock(1) opens its lock file, and locks it whole as `kind` until `d`:
//! made if missing (mode 0666 less the umask), opened for reading where it may not be written
//! (a file or filesystem this user may only read, or a directory). Returns the handle that
//! holds the lock (closing it releases it). When the path was removed or replaced while it
//! waited, the lock is on a file nobody else will lock: it lets that one go and locks the file
//! the path names now, so the lock returned is on the file at `path` as it returns. A child
//! forked while it waits closes its copy of the descriptor (the lock it is about to get would
//! else be the child's too, and outlive the parent). Errors:
//! lock_file's, and open(2)'s (no_such_file_or_directory: a directory of the path is missing;
//! permission_denied, read_only_file_system: it cannot be made, ...).
[[nodiscard]] result<file_handle> open_and_lock_file(const std::string& path, lock_kind kind,
                                                     deadline d = {}) noexcept;

//! `open_and_lock_file` through `file`, which a caller keeps open between locks (to save an
//! open(2) and a close(2) each time): locks the file it has open, or opens `path` when it is
//! closed, and opens `path` again when it no longer names that file. On failure `file` holds
//! no lock (open or closed). Keep such a handle out of forked children: a child's copy shares the
//! parent's open file description, and with it the parent's lock.
[[nodiscard]] result<void> lock_file_at(file_handle& file, const std::string& path, lock_kind kind,
                                        deadline d = {}) noexcept;

//! `open_and_lock_file` for a lock this process keeps from its children: the descriptor stays
//! noted from the wait until `unlock_private_file`, so a child forked at any moment, by any
//! thread, closes its copy (which would share the lock, and hold it past this process's
//! death). Such a handle is let go only by unlock_private_file; in a forked child, its copy is
//! closed already: drop the number (file_handle::release) without closing it.
[[nodiscard]] result<file_handle> lock_file_privately(const std::string& path, lock_kind kind,
                                                      deadline d = {}) noexcept;

//! Unlocks, forgets and closes a handle lock_file_privately returned. The first error of the
//! unlock and the close; the handle is closed either way.
[[nodiscard]] result<void> unlock_private_file(file_handle& file) noexcept;

}  // namespace keel::io
