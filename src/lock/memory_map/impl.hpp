#pragma once
// memory_map's state, shared by the files that implement it:
//   format.*      the lock file's and the map's formats, and their checks
//   slot_table.*  the slot protocol on the shared map
//   users.cpp     registration of a thread as a user, and recovery of dead users' marks
//   lifecycle.cpp the first user's set-up and the last user's tear-down
//   fallback.cpp  the safe degrade to byte locks
//   memory_map.cpp the lock path: take every slot, spin, sleep, recover

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "base/per_thread.hpp"
#include "base/thread_safety.hpp"
#include "format.hpp"
#include "io/process.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/io/mapped_file.hpp"
#include "keel/lock/memory_map.hpp"
#include "lock/detail/common.hpp"
#include "slot_table.hpp"

namespace keel::lock {

namespace memory_map_detail {

//! One thread's use of one instance: its user index and holds, and its own descriptors
//! (OFD locks belong to an open file description, so threads must not share one).
struct thread_user final : base::thread_state, slot_user {
  io::file_handle lock_fd;      // the lock file (the degrade probe; the fallback's byte locks)
  io::file_handle map_fd;       // holds this user's liveness byte; probes others'
  io::file_handle fallback_fd;  // `<path>.fallback`, opened on first use
  bool registered = false;
  user_entry* entry = nullptr;  // in the map, which outlives this state
  std::uint32_t pid = 0;
  // When a try (zero deadline) last looked for dead holders: a caller that only polls
  // recovers from a crash too, at most every 10 ms of its polling.
  std::chrono::steady_clock::time_point last_try_recovery{};
  // The slot list of a set of more than 16 entities (collect_slots' `big`), with room for
  // the largest this user has locked: a lock call reserves it, and can fail with
  // not_enough_memory; an unlock, which must not fail, then needs no memory.
  std::vector<slot_request> slots;

  thread_user() = default;
  thread_user(const thread_user&) = delete;
  thread_user& operator=(const thread_user&) = delete;
  ~thread_user() override;
  void close_in_child() noexcept override {
    detail::close_in_child(lock_fd);
    detail::close_in_child(map_fd);
    detail::close_in_child(fallback_fd);
  }
};

//! Maps the map file at `path` (checked: a map of this format, whole) and holds its
//! map_held_byte shared through `hold`. Errors: those of open/mmap; not_keel_file,
//! unsupported_version, corrupt naming the file; no_such_file_or_directory when the byte is
//! held exclusively (the map has no user and is being removed).
result<io::mapped_file> open_map(io::filesystem& fs, const std::string& path,
                                 io::file_handle& hold) noexcept;

//! Removes the map files in `dir` that nobody uses (their map_held_byte is free): maps whose
//! users all died, whose lock file may be gone too, so that no next first user would ever
//! remove them, and files a maker left before they became maps (killed, or failing to
//! remove them: empty, or of a map's size with no header yet), which every first user would
//! otherwise step over forever. Leaves alone what is not a map of this format or cannot be
//! probed (another user's file). Best effort, as a destructor's clean-up: nothing it meets is an
//! error of the caller's.
void remove_orphan_maps(io::filesystem& fs, const std::string& dir) noexcept;

//! Whether open_map's error says the map is not this process's to share (gone, another
//! user's, a symlink, not keel's or another version): the lock degrades. Any other (EMFILE,
//! ENOMEM, EIO, ...) is the caller's error, not a reason to move every user off the map.
[[nodiscard]] bool map_not_ours(const error& e) noexcept;

//! What holds slots of a map: nothing, only the calling thread (through any instance of the
//! lock in this process: a thread holding a map guard while it switches would wait for
//! itself for ever), or others. Marks of dead users (their liveness byte free, probed
//! through `map_fd`) are cleared, not waited for.
enum class map_holders { none, only_me, others };
//! `me`: the calling thread's user on `map_fd` (no_slot: none), whose byte a probe through
//! `map_fd` would take.
result<map_holders> holders_of(const slot_table& table, const io::file_handle& map_fd,
                               std::uint32_t me) noexcept;

//! do_lock's token for a set held on the fallback (a map token is a thread_user address,
//! never odd).
constexpr std::uint64_t fallback_token = 1;

}  // namespace memory_map_detail

struct memory_map::impl {
  std::string path;
  options opts;
  io::filesystem* fs = &io::os();
  //! The map file, holding memory_map_detail::map_held_byte shared while this instance lives (on
  //! the map). Declared before `marker`, so that it is closed after it: the hold outlives *in use*.
  io::file_handle map_hold;
  io::file_handle marker;  // the markers only: nothing else ever unlocks through it
  //! The lock file is on a filesystem other machines may share (io::fs_info::is_local false,
  //! or statfs failed): its content is never believed, and what is written there is synced
  //! before the init lock is let go. Set by join, under the init lock.
  std::atomic<bool> shared_filesystem{false};
  io::mapped_file lock_view;
  io::mapped_file map;
  memory_map_detail::slot_table table;
  std::string map_path;
  std::string fallback_path;
  detail::file_id fallback_id;  // threads reopen it by path: it must still be this file
  base::per_thread_states threads;

  // The map-in-use marker is dropped only when the degraded flags are set and no slot
  // carries a mark of this instance's users. A locker checks the flags again after it took
  // its slots (both sides publish, then look: seq_cst), so no map guard outlives the marker.
  base::mutex switch_mutex;
  bool map_in_use_released KEEL_GUARDED_BY(switch_mutex) = false;
  //! The user indexes this instance registered.
  std::vector<std::uint32_t> my_users KEEL_GUARDED_BY(switch_mutex);
  std::atomic<bool> fallback_ready{false};
  // The process whose descriptor `marker` is. A forked child shares its parent's, so that the
  // parent's unlocks (its close) would drop the child's markers too: a child joins again
  // through a descriptor of its own before its first use (rejoin_after_fork).
  std::atomic<std::uint32_t> creator_pid{0};
  std::uint64_t dev = 0;  // the lock file's identity: a child rejoins only the same file
  std::uint64_t ino = 0;
  base::mutex rejoin_mutex;  // one thread of a child rejoins; the others wait for it

  //! Whether the lock degraded (either flag set, or no map). On every lock: inline.
  [[nodiscard]] bool degraded() const noexcept {
    if (map.size() == 0) return true;  // (and lock_view may be unmapped: network filesystem)
    auto* lv = reinterpret_cast<std::uint64_t*>(lock_view.data() +
                                                memory_map_detail::lockfile_degraded_at);
    if (std::atomic_ref<std::uint64_t>(*lv).load() != 0) return true;
    return table.degraded_word().load() != 0;
  }

  // lifecycle.cpp
  //! Joins the users through `marker` (under the init lock, waited for until `d`): whether
  //! the lock must degrade.
  result<bool> join(io::deadline d = {}) noexcept;
  //! In a forked child, before its first use of an instance its parent opened: joins again
  //! through descriptors of its own. Cheap (a pid compare) when there is nothing to do.
  //! Keeps the lock call's deadline `cd` (an opener may hold the init lock).
  result<void> ensure_own_process(const io::countdown& cd) noexcept {
    if (creator_pid.load(std::memory_order_acquire) == io::self().pid) [[likely]] {
      return {};
    }
    return rejoin_after_fork(cd);
  }
  result<void> rejoin_after_fork(const io::countdown& cd) noexcept
      KEEL_EXCLUDES(rejoin_mutex, switch_mutex);
  result<memory_map_detail::thread_user*> mine() noexcept;

  // users.cpp
  result<void> register_user(memory_map_detail::thread_user& t) noexcept
      KEEL_EXCLUDES(switch_mutex);
  result<bool> recover_if_dead(const memory_map_detail::thread_user& t, std::uint32_t u,
                               std::size_t i) const noexcept;
  result<bool> recover_blockers(const memory_map_detail::thread_user& t,
                                std::size_t i) const noexcept;

  // fallback.cpp
  void release_map_in_use_if_idle() noexcept KEEL_EXCLUDES(switch_mutex);
  result<void> switch_to_fallback(const io::countdown& cd, bool spin) noexcept
      KEEL_EXCLUDES(switch_mutex);
  result<void> mark_degraded() noexcept;
  result<std::uint64_t> lock_on_fallback(std::span<const entity> sorted, const io::countdown& cd,
                                         bool spin) noexcept;
  result<void> unlock_on_fallback(std::span<const entity> sorted) noexcept;

  // memory_map.cpp
  //! One entity when nothing stands in the way (this thread registered, the instance its
  //! process's own, the slot free, the lock not degraded): the token, else nullopt (nothing
  //! taken; the general path decides).
  std::optional<std::uint64_t> take_one_fast(entity e) noexcept;
  enum class wait_outcome { taken, expired, degraded };
  result<std::optional<std::uint64_t>> lock_on_map(std::span<const entity> sorted,
                                                   const io::countdown& cd, bool spin) noexcept;
  result<wait_outcome> wait_for(memory_map_detail::thread_user& me,
                                const memory_map_detail::slot_request& r, const io::countdown& cd,
                                std::chrono::milliseconds& recovery) const noexcept;
  void give_up_turn(const memory_map_detail::thread_user& me,
                    const memory_map_detail::slot_request& r) const noexcept;
};

}  // namespace keel::lock
