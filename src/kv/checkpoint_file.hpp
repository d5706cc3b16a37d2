#pragma once
// The checkpoint file (doc/kv-format.md, "Checkpoints and recovery"): its first page's words,
// the index pages after it at their own numbers, the segment numbers, and the checksum that
// chains its pages. Written by checkpoint_write.cpp, read by checkpoint.cpp (load_checkpoint).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "kv/store_impl.hpp"

namespace keel::kv::checkpoint_file {

inline constexpr const char* checkpoint_name = "checkpoint";
// Version 3: key hashes seeded with the store's salt (a version 2 copy's hashes are
// unseeded: passed over, and the log replayed).
inline constexpr base::format checkpoint_format{"KEELKVC1", 3, index_format.layout};

// The checkpoint's first page (the index pages follow it, from first_free_page on).
namespace cp {
constexpr std::size_t store_id = 24;
constexpr std::size_t seq = 40;   // S: the copy holds every commit up to S and none above
constexpr std::size_t from = 48;  // where replay starts: every commit above S lies at or after
constexpr std::size_t directory = 56;
constexpr std::size_t pages_used = 64;
constexpr std::size_t live_records = 72;
constexpr std::size_t live_bytes = 80;
constexpr std::size_t dead_bytes = 88;
constexpr std::size_t retired_pages = 96;
constexpr std::size_t segments = 104;  // how many segment numbers follow the index pages
}  // namespace cp

inline void put64(std::byte* at, std::uint64_t v) noexcept {
  std::memcpy(at, &v, 8);
}
inline std::uint64_t get64(const std::byte* at) noexcept {
  std::uint64_t v = 0;
  std::memcpy(&v, at, 8);
  return v;
}

// The checksum of a checkpoint: its pages' checksums chained, each seeded with the one before
// and the page's number, so that pages cannot trade places.
inline std::uint64_t chain(std::uint64_t c, std::uint64_t page, std::span<const std::byte> bytes,
                           std::uint64_t salt) noexcept {
  return disk::checksum(bytes, salt ^ (c * 0x9e3779b97f4a7c15ULL) ^ page);
}

}  // namespace keel::kv::checkpoint_file
