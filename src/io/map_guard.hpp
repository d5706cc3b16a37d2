#pragma once
// The guard over keel's writable maps: a page fault the filesystem refuses for a moment is
// waited out instead of killing the process (mapped_file.hpp, "SIGBUS").
//
// btrfs reserves room for every write fault on a shared map (`btrfs_page_mkwrite`), for
// pages already allocated and already dirty too, and turns a reservation it cannot make at
// once into SIGBUS: with a thousand processes writing one store, a volume a third full
// killed hundreds of them (`keel-bench spacebench --fs btrfs --blurt-tasks 1000`). write(2) gets
// ENOSPC there; a store instruction has no way to return it.
//
// The guard keeps the address ranges of the process's writable maps in a table a signal
// handler can read (fixed size, atomics only). Its SIGBUS handler, installed when the first
// writable map is made and only if SIGBUS still has its default action, looks the faulting
// address up: in a guarded range (BUS_ADRERR, the code a refused fault raises) it sleeps a
// little and returns, so the store instruction runs again and the kernel asks the
// filesystem once more; it backs off from 1 ms to 50 ms, and gives up after 20 s of one
// thread faulting at one address (under the store's default 30 s lock_timeout, which others
// waiting on this thread measure), when it restores the default action, so the next fault
// kills the process as it would have without the guard. Any other SIGBUS is handed to
// the default action at once. An application that installs its own SIGBUS handler before
// keel's first writable map keeps it, and the guard stays out of the way.
//
// A way out (`escape`): a refused fault a call cannot wait out must not kill the process
// either. A call whose shared state survives its writer being killed at any instruction (a
// commit: doc/kv-format.md, "Dead writers") arms an escape around the stores it makes; a
// refused fault there, once the call's deadline has passed, jumps back to it (siglongjmp),
// and the call goes on as its own dead writer would be settled, failing with what the volume
// says. Nothing between the arm and the fault may need its destructor to run or hold a mutex
// when it faults: code that does (say, a settler with vectors, under a byte lock) holds a
// `no_escape` meanwhile, and a fault there waits as any other.
//
// Limits: BUS_ADRERR also reports lasting failures (an I/O error reading a page in, a file
// cut short under its map, a quota): those now kill after 20 s instead of at once. A thread
// that blocks SIGBUS gets the kernel's default action on a fault, guard or not. A thread
// that unmaps a map while another faults in it was already racing; the retry makes the
// window longer. With the table full (65 536 maps), further maps work unguarded.

#include <setjmp.h>

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace keel::io::map_guard {

//! Guards [addr, addr + length): a refused write fault there is retried. No-op when the
//! table is full (the map then works unguarded) or when the handler could not be installed.
void add(void* addr, std::size_t length) noexcept;

//! Stops guarding the range that starts at `addr` (before it is unmapped or moved).
void remove(void* addr) noexcept;

//! Faults the handler has retried in this process so far (for tests and stats).
[[nodiscard]] std::uint64_t retried() noexcept;

//! Whether the handler is installed (false: SIGBUS had another disposition first, or
//! KEEL_MAP_GUARD=0 turned it off).
[[nodiscard]] bool installed() noexcept;

//! Where a refused fault jumps to (`arm`): filled by `sigsetjmp(e.at, 0)` in the frame that
//! stays active until `disarm`.
struct escape {
  sigjmp_buf at;
};

//! From now until `disarm`, a refused fault in a guarded range that this thread still meets
//! at `deadline` (CLOCK_MONOTONIC, the steady clock's), or past the give-up time, and that
//! has been refused for at least 100 ms, jumps to `e.at` (sigsetjmp returns 1), disarmed,
//! SIGBUS unblocked; until then faults are waited out as usual (never given up on: the
//! escape comes first). One escape per thread: arming again replaces it.
void arm(escape& e, std::chrono::steady_clock::time_point deadline) noexcept;

//! Ends this thread's escape (a no-op when none is armed).
void disarm() noexcept;

//! While one exists on this thread, its escape is not taken: a refused fault is waited out
//! (and given up on) as without one. For code that holds a mutex, a lock or memory.
class no_escape {
 public:
  no_escape() noexcept;
  ~no_escape();
  no_escape(const no_escape&) = delete;
  no_escape& operator=(const no_escape&) = delete;
};

//! Whether this thread has an escape armed (arm) or held back (no_escape).
[[nodiscard]] bool escape_in_force() noexcept;

namespace detail {
//! This thread's escape state (run_escapable sets it aside and puts it back).
struct escape_saved {
  escape* to;
  std::int64_t deadline_ns;
  unsigned held_back;
};
//! This thread's escape state, which is then none armed and none held back.
[[nodiscard]] escape_saved set_aside() noexcept;
//! Puts back what set_aside took.
void put_back(const escape_saved& was) noexcept;
}  // namespace detail

//! Runs `stores` with an escape of their own armed until `deadline`. True once they all
//! ran; false when a refused fault among them escaped, some of them perhaps landed. `stores`
//! may only store to guarded maps and compute: nothing in it may need a destructor run or
//! hold a mutex, a lock or memory. The jump lands here, so it may run where a wider escape
//! may not (inside a no_escape, holding a mutex: the caller's scope stays whole); whatever
//! this thread had armed or held back before is as it was after, escaped or not.
template <class F>
[[nodiscard]] bool run_escapable(std::chrono::steady_clock::time_point deadline,
                                 F&& stores) noexcept {
  const detail::escape_saved was = detail::set_aside();
  escape e;
  if (sigsetjmp(e.at, 0) != 0) {
    detail::put_back(was);
    return false;
  }
  arm(e, deadline);
  stores();
  disarm();
  detail::put_back(was);
  return true;
}
//! Escapes this process has taken so far (for tests and stats).
[[nodiscard]] std::uint64_t escaped() noexcept;

//! How long one fault is retried before the default action (20 s unless a test shortens it).
void set_give_up(std::chrono::nanoseconds after) noexcept;

}  // namespace keel::io::map_guard
