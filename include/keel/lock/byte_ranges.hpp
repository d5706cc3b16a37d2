#pragma once

#include <memory>
#include <string>

#include "keel/io/filesystem.hpp"
#include "keel/lock/shared_fs_mutex.hpp"

namespace keel::lock {

//! One lock file; entity `v` is the byte at offset `v` of it, locked with an OFD byte-range
//! lock (shared or exclusive, as asked).
//!
//! - **Cost per lock**: one fcntl per entity to lock and one to unlock (about 1 µs each on
//!   tmpfs); nothing is written. Each thread uses its own descriptor (OFD locks belong to a
//!   descriptor's open file description, so threads must not share one).
//! - **Waiting**: the first entity of the current order is waited for in the kernel (the
//!   thread sleeps until it is released or the deadline passes); the others are tried. On
//!   contention everything taken is released, the contended entity moves to the front and
//!   the rest are reshuffled, then it retries: deadlock-free in any order, all or nothing.
//!   On a filesystem that is not local the first entity is polled for instead (the kernel's
//!   wait can wedge a GlusterFS volume when a waiter is killed: io/byte_lock.hpp).
//! - **Fairness**: whatever the kernel gives; a waiter on a popular set of many entities can
//!   starve behind lockers of small subsets.
//! - **Crash**: the kernel releases a dead process's locks at once (SIGKILL included).
//! - **Network filesystems**: works where the filesystem supports OFD/POSIX locks (NFSv4
//!   with a lock manager); lock latency is then a network round trip per entity.
//! - **Caveats**: entity values above 2^63 - 2 share a byte with 2^63 - 2.
class byte_ranges final : public shared_fs_mutex {
 public:
  //! Opens (creating if needed, mode 0644) the lock file at `path`.
  //! Its files are reached through `fs`.
  [[nodiscard]] static result<std::unique_ptr<byte_ranges>> open(
      const std::string& path, io::filesystem& fs = io::os()) noexcept;
  ~byte_ranges() override;
  [[nodiscard]] std::string_view algorithm() const noexcept override { return "byte_ranges"; }

 private:
  struct impl;
  byte_ranges(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept;
  result<std::uint64_t> do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                bool spin_not_sleep) noexcept override;
  result<void> do_unlock(std::span<const entity> sorted, std::uint64_t token) noexcept override;
  std::unique_ptr<impl> impl_;
};

}  // namespace keel::lock
