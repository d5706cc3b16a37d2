#pragma once

#include <memory>
#include <string>

#include "keel/io/filesystem.hpp"
#include "keel/lock/shared_fs_mutex.hpp"

namespace keel::lock {

//! A shared, append-only lock log (format: doc/lock-formats.md). To lock, a thread appends a
//! record naming its entities (one atomic O_APPEND write, however many entities), takes an
//! exclusive byte-range lock on that record, and then waits for every earlier record that
//! is still live and conflicts with it (shares an entity, one side exclusive). It waits by
//! asking for a shared lock on the blocking record: it sleeps in the kernel until that
//! owner unlocks. To unlock, the owner marks its record released and drops the record lock.
//!
//! - **Cost per lock**: one append, one lseek, four fcntl, a read of the live part of the
//!   log and one pwrite to release: about the same whatever the number of entities (the
//!   point of this algorithm: flat in entities, where byte_ranges and lock_files slow down
//!   linearly).
//! - **Fairness**: first come, first served, in append order: strictly FIFO among
//!   conflicting requests, so nobody starves. No deadlock: everyone waits only on earlier
//!   records.
//! - **Crash**: a record whose owner died is released with it: its record lock is gone, and
//!   a waiter that finds it so while holding the header lock exclusively (appenders hold it
//!   shared from their append until they lock their record) knows the owner will never
//!   lock it: a proof that needs no /proc, so waiters go on at once, and `try_lock` too.
//! - **Log reset**: the log is truncated back to its header by whoever finds every record
//!   released (and can take the header lock exclusively, which appenders hold shared while
//!   they append): the file stays small, and a hint in the header skips released records.
//! - **Network filesystems**: not supported: it relies on atomic O_APPEND and on a shared
//!   map of the header, which NFS gives neither of. `open` refuses a file on a filesystem
//!   other machines may share (errc::needs_local_filesystem).
//! - **Caveats**: a timed-out or failed try still appended a record (then released it).
class atomic_append final : public shared_fs_mutex {
 public:
  //! Opens (creating and initialising if needed) the lock log at `path`, reached through
  //! `fs`. Errors: those of open/mmap; not_keel_file (≈ bad_message) when the file is not a
  //! keel lock log; unsupported_version (≈ protocol_not_supported) for a log of another
  //! format version.
  [[nodiscard]] static result<std::unique_ptr<atomic_append>> open(
      const std::string& path, io::filesystem& fs = io::os()) noexcept;
  ~atomic_append() override;
  [[nodiscard]] std::string_view algorithm() const noexcept override { return "atomic_append"; }

  //! Entities one 256-byte record carries; larger sets span several records (one write).
  static constexpr std::size_t entities_per_record = 24;

 private:
  struct impl;
  atomic_append(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept;
  result<std::uint64_t> do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                bool spin_not_sleep) noexcept override;
  result<void> do_unlock(std::span<const entity> sorted, std::uint64_t token) noexcept override;
  std::unique_ptr<impl> impl_;
};

}  // namespace keel::lock
