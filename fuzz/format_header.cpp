// base::check_header, the first check of every file keel reads, against each real format
// (memory_map's lock file and map, atomic_append's log), and memory_map_detail::check_map over it.
//
// Asserts: the verdict follows from the bytes alone (blank: the first min(n, 24) bytes are zero;
// ours: a whole header equal to the format's; not_keel_file: another magic or a short
// non-zero prefix; unsupported_version: the magic with another version or layout); nothing
// else comes back; check_map refuses a blank map as corrupt and agrees otherwise.

#include <algorithm>
#include <cstring>

#include "base/format_header.hpp"
#include "fuzz.hpp"
#include "lock/atomic_append_format.hpp"
#include "lock/memory_map/format.hpp"

namespace {

using namespace keel;

void check_against(std::span<const std::byte> bytes, const base::format& f) {
  const auto r = base::check_header(bytes, f);
  const std::size_t n = std::min(bytes.size(), sizeof(base::format_header));
  const bool zero = std::all_of(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n),
                                [](std::byte b) { return b == std::byte{0}; });
  if (zero) {
    KEEL_FUZZ_CHECK(r && *r == base::header_state::blank);
    return;
  }
  if (bytes.size() < sizeof(base::format_header)) {
    KEEL_FUZZ_CHECK(!r && r.error() == errc::not_keel_file);
    return;
  }
  base::format_header h{};
  std::memcpy(&h, bytes.data(), sizeof h);
  const base::format_header want = f.header();
  if (std::memcmp(h.magic, want.magic, sizeof h.magic) != 0) {
    KEEL_FUZZ_CHECK(!r && r.error() == errc::not_keel_file);
  } else if (h.version != want.version || h.layout != want.layout) {
    KEEL_FUZZ_CHECK(!r && r.error() == errc::unsupported_version);
  } else {
    // The reserved word is not checked: a later version may use it without a new layout.
    KEEL_FUZZ_CHECK(r && *r == base::header_state::ours);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  check_against(bytes, lock::memory_map_detail::lockfile_format);
  check_against(bytes, lock::memory_map_detail::map_format);
  check_against(bytes, lock::atomic_append_detail::log_format);

  const auto map = lock::memory_map_detail::check_map(bytes);
  const auto header = base::check_header(bytes, lock::memory_map_detail::map_format);
  if (header && *header == base::header_state::blank) {
    KEEL_FUZZ_CHECK(!map && map.error() == errc::corrupt);
  } else {
    KEEL_FUZZ_CHECK(map.has_value() == header.has_value());
    if (!map) KEEL_FUZZ_CHECK(map.error() == header.error());
  }
  return 0;
}
