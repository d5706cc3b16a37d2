#pragma once
// Kernel primitives behind the shared_fs_mutex interface, as baselines to measure keel's
// algorithms against. They are correct (tests run them with the algorithms) but make no
// effort beyond what the kernel gives: no backoff, no reordering.

#include <memory>
#include <string>

#include "keel/io/file_handle.hpp"
#include "keel/io/filesystem.hpp"
#include "keel/lock/shared_fs_mutex.hpp"

namespace keel::lock {

//! One lock file, one OFD byte-range lock per entity, taken one after the other in value
//! order, each waiting in the kernel (sorted order makes it deadlock-free), except on a
//! filesystem that is not local, where waits poll (io/byte_lock.hpp says why).
//! Cost: one fcntl per entity each way. Crash: released by the kernel. Fairness: the
//! kernel's. Network filesystems: as byte_ranges.
class fcntl_ofd final : public shared_fs_mutex {
 public:
  [[nodiscard]] static result<std::unique_ptr<fcntl_ofd>> open(
      const std::string& path, io::filesystem& fs = io::os()) noexcept;
  ~fcntl_ofd() override;
  [[nodiscard]] std::string_view algorithm() const noexcept override { return "fcntl"; }

 private:
  struct impl;
  fcntl_ofd(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept;
  result<std::uint64_t> do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                bool spin_not_sleep) noexcept override;
  result<void> do_unlock(std::span<const entity> sorted, std::uint64_t token) noexcept override;
  std::unique_ptr<impl> impl_;
};

//! A directory with one file per entity (16 hex digits), locked with flock(2) (LOCK_SH or
//! LOCK_EX) in value order. flock has no timed wait: a finite deadline polls with LOCK_NB
//! and backoff, and so does every wait on a filesystem that is not local (a waiter
//! interrupted in the kernel can wedge a GlusterFS volume: io/byte_lock.hpp). Each thread keeps its
//! own descriptors (flock locks belong to the open file description). Crash: released by the
//! kernel. Network filesystems: NFS emulates flock with whole-file byte-range locks.
class flock_files final : public shared_fs_mutex {
 public:
  //! `dir` is created if missing.
  [[nodiscard]] static result<std::unique_ptr<flock_files>> open(
      const std::string& dir, io::filesystem& fs = io::os()) noexcept;
  ~flock_files() override;
  [[nodiscard]] std::string_view algorithm() const noexcept override { return "flock"; }

 private:
  struct impl;
  flock_files(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept;
  result<std::uint64_t> do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                bool spin_not_sleep) noexcept override;
  result<void> do_unlock(std::span<const entity> sorted, std::uint64_t token) noexcept override;
  std::unique_ptr<impl> impl_;
};

//! A SysV semaphore set (key derived from the lock file's device and inode), two semaphores
//! per slot (writer, readers); entity → slot by value modulo `slots` (collisions only add
//! contention). The whole set is taken in one semop(2), atomically (all or nothing, no
//! deadlock), with SEM_UNDO so the kernel undoes a dead process's holds. Finite deadlines use
//! semtimedop. Caveats: the set outlives its users (remove it with `remove`); readers can
//! starve a writer; at most SEMOPM/3 entities per call (E2BIG beyond); local machine only:
//! `open` refuses a file on a filesystem other machines may share
//! (errc::needs_local_filesystem).
class sysv final : public shared_fs_mutex {
 public:
  static constexpr int default_slots = 1024;
  //! Opens (creating if needed) the lock file at `path` and its semaphore set.
  [[nodiscard]] static result<std::unique_ptr<sysv>> open(const std::string& path,
                                                          int slots = default_slots,
                                                          io::filesystem& fs = io::os()) noexcept;
  //! Removes the semaphore set belonging to the lock file at `path`.
  [[nodiscard]] static result<void> remove(const std::string& path) noexcept;
  ~sysv() override;
  [[nodiscard]] std::string_view algorithm() const noexcept override { return "sysv"; }

 private:
  sysv(std::uint64_t dev, std::uint64_t ino, int semid, int slots,
       io::file_handle claimed) noexcept;
  result<std::uint64_t> do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                bool spin_not_sleep) noexcept override;
  result<void> do_unlock(std::span<const entity> sorted, std::uint64_t token) noexcept override;
  int semid_;
  int slots_;
  io::file_handle claimed_;  // the lock file, marked as sysv's while open
};

}  // namespace keel::lock
