// keel::kv's block and record parsers (src/kv/format.hpp) over garbage: the first 8 bytes are
// the salt, the rest a block as it would sit in a segment.
//
// Asserts: nothing read lies outside the input; a complete block is exactly what encoding
// its records (or its value) again writes, byte for byte, so no two byte strings are read as
// the same block; a record that parses fits in what it was given.

#include <cstring>
#include <vector>

#include "fuzz.hpp"
#include "kv/format.hpp"

namespace {

using namespace keel::kv::disk;

void check_records_reencode(std::span<const std::byte> block, const block_header& h,
                            std::uint64_t salt) {
  std::vector<record_in> records;
  std::size_t at = sizeof(block_header);
  for (std::uint32_t i = 0; i < h.records; ++i) {
    auto r = parse_record(block.subspan(at), salt, true);
    KEEL_FUZZ_CHECK(r.has_value());
    KEEL_FUZZ_CHECK(r->size <= block.size() - at);
    record_in in;
    in.key = r->key;
    in.what = static_cast<op>(r->head.op);
    in.value = r->value;
    in.blob = r->blob;
    in.value_length = r->head.value_length;
    in.prev = r->head.prev;
    in.prev_seq = r->head.prev_seq;
    in.seq = r->head.seq;
    records.push_back(in);
    at += r->size;
  }
  const auto kind = static_cast<block_kind>(h.kind);
  if (kind == block_kind::relocation && h.records == 0) {
    std::vector<std::byte> pad(block.size());
    encode_pad_block(pad, salt);
    KEEL_FUZZ_CHECK(std::memcmp(pad.data(), block.data(), pad.size()) == 0);
    return;
  }
  KEEL_FUZZ_CHECK(block_size(records) == block.size());
  std::vector<std::byte> again(block.size());
  encode_block(again, kind, h.seq, records, salt);
  KEEL_FUZZ_CHECK(std::memcmp(again.data(), block.data(), again.size()) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  keel::fuzz::input in(data, size);
  const auto salt = in.take<std::uint64_t>();
  const auto bytes =
      size > 8 ? std::as_bytes(std::span(data + 8, size - 8)) : std::span<const std::byte>{};

  if (auto r = parse_record(bytes, salt, false); r) KEEL_FUZZ_CHECK(r->size <= bytes.size());
  auto h = parse_block_header(bytes, salt);
  if (h) {
    KEEL_FUZZ_CHECK(h->length >= sizeof(block_header) && h->length % 8 == 0);
    KEEL_FUZZ_CHECK(h->length <= bytes.size());
  }
  auto complete = check_block(bytes, salt);
  if (!complete) return 0;
  KEEL_FUZZ_CHECK(h.has_value());
  const auto block = bytes.first(complete->length);
  if (complete->kind == static_cast<std::uint16_t>(block_kind::blob)) {
    const auto value = blob_value(block, *complete);
    std::vector<std::byte> again(blob_block_size(value.size()));
    KEEL_FUZZ_CHECK(again.size() == block.size());
    encode_blob_block(again, value, salt);
    KEEL_FUZZ_CHECK(std::memcmp(again.data(), block.data(), again.size()) == 0);
  } else {
    check_records_reencode(block, *complete, salt);
  }
  return 0;
}
