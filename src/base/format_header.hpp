#pragma once
// The first bytes of every file and shared-memory table keel writes: what it is (a magic),
// which version of its format, and a fingerprint of the layout this build gives it (record
// sizes, table sizes: what LMDB folds into its lock file's magic). A reader checks all three
// before it believes anything else in the file: a file that is not keel's is refused with
// not_keel_file (and never written to), one of another version or layout with
// unsupported_version, never misread.

#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>
#include <string_view>

#include "keel/result.hpp"

namespace keel::base {

//! On disk: 24 bytes, little-endian (the host's; keel's files are local to one machine or
//! to machines of one architecture).
struct format_header {
  char magic[8];
  std::uint32_t version;
  std::uint32_t reserved;  // 0
  std::uint64_t layout;
};
static_assert(sizeof(format_header) == 24);

//! What a format expects of its header.
struct format {
  std::string_view magic;  // 8 characters
  std::uint32_t version;
  std::uint64_t layout;

  [[nodiscard]] format_header header() const noexcept {
    format_header h{};
    std::memcpy(h.magic, magic.data(), std::min(magic.size(), sizeof h.magic));
    h.version = version;
    h.layout = layout;
    return h;
  }
};

//! A fingerprint of a layout's numbers (FNV-1a over them).
[[nodiscard]] constexpr std::uint64_t layout_of(std::initializer_list<std::uint64_t> numbers) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (std::uint64_t n : numbers) {
    for (int i = 0; i < 8; ++i) {
      h ^= (n >> (8 * i)) & 0xff;
      h *= 0x100000001b3ULL;
    }
  }
  return h;
}

enum class header_state : std::uint8_t {
  blank,  //!< all zeros (or too short and empty): nobody has written the file yet
  ours,   //!< this format, this version, this layout
};

//! Checks the first bytes of a file against `f`. Errors: not_keel_file (another magic, or
//! fewer bytes than a header that are not all zero), unsupported_version (the magic, with
//! another version or layout).
[[nodiscard]] inline result<header_state> check_header(std::span<const std::byte> bytes,
                                                       const format& f) noexcept {
  bool zero = true;
  for (std::size_t i = 0; i < std::min(bytes.size(), sizeof(format_header)) && zero; ++i)
    zero = bytes[i] == std::byte{0};
  if (zero) return header_state::blank;
  if (bytes.size() < sizeof(format_header)) return keel_error(errc::not_keel_file);
  format_header h{};
  std::memcpy(&h, bytes.data(), sizeof h);
  if (std::string_view(h.magic, sizeof h.magic) != f.magic) return keel_error(errc::not_keel_file);
  if (h.version != f.version || h.layout != f.layout) return keel_error(errc::unsupported_version);
  return header_state::ours;
}

}  // namespace keel::base
