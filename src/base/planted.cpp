#include "planted.hpp"

#include <array>
#include <utility>

namespace keel::base {

std::atomic<planted_bug> planted{planted_bug::none};

namespace {
constexpr std::array<std::pair<planted_bug, std::string_view>, 12> names{{
    {planted_bug::none, "none"},
    {planted_bug::memory_map_skips_recovery, "memory_map_skips_recovery"},
    {planted_bug::atomic_append_skips_header_sync, "atomic_append_skips_header_sync"},
    {planted_bug::atomic_append_ignores_failed_append, "atomic_append_ignores_failed_append"},
    {planted_bug::atomic_append_skips_checksum, "atomic_append_skips_checksum"},
    {planted_bug::cache_skips_fsync, "cache_skips_fsync"},
    {planted_bug::cache_forgets_failed_write_out, "cache_forgets_failed_write_out"},
    {planted_bug::kv_forgets_last_commit, "kv_forgets_last_commit"},
    {planted_bug::kv_skips_sync, "kv_skips_sync"},
    {planted_bug::kv_ignores_failed_manifest_write, "kv_ignores_failed_manifest_write"},
    {planted_bug::kv_skips_record_checksum, "kv_skips_record_checksum"},
    {planted_bug::aio_child_uses_parents_controller, "aio_child_uses_parents_controller"},
}};
}  // namespace

std::string_view to_string(planted_bug b) noexcept {
  for (const auto& [bug, name] : names) {
    if (bug == b) return name;
  }
  return "unknown";
}

bool planted_bug_from(std::string_view name, planted_bug& out) noexcept {
  for (const auto& [bug, n] : names) {
    if (n == name) {
      out = bug;
      return true;
    }
  }
  return false;
}

}  // namespace keel::base
