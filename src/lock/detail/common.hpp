#pragma once
// Small pieces every algorithm uses.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "base/per_thread.hpp"
#include "base/thread_rng.hpp"
#include "keel/io/deadline.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/lock/shared_fs_mutex.hpp"

namespace keel::lock::detail {

//! Test-only: called at named points where a race can happen, so a test can make the other
//! side act there deterministically. Null by default: one relaxed load, off the fast path.
using test_hook_fn = void (*)(std::string_view point);
extern std::atomic<test_hook_fn> test_hook;
inline void reached(std::string_view point) noexcept {
  if (const test_hook_fn h = test_hook.load(std::memory_order_relaxed); h != nullptr) h(point);
}

//! The rest of a countdown as a deadline for a nested wait.
inline io::deadline rest_of(const io::countdown& cd) noexcept {
  if (cd.is_infinite()) return io::deadline::never();
  if (cd.is_zero()) return io::deadline::zero();
  return io::deadline(cd.expiry());
}

//! The error for giving up on contention: would_block for a try, timed_out otherwise.
inline std::unexpected<error> contention_error(const io::countdown& cd) noexcept {
  return errc_error(cd.is_zero() ? std::errc::operation_would_block : std::errc::timed_out);
}

//! Whether an error means "someone else holds it" rather than a real failure.
inline bool is_contention(const std::error_code& ec) noexcept {
  return ec == std::errc::operation_would_block || ec == std::errc::timed_out;
}

//! The order to try entities in after contention at position `contended`: the contended one
//! first (so the next wait sleeps on it), the rest reshuffled (so two lockers of overlapping
//! sets do not keep colliding in the same place).
inline void contended_first(std::span<std::uint32_t> order, std::size_t contended) noexcept {
  std::swap(order[0], order[contended]);
  if (order.size() > 2) std::shuffle(order.begin() + 1, order.end(), base::thread_rng());
}

//! The first of the bytes that say which algorithm has a lock file open (claim): past every
//! entity's byte. One byte per family of algorithms that exclude each other.
constexpr off_t algorithm_bytes = std::numeric_limits<off_t>::max() - 16;

static_assert(entity::max_lockable == static_cast<std::uint64_t>(algorithm_bytes) - 1);

//! The byte offset an entity is locked at: its value (lock refuses values above
//! entity::max_lockable, so no two entities share a byte).
inline off_t entity_offset(entity e) noexcept {
  return static_cast<off_t>(e.value);
}

struct file_id {
  std::uint64_t dev = 0;
  std::uint64_t ino = 0;
};

inline result<file_id> identify(const io::file_handle& f) noexcept {
  auto st = f.status();
  if (!st) return std::unexpected(st.error());
  return file_id{st->device, st->inode};
}

//! How lock files are opened: made if missing, and never through a symlink (ELOOP): a link
//! planted at a lock path must not make keel lock, or write to, a file it points to.
constexpr io::open_flags lock_file_flags = io::open_flags::read_write | io::open_flags::create |
                                           io::open_flags::no_follow | io::open_flags::non_blocking;

//! The lock file `name` (a path, or a name in `dir`) opened with `flags`. A FIFO,
//! socket or device found there is never opened (opening a FIFO lets its blocked writer
//! through; a device is not a lock file): errc::not_keel_file about `about`. A symlink or a
//! directory is refused by the open itself (ELOOP, EISDIR).
result<io::file_handle> open_lock_file(io::filesystem& fs, const io::file_handle* dir,
                                       const char* name, const std::string& about,
                                       io::open_flags flags = lock_file_flags) noexcept;

//! Whether `f`, opened again by path for a thread of an instance that opened the path as
//! `id`, is that same file. Else ESTALE about `path`: it was removed or replaced since, and
//! threads locking different files would not exclude each other.
result<void> check_same_file(const io::file_handle& f, file_id id,
                             const std::string& path) noexcept;
//! `path` opened again (never created) for a thread of an instance that opened it as `id`:
//! the same file, or ESTALE (see check_same_file).
result<io::file_handle> reopen(io::filesystem& fs, const std::string& path, io::open_flags flags,
                               file_id id) noexcept;

//! The identity of the lock file at `path`, created (mode 0644) if missing.
result<file_id> identify_lock_file(io::filesystem& fs, const std::string& path) noexcept;
//! Marks the open file description of `f` (a lock file, or a lock directory's claim file)
//! as used by `algorithm` for as long as it stays open, holding its family's byte shared;
//! refuses with errc::used_by_another_algorithm (naming `path` and both algorithms) where a
//! user of another family has it open: two algorithms on one path do not exclude each other.
//! byte_ranges and fcntl are one family (they lock the same bytes).
result<void> claim(const io::file_handle& f, std::string_view algorithm,
                   const std::string& path) noexcept;
//! The lock file at `path`, made (mode 0644) if missing, opened and claimed for `algorithm`.
result<io::file_handle> open_claimed(io::filesystem& fs, const std::string& path,
                                     std::string_view algorithm) noexcept;
//! The claim file (`.keel-algorithm`) of the lock directory `dir`, opened through `d`, made
//! if missing, and claimed for `algorithm`.
result<io::file_handle> claim_directory(const io::file_handle& d, const std::string& dir,
                                        std::string_view algorithm) noexcept;
//! For algorithms that work only with every user on this machine (atomic_append, sysv):
//! errc::needs_local_filesystem about `path` where the file (or, before it exists, its
//! directory) is on a filesystem other machines may share (io::fs_info::is_local).
result<void> refuse_unless_local(io::filesystem& fs, const std::string& path,
                                 std::string_view algorithm) noexcept;
//! The lock directory `dir` opened, never through a symlink (ELOOP), and only if it is the
//! caller's or root's: a directory another user made (at a path like /tmp/x) is theirs to
//! plant and replace entries in, so it is refused (EPERM, naming it).
result<io::file_handle> open_lock_directory(io::filesystem& fs, const std::string& dir) noexcept;
//! The identity of the lock directory `dir`, created (mode 0755) if missing, checked as
//! open_lock_directory does.
result<file_id> identify_lock_directory(io::filesystem& fs, const std::string& dir) noexcept;

//! Closes a descriptor in a forked child (thread_state::close_in_child): straight to the
//! kernel, not through the io seam, since only the forking thread runs there (a fault rule's
//! locks may be held by threads the child does not have).
inline void close_in_child(io::file_handle& f) noexcept {
  if (f.is_open()) (void)::close(f.release());  // (past the seam: see above)
}

//! A thread's own descriptor of a lock file (see base/per_thread.hpp for why).
struct thread_file final : base::thread_state {
  io::file_handle file;
  void close_in_child() noexcept override { detail::close_in_child(file); }
};
//! This thread's descriptor of `path` (the file `id`), opened read-write on first use.
result<thread_file*> thread_file_of(base::per_thread_states& threads, io::filesystem& fs,
                                    const std::string& path, file_id id) noexcept;

//! A lock file that every thread opens for itself (the state of byte_ranges and fcntl_ofd).
struct lock_file_per_thread {
  std::string path;
  file_id id;
  io::file_handle claimed;  // holds the family's byte (claim) while the instance lives
  io::filesystem* fs = &io::os();
  base::per_thread_states threads;
  result<thread_file*> mine() noexcept { return thread_file_of(threads, *fs, path, id); }
};

//! Unlocks the byte of every entity of `set` through `file`; the first error, if any.
result<void> unlock_entity_bytes(const io::file_handle& file, std::span<const entity> set) noexcept;

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

//! Locks the byte of every entity of `sorted` through `file` (OFD locks, shared or exclusive
//! as asked), all or none, before `cd` expires: byte_ranges' algorithm, also memory_map's
//! fallback. Only the first entity of the current order is waited for in the kernel; on
//! contention everything taken is released, the contended entity goes first and the rest
//! are reshuffled. Errors: as shared_fs_mutex::lock.
result<void> lock_entity_bytes(const io::file_handle& file, std::span<const entity> sorted,
                               const io::countdown& cd, bool spin) noexcept;

}  // namespace keel::lock::detail
