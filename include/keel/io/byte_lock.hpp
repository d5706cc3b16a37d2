#pragma once

#include <sys/types.h>

#include <cstdint>

#include "keel/io/deadline.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/result.hpp"

//! Byte-range locks on open file descriptions (Linux OFD locks, F_OFD_SETLK/F_OFD_SETLKW).
//!
//! Unlike classic POSIX (F_SETLK) locks, OFD locks belong to the *open file description*:
//! two `file_handle`s opened separately conflict with each other even inside one process and
//! one thread, closing some other descriptor of the same file does not drop them, and they are
//! released when the last descriptor of the description is closed, including when the
//! process dies (SIGKILL too). Descriptors duplicated with dup(2) or inherited by fork(2)
//! share the description, hence its locks. keel opens every descriptor O_CLOEXEC, so locks do
//! not leak into programs the process executes.
//!
//! **Pitfall**: locks held through one open file description do not nest or count. Locking a
//! range merges with what that description already holds, and unlocking a range removes
//! every lock the description holds in that range, whoever took it. Two `extent_guard`s of
//! one description over overlapping ranges are therefore not independent: destroying one
//! unlocks the overlap under the other. Give each independent holder its own `file_handle`
//! (its own open(2)), or never let one description's ranges overlap.
//!
//! **Deadlines**: Linux has no timed wait for these locks. A finite deadline is honoured by
//! arming a per-thread POSIX timer (timer_create with SIGEV_THREAD_ID) whose signal
//! interrupts F_OFD_SETLKW with EINTR; keel installs a do-nothing handler without SA_RESTART
//! for that signal (`deadline_signal()`, SIGRTMAX - 1 unless the application already
//! handles that signal, in which case keel polls with backoff instead). The timer re-fires
//! every millisecond after expiry, so a signal that lands just before the thread enters the
//! wait cannot make it sleep forever. Costs: nothing when the lock is free (one F_OFD_SETLK),
//! three extra syscalls when it must wait; a timed-out wait returns within about a
//! millisecond of the deadline.
//!
//! **Network filesystems**: on a filesystem that is not known local (fs_info::is_local), a
//! wait never sleeps in the kernel: it asks again without waiting, backing off from 50 µs to
//! 10 ms. With GlusterFS 10.3 a waiter killed or interrupted inside F_OFD_SETLKW left the
//! volume unanswering and every client's waiters stuck in D state; a poll is inside the
//! filesystem only for one request's round trip, not for the whole wait (a signal landing in
//! that round trip can still do it: seen when six waiters were SIGKILLed at once, about one
//! time in six). Costs: one statfs when a wait begins, and up to 10 ms after a release.
namespace keel::io {

enum class lock_kind : std::uint8_t { shared, exclusive };

//! Owns one locked byte range of one open file description; unlocks it on destruction.
//! Move-only. The file_handle it was taken through must outlive it (it keeps the descriptor
//! number, not a copy).
class extent_guard {
 public:
  extent_guard() noexcept = default;
  //! Owns the range [offset, offset + length) locked as `kind` through `file`.
  extent_guard(const file_handle& file, off_t offset, off_t length, lock_kind kind) noexcept
      : fd_(file.fd()), offset_(offset), length_(length), kind_(kind), fs_(&file.fs()) {}
  extent_guard(extent_guard&& other) noexcept;
  extent_guard& operator=(extent_guard&& other) noexcept;
  extent_guard(const extent_guard&) = delete;
  extent_guard& operator=(const extent_guard&) = delete;
  ~extent_guard() { (void)unlock(); }

  [[nodiscard]] bool owns_lock() const noexcept { return fd_ >= 0; }
  explicit operator bool() const noexcept { return owns_lock(); }
  [[nodiscard]] off_t offset() const noexcept { return offset_; }
  [[nodiscard]] off_t length() const noexcept { return length_; }
  [[nodiscard]] lock_kind kind() const noexcept { return kind_; }
  [[nodiscard]] int fd() const noexcept { return fd_; }

  //! Unlocks the range now (see the pitfall above). Returns fcntl's error, if any; the guard
  //! no longer owns the range either way.
  result<void> unlock() noexcept;
  //! Stops owning the range without unlocking it; the caller must unlock it.
  void release() noexcept { fd_ = -1; }

 private:
  int fd_ = -1;
  off_t offset_ = 0;
  off_t length_ = 0;
  lock_kind kind_ = lock_kind::exclusive;
  filesystem* fs_ = nullptr;
};

//! Locks [offset, offset + length) of `file`'s open file description as `kind`, waiting
//! until `d`. Errors: operation_would_block (zero deadline, the range is held), timed_out
//! (finite deadline passed), invalid_argument (offset < 0, length <= 0, or the end past the
//! largest file offset), bad_file_descriptor (also: shared on a file not open for reading,
//! exclusive on one not open for writing), resource_deadlock_would_occur (the kernel saw a
//! deadlock), no_lock_available, interrupted (a signal of the application's own arrived
//! while waiting forever is retried, not returned), and any other errno of fcntl(2).
[[nodiscard]] result<extent_guard> lock_extent(const file_handle& file, off_t offset, off_t length,
                                               lock_kind kind, deadline d = {}) noexcept;

//! `lock_extent` with a zero deadline.
[[nodiscard]] inline result<extent_guard> try_lock_extent(const file_handle& file, off_t offset,
                                                          off_t length, lock_kind kind) noexcept {
  return lock_extent(file, offset, length, kind, deadline::zero());
}

//! Unlocks [offset, offset + length) of `file`'s description (every lock it holds there).
[[nodiscard]] result<void> unlock_extent(const file_handle& file, off_t offset,
                                         off_t length) noexcept;

//! Whether [offset, offset + length) could be locked as `kind` through `file` right now
//! (F_OFD_GETLK). Only a snapshot: by the time it returns, it may have changed.
[[nodiscard]] result<bool> extent_is_free(const file_handle& file, off_t offset, off_t length,
                                          lock_kind kind) noexcept;

//! The signal used to interrupt timed waits, or 0 when keel falls back to polling because
//! the application owns that signal.
[[nodiscard]] int deadline_signal() noexcept;

}  // namespace keel::io
