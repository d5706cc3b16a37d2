#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "keel/io/filesystem.hpp"
#include "keel/lock/shared_fs_mutex.hpp"

namespace keel::lock {

//! A directory holding one file per locked entity, named by its value in 16 hex digits and
//! created exclusively: the file exists exactly while someone holds the entity.
//!
//! - **Shared locks are treated as exclusive**: an O_EXCL file has one owner. Use another
//!   algorithm where readers must coexist.
//! - **Cost per lock**: one anonymous temporary file holding the owner record, then one
//!   link(2) per entity (the names are hard links to it, so each appears complete, with its
//!   owner, at once); one unlink per entity to unlock. Slow (metadata operations), but it
//!   works on any filesystem that has atomic link, network ones included.
//! - **Waiting**: on contention everything is released, the contended entity goes first, the
//!   rest are reshuffled, and the thread sleeps with an exponential backoff (up to 2 ms; it
//!   only spins if asked). No deadlock in any order; no fairness at all.
//! - **Crash**: the files of a dead holder stay. A waiter that finds a file whose owner
//!   (pid, pid namespace, process start time, boot id, machine id) is provably dead removes
//!   it, holding that entity's byte of `.keel-break` exclusively, and only if the name is
//!   still the file it judged, so a live owner's lock is never broken. Every holder holds
//!   its entities' bytes shared while it holds them (two fcntl calls per entity more), so a
//!   breaker never judges a live holder's name, even where its view of the directory lags
//!   (a network client that still shows an earlier owner's file under the name). Proof: in this
//!   boot and pid namespace, no process has the pid (or the one that has it started at another
//!   time); or this machine rebooted since (judged on local filesystems only: on a network share, a
//!   machine cloned from this one's image has the same machine id). It checks at most every
//!   `stale_check_interval` (10 ms by default). An owner that cannot be judged (another machine,
//!   another pid namespace, /proc unreadable) is alive: its files stay until removed by hand.
//! - **Network filesystems**: safe where link(2) is atomic (NFSv3+); crash recovery then only
//!   covers owners of this machine's current boot, and relies on byte-range locks that every
//!   client sees (NFSv4, GlusterFS: tested with two GlusterFS clients in make test). All
//!   users must share a pid namespace.
class lock_files final : public shared_fs_mutex {
 public:
  //! Opens (creating if needed) the lock directory `dir`.
  //! Its files are reached through `fs`.
  [[nodiscard]] static result<std::unique_ptr<lock_files>> open(
      const std::string& dir, io::filesystem& fs = io::os()) noexcept;
  ~lock_files() override;
  [[nodiscard]] std::string_view algorithm() const noexcept override { return "lock_files"; }

  std::chrono::milliseconds stale_check_interval{10};

 private:
  struct impl;
  lock_files(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept;
  result<std::uint64_t> do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                bool spin_not_sleep) noexcept override;
  result<void> do_unlock(std::span<const entity> sorted, std::uint64_t token) noexcept override;
  std::unique_ptr<impl> impl_;
};

}  // namespace keel::lock
