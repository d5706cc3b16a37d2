#pragma once
// atomic_append's log format (doc/lock-formats.md): the header page, the 256-byte record and
// the parser that turns records read back from the log into chunks. Everything here works on
// bytes alone (no files), so fuzz/ can feed it garbage; atomic_append.cpp holds the protocol.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "base/format_header.hpp"
#include "base/process.hpp"
#include "keel/lock/atomic_append.hpp"
#include "keel/result.hpp"

namespace keel::lock::aa {

// The header is one page; records follow.
constexpr off_t header_size = 4096;
constexpr off_t header_lock_byte = 8;      // shared: appending; exclusive: truncating
constexpr off_t in_use_byte = 9;           // shared by every open instance
constexpr std::size_t first_live_at = 64;  // live hint (atomic_append.cpp): no live record before
constexpr std::size_t punched_to_at = 72;  // the end of the punched prefix (a hint, likewise)
// Torn appends: (offset, length) of appends the filesystem took only part of (a full disk),
// noted by their appender before it lets go of the header lock, so readers step over them.
constexpr std::size_t torn_notes_at = 128;
constexpr std::size_t torn_notes = 8;
constexpr std::uint32_t record_magic = 0x3152414b;   // "KAR1"
constexpr std::uint32_t released_mark = 0x444c5352;  // "RSLD": withdrawn, or its owner died
// Released by an owner that held it: every earlier chunk that conflicts with this one was
// released before it was granted (waiters rely on it to wait on the nearest chunk only).
constexpr std::uint32_t passed_mark = 0x53534150;  // "PASS"

struct record {
  std::uint32_t magic;
  std::uint16_t index;  // within its chunk (the records one lock call appended)
  std::uint16_t count;  // records in the chunk
  std::uint32_t pid;
  std::uint32_t entities_here;
  std::uint64_t start_time;
  std::uint64_t time_ns;
  std::uint8_t boot_id[16];
  std::uint64_t checksum;  // XXH3 of the record with checksum and released zeroed
  std::uint32_t released;  // passed_mark, set by the owner on unlock; released_mark when it
                           // gave up waiting or was found dead; 0 while held
  std::uint32_t pid_ns;    // the owner's pid namespace (0: unknown)
  std::uint64_t entities[atomic_append::entities_per_record];  // value | exclusive << 63
};
static_assert(sizeof(record) == 256);
constexpr off_t record_size = sizeof(record);
constexpr off_t released_at = offsetof(record, released);
constexpr base::format log_format{
    "KEELAALG", 4,
    base::layout_of({header_size, record_size, first_live_at, punched_to_at, torn_notes_at,
                     torn_notes, atomic_append::entities_per_record})};

//! XXH3 of `r` with its checksum and released flag zeroed.
[[nodiscard]] std::uint64_t checksum_of(record r) noexcept;

//! One chunk as read back from the log.
struct chunk_view {
  off_t offset = 0;
  off_t length = 0;
  std::uint64_t time_ns = 0;
  bool released = false;
  bool passed = false;  // released with passed_mark
  base::process_identity owner;
  std::vector<std::uint64_t> entities;  // sorted, as written
};

//! Reads the chunk starting at `offset`; `records` holds what was read from there on (at
//! least the whole chunk). Errors: corrupt (without a file or offset: the caller knows them)
//! when the first record does not start a chunk, the chunk is longer than `records`, any of
//! its records fails its checksum or names another chunk, or a released flag is not 0,
//! released_mark or passed_mark.
[[nodiscard]] result<chunk_view> parse_chunk(off_t offset,
                                             std::span<const record> records) noexcept;

}  // namespace keel::lock::aa
