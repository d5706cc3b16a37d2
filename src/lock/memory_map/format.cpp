#include "format.hpp"

#include <algorithm>
#include <cstring>

namespace keel::lock::memory_map_detail {

bool is_map_name(std::string_view name) noexcept {
  if (name.size() != map_name_prefix.size() + 16 || !name.starts_with(map_name_prefix)) {
    return false;
  }
  return std::all_of(name.begin() + static_cast<std::ptrdiff_t>(map_name_prefix.size()), name.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

result<lock_file_state> parse_lock_file(std::span<const std::byte> page) noexcept {
  auto state = base::check_header(page, lockfile_format);
  if (!state) return std::unexpected(state.error());
  lock_file_state out;
  if (*state == base::header_state::blank) return out;
  if (page.size() < sizeof(lockfile_header)) {
    return std::unexpected(error(make_error_code(errc::corrupt), std::string_view{}, page.size()));
  }
  lockfile_header h{};
  std::memcpy(&h, page.data(), sizeof h);
  out.blank = false;
  out.degraded = h.degraded != 0;
  std::copy(std::begin(h.boot_id), std::end(h.boot_id), out.boot_id.begin());
  const char* end = std::find(std::begin(h.map_path), std::end(h.map_path), '\0');
  const auto bad_path = std::unexpected(
      error(make_error_code(errc::corrupt), std::string_view{}, lockfile_map_path_at));
  if (end == std::end(h.map_path)) return bad_path;
  const std::string_view p(h.map_path, static_cast<std::size_t>(end - h.map_path));
  if (p.empty()) {
    if (!out.degraded) return bad_path;  // a live map with no path
    return out;
  }
  const auto slash = p.rfind('/');
  if (p[0] != '/' || slash == std::string_view::npos || !is_map_name(p.substr(slash + 1))) {
    return bad_path;
  }
  out.map_path = std::string(p);
  return out;
}

result<void> check_map(std::span<const std::byte> bytes) noexcept {
  auto state = base::check_header(bytes, map_format);
  if (!state) return std::unexpected(state.error());
  if (*state == base::header_state::blank) return keel_error(errc::corrupt);
  return {};
}

}  // namespace keel::lock::memory_map_detail
