#pragma once
// The walk of a segment's blocks (doc/kv-format.md, "Segments" and "Recovery"): each block
// whose header checks out, and what lies between them, told apart from damage. Recovery,
// compaction, verify and the manifest's sealing walk segments through here; it reads only.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>

#include "keel/result.hpp"
#include "kv/format.hpp"
#include "kv/segment_map.hpp"

namespace keel::kv {

//! Calls `f(offset, header)` for every block of segment `s` (of a store salted `salt`) whose
//! header checks out, complete or not, in order, from offset `from` (a block's, or space to
//! step over) on; space between them is stepped over 8 bytes at a time, and a block by its
//! length (its writer reserved all of it). What lies between blocks is told: a block keel
//! left on purpose (disk::spanned_block: voided, abandoned) is stepped over whole, after
//! `spanned(offset, length)`; and the space below location `known_below` (written whole: the
//! manifest's durable below) must be blocks, zeros or such blocks: at any other byte there,
//! `unexplained(offset, 8)` is called before stepping on (a block whose header was damaged is
//! found so, never taken for space nobody wrote). Each callback returns result<void>; an
//! error stops the walk (as does offset `end`).
template <class F, class Unexplained, class Spanned>
[[nodiscard]] result<void> walk_blocks(const segment& s, std::uint64_t salt, std::uint64_t from,
                                       F&& f, std::uint64_t known_below, Unexplained&& unexplained,
                                       Spanned&& spanned, std::uint64_t end = UINT64_MAX) noexcept {
  const std::span<const std::byte> bytes = s.bytes();
  std::uint64_t off = std::max<std::uint64_t>(from, disk::segment_header_size);
  while (off < end && off + sizeof(disk::block_header) <= s.size) {
    std::uint32_t magic = 0;
    std::memcpy(&magic, bytes.data() + off, 4);
    auto head = magic == disk::block_magic ? disk::parse_block_header(bytes.subspan(off), salt)
                                           : keel_error(errc::corrupt);
    if (head) {
      if (auto r = f(off, *head); !r) return r;
      off += head->length;
      continue;
    }
    std::uint64_t word = 0;
    std::memcpy(&word, bytes.data() + off, 8);
    if (word != 0) {
      if (auto length = disk::spanned_block(bytes.subspan(off), salt)) {
        if (auto r = spanned(off, *length); !r) return r;
        off += *length;
        continue;
      }
      if (disk::make_location(s.number, off) < known_below) {
        if (auto r = unexplained(off, std::uint64_t{8}); !r) return r;
      }
    }
    off += 8;
  }
  return {};
}

}  // namespace keel::kv
