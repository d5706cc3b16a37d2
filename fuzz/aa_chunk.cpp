// atomic_append's record parser: atomic_append_detail::parse_chunk over records as read back from
// the log. The input is a 4-byte bit selector, then the records (a partial last record is dropped,
// as the log's reader drops it).
//
// Asserts: only corrupt comes back (without a file: the caller adds it); a chunk it accepts
// is what its records say (length, time, owner, released, every record's entities in order)
// and every record of it carries its checksum; and one flipped bit anywhere in an accepted
// chunk (the selected one) turns it into corrupt, never into another chunk or a release:
// the checksum covers every field but the released flag, which takes no value a single flip
// of 0, released_mark or passed_mark makes.

#include <cstring>
#include <vector>

#include "fuzz.hpp"
#include "lock/atomic_append_format.hpp"

namespace {

using namespace keel;
namespace atomic_append_detail = keel::lock::atomic_append_detail;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::input in(data, size);
  const auto selector = in.take<std::uint32_t>();
  const auto rest = in.rest();
  // Exactly as many records as given, so ASan sees a read past them.
  std::vector<atomic_append_detail::record> records(rest.size() /
                                                    sizeof(atomic_append_detail::record));
  if (!records.empty())
    std::memcpy(records.data(), rest.data(), records.size() * sizeof(atomic_append_detail::record));
  const off_t offset = atomic_append_detail::header_size +
                       static_cast<off_t>(selector % 64) * atomic_append_detail::record_size;

  const auto c = atomic_append_detail::parse_chunk(offset, records);
  if (!c) {
    KEEL_FUZZ_CHECK(c.error() == errc::corrupt && c.error().path().empty());
    return 0;
  }
  const atomic_append_detail::record& first = records.at(0);
  KEEL_FUZZ_CHECK(first.count >= 1 && first.count <= records.size());
  KEEL_FUZZ_CHECK(c->offset == offset &&
                  c->length == first.count * atomic_append_detail::record_size);
  KEEL_FUZZ_CHECK(c->time_ns == first.time_ns && c->owner.pid == first.pid &&
                  c->owner.start_time == first.start_time &&
                  std::memcmp(c->owner.boot_id.data(), first.boot_id, 16) == 0);
  KEEL_FUZZ_CHECK(c->released == (first.released == atomic_append_detail::released_mark ||
                                  first.released == atomic_append_detail::passed_mark));
  KEEL_FUZZ_CHECK(c->passed == (first.released == atomic_append_detail::passed_mark));
  std::vector<std::uint64_t> entities;
  for (std::size_t k = 0; k < first.count; ++k) {
    const atomic_append_detail::record& r = records[k];
    KEEL_FUZZ_CHECK(r.checksum == atomic_append_detail::checksum_of(r));
    KEEL_FUZZ_CHECK(r.entities_here <= lock::atomic_append::entities_per_record);
    entities.insert(entities.end(), r.entities, r.entities + r.entities_here);
  }
  KEEL_FUZZ_CHECK(c->entities == entities);

  // One bit flipped in the chunk, whichever: corrupt.
  std::vector<atomic_append_detail::record> flipped(records.begin(), records.begin() + first.count);
  const std::size_t bit =
      (selector / 64) % (flipped.size() * sizeof(atomic_append_detail::record) * 8);
  reinterpret_cast<std::uint8_t*>(flipped.data())[bit / 8] ^= std::uint8_t(1u << (bit % 8));
  const auto f = atomic_append_detail::parse_chunk(offset, flipped);
  KEEL_FUZZ_CHECK(!f && f.error() == errc::corrupt);
  return 0;
}
