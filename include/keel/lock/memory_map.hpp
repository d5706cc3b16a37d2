#pragma once

#include <memory>
#include <string>

#include "keel/io/filesystem.hpp"
#include "keel/lock/shared_fs_mutex.hpp"

namespace keel::lock {

//! A table of shared/exclusive spinlocks in shared memory (a file on /dev/shm whose path the
//! lock file records), indexed by a hash of the entity: the fast path is a compare-and-swap
//! in memory, no syscall (formats and protocols: doc/lock-formats.md).
//!
//! - **Cost per lock**: an atomic read-modify-write and two cache lines read per entity,
//!   plus bookkeeping: about 90 ns for a lock and its unlock of one entity, uncontended.
//! - **Waiting**: on contention everything taken is released and the contended entity goes
//!   first next time (the rest reshuffled). While nobody sleeps on the slot, one waiter at a
//!   time spins for an adaptive budget (doubled when spinning won the slot, halved when it
//!   ran out, 1–200 µs); the others sleep on a futex of their own. A release picks the next
//!   sleeper after the releaser in user order (round robin). If it has waited 1 ms or more,
//!   it is handed the slot (an exclusive sleeper gets the writer word before it is woken, so
//!   nobody takes the slot in front of it): every long wait ends in a turn, in order. If not,
//!   it is only woken to compete (one woken sleeper at a time), so short holds run back to
//!   back without a hand-over each. With `spin_not_sleep` a waiter spins and yields instead
//!   of sleeping. Two entities with the same hash index share a slot
//!   (4096 slots); one thread may hold both (its holds are counted per slot).
//! - **Users**: every (thread, instance) registers as a user (up to 1024 at once per lock),
//!   holding an OFD lock on its own byte of the map file while it lives.
//! - **Crash**: slots record which user holds them (the writer's index, a bit per reader)
//!   and who sleeps on them; a sleeper looks for dead holders now and then (every 10 ms at
//!   first, backing off to 5 ms × sleepers so a crowd does not wake in bursts) and clears
//!   what a dead user held or was handed, so the others go on.
//! - **First and last user**: the lock file carries byte-range markers held by a descriptor
//!   used for nothing else, so no unlock of ours can drop them: the first user creates the
//!   map, the last one removes it, one at a time under an init lock. A closing user waits
//!   at most 2 s for that lock (an opener may be stuck in its set-up); past that it leaves
//!   without the clean-up, and the next first user removes the map instead.
//! - **Maps of dead users**: every instance on a map holds a byte of the map file shared
//!   while it lives. A first user, before it makes its map, removes every map in
//!   `map_directory` whose byte is free: maps whose users all died, even if their lock file
//!   was removed since (nobody would remove those otherwise, and each is 1.4 MB of memory).
//! - **Safe degrade**: a user that cannot share the memory (the lock file is on a network
//!   filesystem, the map is not visible to it, or it asks with `force_fallback`) marks the
//!   lock degraded; every user then moves to a byte_ranges lock on `<path>.fallback`. Nobody
//!   uses the fallback while a live user holds a slot of the map (a look at every slot after
//!   the flag is set proves it; where the map is not visible, an exclusive byte lock that
//!   every user on the map holds shared until it sees the flag), so two exclusive holders
//!   never coexist; lock calls made during the switch wait (within their deadline) for the
//!   map's holders to unlock, and users holding nothing hold nobody back. A thread that
//!   holds a map guard (of this instance or another one of the same lock) and locks again
//!   after a degrade gets resource_deadlock_would_occur (the switch would wait for its own
//!   guard). The lock stays degraded until its last
//!   user closes it.
//! - **Fork**: a child may use an instance its parent opened. Before its first use there, it
//!   joins the lock again through descriptors of its own, so the parent's close never drops
//!   the child's markers (and never removes the map under it); if the parent was the last
//!   user and removed the map first, the child sets up a new one. A lock file removed and
//!   made again in between is another lock: the child's calls fail with ESTALE.
//! - **Network filesystems**: degrades to byte_ranges (see above), which then decides. A
//!   user there never believes the lock file's content (a client may read it a second
//!   late, as GlusterFS's do): it degrades at open, whatever the header says, and syncs
//!   what it writes there before it lets the init lock go.
//! - **Caveats**: a process that dies while it *registers* or *recovers* may leave a user
//!   slot to the next registrant, which clears it; one that dies while it spins stops others
//!   spinning on that slot (they sleep at once: slower, still correct) until a sleeper's
//!   look for dead holders clears it.
//!   A thread holding an entity shared and asking for another of the same slot
//!   exclusively waits for the slot's other readers, like any upgrade: two threads doing
//!   that at once wait for each other until their deadlines.
class memory_map final : public shared_fs_mutex {
 public:
  struct options {
    //! Use the fallback lock, and make every other user move to it.
    bool force_fallback = false;
    //! Where the map file is created (must be tmpfs shared by all local users).
    std::string map_directory = "/dev/shm";
    //! The filesystem its files are reached through (null: io::os()).
    io::filesystem* fs = nullptr;
  };
  //! Opens (creating the lock file, and the map if this is the first user) `path`.
  //! Errors: those of open/mmap/fallocate; not_keel_file for a file at `path` that is not a
  //! keel lock file (it is not written to); unsupported_version for one of another format
  //! version; corrupt (naming the file and offset) for a damaged one;
  //! too_many_users (EUSERS) is returned by `lock` when 1024 users are registered.
  [[nodiscard]] static result<std::unique_ptr<memory_map>> open(const std::string& path,
                                                                options opts) noexcept;
  [[nodiscard]] static result<std::unique_ptr<memory_map>> open(const std::string& path) noexcept {
    return open(path, options{});
  }
  ~memory_map() override;
  [[nodiscard]] std::string_view algorithm() const noexcept override { return "memory_map"; }

  //! Whether this instance has moved to the fallback lock.
  [[nodiscard]] bool is_degraded() const noexcept;

  static constexpr std::size_t slots = 4096;
  static constexpr std::size_t max_users = 1024;

 private:
  struct impl;
  memory_map(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept;
  result<std::uint64_t> do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                bool spin_not_sleep) noexcept override;
  result<void> do_unlock(std::span<const entity> sorted, std::uint64_t token) noexcept override;
  std::unique_ptr<impl> impl_;
};

}  // namespace keel::lock
