#pragma once
// memory_map's two formats (doc/lock-formats.md): the lock file, whose first page says where
// the shared map is and whether the lock has degraded, and the map file on tmpfs (a header
// page, the user table, the slot table; user liveness bytes far beyond). The checks here are
// everything memory_map believes about a file before it uses it; fuzz/ feeds them garbage.

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "base/format_header.hpp"
#include "keel/lock/memory_map.hpp"
#include "keel/result.hpp"

namespace keel::lock::memory_map_detail {

// ---- The lock file: one page of header, and three marker bytes far beyond it ----

constexpr std::size_t lockfile_page = 4096;
constexpr off_t marker_base = off_t{1} << 20;
constexpr off_t in_use_byte = marker_base + 0;      // shared by every open instance
constexpr off_t map_in_use_byte = marker_base + 1;  // shared by every instance on the map
constexpr off_t init_byte = marker_base + 2;        // exclusive while opening or closing
//! How long a closing user waits for the init lock before it leaves without the clean-up.
constexpr std::chrono::seconds close_init_wait{2};

struct lockfile_header {
  base::format_header head;
  std::uint64_t degraded;  // non-zero: every user goes to the fallback
  std::uint8_t boot_id[16];
  char map_path[208];  // absolute, NUL-terminated, its name keel-mm-<16 hex digits>
};
static_assert(sizeof(lockfile_header) == 256);
constexpr std::size_t lockfile_degraded_at = offsetof(lockfile_header, degraded);
constexpr std::size_t lockfile_map_path_at = offsetof(lockfile_header, map_path);
constexpr base::format lockfile_format{
    "KEELMML1", 2, base::layout_of({lockfile_page, sizeof(lockfile_header), marker_base})};

// ---- The map file ----

constexpr std::size_t map_header_size = 4096;
constexpr std::size_t map_degraded_at = 64;   // u64 mirror of the lock file's flag
constexpr std::size_t map_next_user_at = 72;  // u64: where the next registrant starts looking
constexpr std::size_t user_size = 64;
constexpr std::size_t users_at = map_header_size;
constexpr std::size_t max_users = memory_map::max_users;
constexpr std::size_t slots = memory_map::slots;
constexpr std::size_t bitset_words = max_users / 64;
// Writer word, a reserved word, the spinner, spin budget, woken on one cache line, then the
// reader set, then the waiter set.
constexpr std::size_t slot_size = 64 + 2 * bitset_words * 8;
constexpr std::size_t slots_at = users_at + max_users * user_size;
constexpr std::size_t map_size = slots_at + slots * slot_size;
constexpr off_t liveness_base = off_t{1} << 40;
//! Held shared, through a descriptor of its own, by every instance on the map for as long as
//! it lives, from before the map's header is written (a creator) or from its join: a map
//! with a header whose byte can be taken exclusively has no user, and can never get one (a
//! lock file naming it has no live user either, and its next first user makes a new map).
//! How maps whose users all died, and whose lock file is gone, are found and removed.
constexpr off_t map_held_byte = liveness_base - 1;
constexpr base::format map_format{"KEELMMT1", 7,
                                  base::layout_of({map_header_size, user_size, max_users, slots,
                                                   slot_size, liveness_base, map_held_byte})};

//! The prefix of a map file's name (then 16 lowercase hex digits).
constexpr std::string_view map_name_prefix = "keel-mm-";

//! What a lock file's first page says.
struct lock_file_state {
  bool blank = true;  //!< nobody has set it up (a fresh file, or its last user reset it)
  bool degraded = false;
  std::array<std::uint8_t, 16> boot_id{};
  std::string map_path;  //!< empty when degraded from the start
};

//! Reads a lock file's first bytes (`page` may be short: a fresh file is empty). Errors:
//! not_keel_file, unsupported_version, corrupt (at the offset of a bad field: a map path that
//! is not NUL-terminated, not absolute, or not named like a map).
[[nodiscard]] result<lock_file_state> parse_lock_file(std::span<const std::byte> page) noexcept;

//! Checks a map file's header (`bytes` from its start; a map is never blank: it is written
//! before its path is published). Errors: not_keel_file, unsupported_version, corrupt.
[[nodiscard]] result<void> check_map(std::span<const std::byte> bytes) noexcept;

//! Whether `name` (the last component of a path) is a map file's name.
[[nodiscard]] bool is_map_name(std::string_view name) noexcept;

}  // namespace keel::lock::memory_map_detail
