#pragma once
// Bugs planted on purpose, for the torture harness to prove it catches them (a harness that
// passes a broken build proves nothing). Off unless a test or `keel-bench torture --plant` turns
// one on; where one is checked, the cost is one relaxed load on a path that is not hot.

#include <atomic>
#include <cstdint>
#include <string_view>

namespace keel::base {

enum class planted_bug : std::uint8_t {
  none,
  memory_map_skips_recovery,            //!< a dead user's slots are never cleared (kill catches)
  atomic_append_skips_header_sync,      //!< a new log's header is not fsynced (powerloss catches)
  atomic_append_ignores_failed_append,  //!< a failed append is taken as held (io-errors)
  atomic_append_skips_checksum,         //!< records are believed without their checksum (corrupt)
  cache_skips_fsync,  //!< the aio cache answers fsync without writing out or syncing (powerloss)
  cache_forgets_failed_write_out,     //!< the cache drops pages it failed to write (io-errors)
  kv_forgets_last_commit,             //!< an opener alone makes the newest commit invisible (kill)
  kv_skips_sync,                      //!< a group sync syncs nothing (powerloss)
  kv_ignores_failed_manifest_write,   //!< a segment whose listing failed is used (io-errors)
  kv_skips_record_checksum,           //!< records are read without their checksum (corrupt)
  aio_child_uses_parents_controller,  //!< a forked child runs the inherited controller (fork)
};

//! The bug planted in this process (none by default).
extern std::atomic<planted_bug> planted;

[[nodiscard]] inline bool is_planted(planted_bug b) noexcept {
  return planted.load(std::memory_order_relaxed) == b;
}

[[nodiscard]] std::string_view to_string(planted_bug b) noexcept;
//! The bug named `name` (as to_string spells it), or false.
[[nodiscard]] bool planted_bug_from(std::string_view name, planted_bug& out) noexcept;

}  // namespace keel::base
