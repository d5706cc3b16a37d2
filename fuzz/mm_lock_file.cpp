// memory_map's lock file: memory_map_detail::parse_lock_file over the first page as read from disk
// (any length: a fresh file is empty), and memory_map_detail::is_map_name, which decides whether a
// path in that page may be followed.
//
// Asserts: only not_keel_file, unsupported_version or corrupt come back, corrupt at the map
// path's offset (or at the end of a page too short to hold the header); what it accepts is
// what the bytes say (the degraded flag, the boot id, the path); a path it accepts is
// absolute, shorter than its field and ends in a map's name, and an empty one only when
// degraded; a state written back as a header parses to the same state; is_map_name agrees
// with the name's definition (the prefix, then 16 lowercase hex digits).

#include <algorithm>
#include <cstring>
#include <string_view>

#include "fuzz.hpp"
#include "lock/memory_map/format.hpp"

namespace {

using namespace keel;
namespace memory_map_detail = keel::lock::memory_map_detail;

bool is_map_name_by_definition(std::string_view name) {
  if (name.size() != memory_map_detail::map_name_prefix.size() + 16) return false;
  if (name.substr(0, memory_map_detail::map_name_prefix.size()) !=
      memory_map_detail::map_name_prefix)
    return false;
  for (char c : name.substr(memory_map_detail::map_name_prefix.size()))
    if (std::string_view("0123456789abcdef").find(c) == std::string_view::npos) return false;
  return true;
}

std::array<std::byte, memory_map_detail::lockfile_page> page_of(
    const memory_map_detail::lock_file_state& s) {
  memory_map_detail::lockfile_header h{};
  h.head = memory_map_detail::lockfile_format.header();
  h.degraded = s.degraded ? 1 : 0;
  std::copy(s.boot_id.begin(), s.boot_id.end(), h.boot_id);
  std::memcpy(h.map_path, s.map_path.data(), s.map_path.size());
  std::array<std::byte, memory_map_detail::lockfile_page> page{};
  std::memcpy(page.data(), &h, sizeof h);
  return page;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  KEEL_FUZZ_CHECK(memory_map_detail::is_map_name(text) == is_map_name_by_definition(text));

  const auto r = memory_map_detail::parse_lock_file(bytes);
  if (!r) {
    const error& e = r.error();
    KEEL_FUZZ_CHECK(e == errc::not_keel_file || e == errc::unsupported_version ||
                    e == errc::corrupt);
    if (e == errc::corrupt) {
      KEEL_FUZZ_CHECK(e.offset() == memory_map_detail::lockfile_map_path_at ||
                      (size < sizeof(memory_map_detail::lockfile_header) && e.offset() == size));
    }
    return 0;
  }
  const auto header = base::check_header(bytes, memory_map_detail::lockfile_format);
  KEEL_FUZZ_CHECK(header);
  if (r->blank) {
    KEEL_FUZZ_CHECK(*header == base::header_state::blank);
    KEEL_FUZZ_CHECK(!r->degraded && r->map_path.empty());
    return 0;
  }
  KEEL_FUZZ_CHECK(*header == base::header_state::ours);
  KEEL_FUZZ_CHECK(size >= sizeof(memory_map_detail::lockfile_header));
  memory_map_detail::lockfile_header h{};
  std::memcpy(&h, data, sizeof h);
  KEEL_FUZZ_CHECK(r->degraded == (h.degraded != 0));
  KEEL_FUZZ_CHECK(std::equal(r->boot_id.begin(), r->boot_id.end(), h.boot_id));
  const std::string& p = r->map_path;
  KEEL_FUZZ_CHECK(p.size() < sizeof h.map_path);
  KEEL_FUZZ_CHECK(std::memcmp(p.data(), h.map_path, p.size()) == 0 && h.map_path[p.size()] == 0);
  if (p.empty()) {
    KEEL_FUZZ_CHECK(r->degraded);
  } else {
    KEEL_FUZZ_CHECK(p[0] == '/');
    KEEL_FUZZ_CHECK(is_map_name_by_definition(std::string_view(p).substr(p.rfind('/') + 1)));
  }

  const auto again = memory_map_detail::parse_lock_file(page_of(*r));
  KEEL_FUZZ_CHECK(again);
  KEEL_FUZZ_CHECK(!again->blank && again->degraded == r->degraded && again->boot_id == r->boot_id &&
                  again->map_path == r->map_path);
  return 0;
}
