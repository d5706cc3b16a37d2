#include "atomic_append_format.hpp"

#include <xxhash.h>

#include <atomic>
#include <cstring>

#include "base/planted.hpp"

namespace keel::lock::atomic_append_detail {

std::uint64_t checksum_of(record r) noexcept {
  r.checksum = 0;
  r.released = 0;
  return XXH3_64bits(&r, sizeof r);
}

bool conflicts(const std::vector<std::uint64_t>& a, const std::vector<std::uint64_t>& b) noexcept {
  std::size_t i = 0;
  std::size_t j = 0;
  while (i < a.size() && j < b.size()) {
    const std::uint64_t av = a[i] & ~exclusive_bit;
    const std::uint64_t bv = b[j] & ~exclusive_bit;
    if (av < bv) {
      ++i;
    } else if (av > bv) {
      ++j;
    } else {
      if (((a[i] | b[j]) & exclusive_bit) != 0) return true;
      ++i;
      ++j;
    }
  }
  return false;
}

result<chunk_view> parse_chunk(off_t offset, std::span<const record> records) noexcept {
  if (records.empty()) return keel_error(errc::corrupt);
  const record& first = records[0];
  if (first.magic != record_magic || first.index != 0 || first.count == 0 ||
      first.count > records.size()) {
    return keel_error(errc::corrupt);
  }
  chunk_view c;
  c.offset = offset;
  c.length = static_cast<off_t>(first.count) * record_size;
  c.time_ns = first.time_ns;
  // The released flag is outside the checksum (its owner sets it later), so it takes one
  // of two values that no bit flip of 0 or of each other makes: anything else is
  // corruption, never a release.
  const std::uint32_t released = std::atomic_ref<const std::uint32_t>(first.released).load();
  if (released != 0 && released != released_mark && released != passed_mark) {
    return keel_error(errc::corrupt);
  }
  c.released = released != 0;
  c.passed = released == passed_mark;
  c.owner.pid = first.pid;
  c.owner.pid_ns = first.pid_ns;
  c.owner.start_time = first.start_time;
  std::memcpy(c.owner.boot_id.data(), first.boot_id, sizeof first.boot_id);
  for (std::size_t k = 0; k < first.count; ++k) {
    const record& r = records[k];
    if (r.magic != record_magic || r.index != k || r.count != first.count ||
        r.entities_here > atomic_append::entities_per_record ||
        (r.checksum != checksum_of(r) &&
         !base::is_planted(base::planted_bug::atomic_append_skips_checksum)) ||
        (k != 0 && r.released != 0)) {
      return keel_error(errc::corrupt);
    }
    c.entities.insert(c.entities.end(), r.entities, r.entities + r.entities_here);
  }
  return c;
}

}  // namespace keel::lock::atomic_append_detail
