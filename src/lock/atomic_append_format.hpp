#pragma once
// atomic_append's log format (doc/lock-formats.md): the header page and its self-checking
// hints, the 256-byte record, and the parser that turns records read back from the log into
// chunks. Everything here works on bytes alone (no files), so fuzz/ can feed it garbage;
// atomic_append.cpp holds the protocol, and inspect reads the log through this too.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "base/format_header.hpp"
#include "io/process.hpp"
#include "keel/lock/atomic_append.hpp"
#include "keel/result.hpp"

namespace keel::lock::atomic_append_detail {

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

// The first-live hint: an offset in the log (a chunk's start: after a torn append, not
// always a multiple of the record size) shared by every user through the header map and
// updated with compare-and-swap, so it cannot have a checksum of its own beside it. It
// carries one inside: 40 bits of offset (logs up to 1 TiB) and 24 bits of a hash of them. A damaged
// hint (a flipped bit would otherwise make readers skip a live record) reads as the start of the
// log: a longer scan, never a wrong answer.
class live_hint {
 public:
  explicit live_hint(std::uint64_t* word) noexcept : word_(*word) {}

  static constexpr std::uint64_t encode(std::uint64_t offset) noexcept {
    const std::uint64_t units = offset & units_mask;
    return units | check_of(units) << 40;
  }
  //! A 40-bit value as `encode` stores it, or nullopt if its check does not match.
  static constexpr std::optional<std::uint64_t> checked(std::uint64_t raw) noexcept {
    const std::uint64_t units = raw & units_mask;
    if (raw >> 40 != check_of(units)) return std::nullopt;
    return units;
  }
  static constexpr std::uint64_t decode(std::uint64_t raw) noexcept {
    const std::uint64_t units = raw & units_mask;
    if (raw >> 40 != check_of(units) || units < static_cast<std::uint64_t>(header_size)) {
      return header_size;
    }
    return units;
  }

  [[nodiscard]] std::uint64_t load(std::memory_order o = std::memory_order_seq_cst) const noexcept {
    return decode(word_.load(o));
  }
  void store(std::uint64_t offset, std::memory_order o = std::memory_order_seq_cst) noexcept {
    word_.store(encode(offset), o);
  }
  //! Replaces `expected` with `desired`; else loads the hint into `expected`.
  bool compare_exchange(std::uint64_t& expected, std::uint64_t desired,
                        std::memory_order o = std::memory_order_seq_cst) noexcept {
    std::uint64_t raw = word_.load(std::memory_order_acquire);
    if (decode(raw) != expected) {
      expected = decode(raw);
      return false;
    }
    if (word_.compare_exchange_strong(raw, encode(desired), o)) return true;
    expected = decode(raw);
    return false;
  }

 private:
  static constexpr std::uint64_t units_mask = (std::uint64_t{1} << 40) - 1;
  static constexpr std::uint64_t check_of(std::uint64_t units) noexcept {
    return ((units * 0x9e3779b97f4a7c15ULL) >> 40) & 0xffffff;
  }
  std::atomic_ref<std::uint64_t> word_;
};

//! A record's word for an entity: its value, and exclusive in the top bit.
constexpr std::uint64_t exclusive_bit = std::uint64_t{1} << 63;
[[nodiscard]] inline std::uint64_t pack(entity e) noexcept {
  return e.value | (static_cast<std::uint64_t>(e.exclusive) << 63);
}

//! Whether two sets of packed entities (each sorted by value) share an entity that either
//! side wants exclusively.
[[nodiscard]] bool conflicts(const std::vector<std::uint64_t>& a,
                             const std::vector<std::uint64_t>& b) noexcept;

//! XXH3 of `r` with its checksum and released flag zeroed.
[[nodiscard]] std::uint64_t checksum_of(record r) noexcept;

//! One chunk as read back from the log.
struct chunk_view {
  off_t offset = 0;
  off_t length = 0;
  std::uint64_t time_ns = 0;
  bool released = false;
  bool passed = false;  // released with passed_mark
  io::process_identity owner;
  std::vector<std::uint64_t> entities;  // sorted, as written
};

//! Reads the chunk starting at `offset`; `records` holds what was read from there on (at
//! least the whole chunk). Errors: corrupt (without a file or offset: the caller knows them)
//! when the first record does not start a chunk, the chunk is longer than `records`, any of
//! its records fails its checksum or names another chunk, or a released flag is not 0,
//! released_mark or passed_mark.
[[nodiscard]] result<chunk_view> parse_chunk(off_t offset,
                                             std::span<const record> records) noexcept;

}  // namespace keel::lock::atomic_append_detail
