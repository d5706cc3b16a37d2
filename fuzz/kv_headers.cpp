// keel::kv's store file and segment header parsers (src/kv/format.hpp) over garbage.
//
// Asserts: a store file that parses is exactly what encoding its parameters writes, and its
// parameters are in range; a segment header that parses (checked against the store it names,
// with the number it names) is exactly what encoding it writes.

#include <cstring>

#include "fuzz.hpp"
#include "kv/format.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace keel::kv::disk;
  const auto bytes = std::as_bytes(std::span(data, size));
  auto store = parse_store_file(bytes);
  if (store) {
    KEEL_FUZZ_CHECK(store->salt != 0);
    KEEL_FUZZ_CHECK(store->segment_size >= min_segment_size &&
                    store->segment_size <= max_segment_size);
    KEEL_FUZZ_CHECK(store->blob_threshold > 0 &&
                    store->blob_threshold <= store->segment_size - segment_header_size);
    // Byte for byte, but for the common header's reserved word, which check_header leaves
    // to later versions (and the checksum still covers).
    auto again = encode_store_file(*store);
    std::memcpy(again.data() + 20, data + 20, 4);
    std::memcpy(again.data() + store_checksum_at, data + store_checksum_at, 8);
    KEEL_FUZZ_CHECK(std::memcmp(again.data(), data, again.size()) == 0);
  }
  // The segment header: its claims (store id, number) taken from the bytes themselves, the
  // salt from the input's last 8 bytes.
  if (size >= 64 + 8) {
    std::array<std::uint8_t, 16> id{};
    std::memcpy(id.data(), data + 24, id.size());
    std::uint64_t number = 0, salt = 0;
    std::memcpy(&number, data + 40, 8);
    std::memcpy(&salt, data + size - 8, 8);
    auto seg = parse_segment_header(bytes, id, number, salt);
    if (seg) {
      KEEL_FUZZ_CHECK(seg->size >= segment_header_size);
      auto again = encode_segment_header(*seg, salt);
      std::memcpy(again.data() + 20, data + 20, 4);  // as above
      std::memcpy(again.data() + 56, data + 56, 8);
      KEEL_FUZZ_CHECK(std::memcmp(again.data(), data, 64) == 0);
    }
  }
  return 0;
}
