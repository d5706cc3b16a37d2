// keel::kv's bytes on disk (format.hpp, doc/kv-format.md): encoding, parsing and checking the
// store file, segment headers, blocks, records and blobs, and the key hash. Pure functions of
// bytes; no state.

#include "kv/format.hpp"
#include "base/planted.hpp"

// The state struct on the stack (streaming without a heap allocation per checksum).
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>

namespace keel::kv::disk {
namespace {

// An offset only: the caller, which knows the file, adds it.
result<void> corrupt_at(std::uint64_t offset) noexcept {
  return std::unexpected(error(make_error_code(errc::corrupt), std::string_view{}, offset));
}

template <class T>
T load(std::span<const std::byte> bytes, std::size_t at) noexcept {
  T v;
  std::memcpy(&v, bytes.data() + at, sizeof v);
  return v;
}

template <class T>
void store(std::span<std::byte> bytes, std::size_t at, const T& v) noexcept {
  std::memcpy(bytes.data() + at, &v, sizeof v);
}

// Store file fields (doc/kv-format.md).
constexpr std::size_t store_id_at = 24, salt_at = 40, segment_size_at = 48, blob_threshold_at = 56,
                      created_at = 64, first_segment_size_at = 72;
// Segment header fields.
constexpr std::size_t seg_store_id_at = 24, seg_number_at = 40, seg_size_at = 48,
                      seg_checksum_at = 56;

// The inline part of a record: the value, nothing, or a blob reference.
std::uint64_t inline_length(op what, std::uint64_t value_length) noexcept {
  switch (what) {
    case op::put:
      return value_length;
    case op::erase:
      return 0;
    case op::put_blob:
      return sizeof(blob_ref);
  }
  return 0;
}

std::uint64_t record_checksum(const record_header& h, std::span<const std::byte> key,
                              std::span<const std::byte> inline_part, std::uint64_t salt) noexcept {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);  // on the stack: a seeded reset reads its seed field first
  XXH3_64bits_reset_withSeed(&state, salt);
  XXH3_64bits_update(&state, &h, offsetof(record_header, checksum));
  XXH3_64bits_update(&state, key.data(), key.size());
  XXH3_64bits_update(&state, inline_part.data(), inline_part.size());
  return XXH3_64bits_digest(&state);
}

std::uint64_t header_checksum(const block_header& h, std::uint64_t salt) noexcept {
  return XXH3_64bits_withSeed(&h, offsetof(block_header, header_checksum), salt);
}

}  // namespace

key_hash unhooked_hash_key(std::span<const std::byte> key, std::uint64_t seed) noexcept {
  const XXH128_hash_t h = XXH3_128bits_withSeed(key.data(), key.size(), seed);
  return {h.high64 == 0 ? 1 : h.high64, h.low64};
}

key_hash hash_key(std::span<const std::byte> key, std::uint64_t seed) noexcept {
  if (hash_hook != nullptr) return hash_hook(key, seed);
  return unhooked_hash_key(key, seed);
}

std::uint64_t checksum(std::span<const std::byte> bytes, std::uint64_t salt) noexcept {
  return XXH3_64bits_withSeed(bytes.data(), bytes.size(), salt);
}

// ---- The store file ----

std::array<std::byte, store_file_size> encode_store_file(const store_params& p) noexcept {
  std::array<std::byte, store_file_size> out{};
  const std::span<std::byte> s(out);
  store(s, 0, (p.first_segment_size == 0 ? store_format_v2 : store_format).header());
  std::memcpy(out.data() + store_id_at, p.id.data(), p.id.size());
  store(s, salt_at, p.salt);
  store(s, segment_size_at, p.segment_size);
  store(s, blob_threshold_at, p.blob_threshold);
  store(s, created_at, p.created_ns);
  if (p.first_segment_size != 0) store(s, first_segment_size_at, p.first_segment_size);
  store(s, store_checksum_at, checksum(std::span(out).first(store_checksum_at), 0));
  return out;
}

result<store_params> parse_store_file(std::span<const std::byte> bytes) noexcept {
  auto head = base::check_header(bytes, store_format);
  const bool v2 = !head && head.error() == errc::unsupported_version &&
                  base::check_header(bytes, store_format_v2).has_value();
  if (v2) head = base::header_state::ours;
  if (!head) return std::unexpected(head.error());
  // A blank or short file is not a store: stores are made whole, then renamed into place.
  if (*head == base::header_state::blank || bytes.size() < store_file_size) {
    return keel_error(errc::not_keel_file);
  }
  if (load<std::uint64_t>(bytes, store_checksum_at) !=
      checksum(bytes.first(store_checksum_at), 0)) {
    return std::unexpected(corrupt_at(store_checksum_at).error());
  }
  store_params p;
  std::memcpy(p.id.data(), bytes.data() + store_id_at, p.id.size());
  p.salt = load<std::uint64_t>(bytes, salt_at);
  p.segment_size = load<std::uint64_t>(bytes, segment_size_at);
  p.blob_threshold = load<std::uint64_t>(bytes, blob_threshold_at);
  p.created_ns = load<std::uint64_t>(bytes, created_at);
  const std::size_t reserved_at = v2 ? first_segment_size_at : first_segment_size_at + 8;
  if (!v2) p.first_segment_size = load<std::uint64_t>(bytes, first_segment_size_at);
  // The reserved bytes are zero (a version that uses them says so).
  for (std::size_t i = reserved_at; i < store_checksum_at; ++i) {
    if (bytes[i] != std::byte{0}) return std::unexpected(corrupt_at(i).error());
  }
  if (p.salt == 0) return std::unexpected(corrupt_at(salt_at).error());
  if (p.segment_size < min_segment_size || p.segment_size > max_segment_size ||
      (p.segment_size & (p.segment_size - 1)) != 0) {
    return std::unexpected(corrupt_at(segment_size_at).error());
  }
  if (p.blob_threshold == 0 || p.blob_threshold > p.segment_size - segment_header_size) {
    return std::unexpected(corrupt_at(blob_threshold_at).error());
  }
  if (!v2 &&
      (p.first_segment_size < min_first_segment_size || p.first_segment_size >= p.segment_size ||
       (p.first_segment_size & (p.first_segment_size - 1)) != 0)) {
    return std::unexpected(corrupt_at(first_segment_size_at).error());
  }
  return p;
}

// ---- Segment headers ----

std::array<std::byte, segment_header_size> encode_segment_header(const segment_params& p,
                                                                 std::uint64_t salt) noexcept {
  std::array<std::byte, segment_header_size> out{};
  const std::span<std::byte> s(out);
  store(s, 0, segment_format.header());
  std::memcpy(out.data() + seg_store_id_at, p.store_id.data(), p.store_id.size());
  store(s, seg_number_at, p.number);
  store(s, seg_size_at, p.size);
  store(s, seg_checksum_at, checksum(std::span(out).first(seg_checksum_at), salt));
  return out;
}

result<segment_params> parse_segment_header(std::span<const std::byte> bytes,
                                            const std::array<std::uint8_t, 16>& id,
                                            std::uint64_t number, std::uint64_t salt) noexcept {
  auto head = base::check_header(bytes, segment_format);
  if (!head) return std::unexpected(head.error());
  if (*head == base::header_state::blank || bytes.size() < seg_checksum_at + 8) {
    return std::unexpected(corrupt_at(0).error());  // made whole before it is named
  }
  if (load<std::uint64_t>(bytes, seg_checksum_at) != checksum(bytes.first(seg_checksum_at), salt)) {
    return std::unexpected(corrupt_at(seg_checksum_at).error());
  }
  segment_params p;
  std::memcpy(p.store_id.data(), bytes.data() + seg_store_id_at, p.store_id.size());
  p.number = load<std::uint64_t>(bytes, seg_number_at);
  p.size = load<std::uint64_t>(bytes, seg_size_at);
  if (p.store_id != id) return std::unexpected(corrupt_at(seg_store_id_at).error());
  if (p.number != number) return std::unexpected(corrupt_at(seg_number_at).error());
  if (p.size < segment_header_size || p.size > max_segment_offset) {
    return std::unexpected(corrupt_at(seg_size_at).error());
  }
  return p;
}

// ---- The manifest ----

namespace {
constexpr std::size_t manifest_id_at = 24, manifest_generation_at = 40, manifest_count_at = 48,
                      manifest_durable_at = 56, manifest_numbered_at = 64, manifest_header = 72,
                      manifest_header_v2 = 64;
}  // namespace

std::vector<std::byte> encode_manifest(const std::array<std::uint8_t, 16>& id, const manifest& m,
                                       std::uint64_t salt) {
  std::vector<std::byte> out(manifest_header + m.entries.size() * sizeof(manifest_entry) + 8);
  // Never null (at least a header long); said so for gcc's -Wnull-dereference under TSan.
  if (out.data() == nullptr) return out;
  const std::span<std::byte> s(out);
  store(s, 0, manifest_format.header());
  std::memcpy(out.data() + manifest_id_at, id.data(), id.size());
  store(s, manifest_generation_at, m.generation);
  store(s, manifest_count_at, static_cast<std::uint64_t>(m.entries.size()));
  store(s, manifest_durable_at, m.durable_below);
  store(s, manifest_numbered_at, m.numbered_below);
  for (std::size_t i = 0; i < m.entries.size(); ++i)
    store(s, manifest_header + i * sizeof(manifest_entry), m.entries[i]);
  const std::size_t end = out.size() - 8;
  store(s, end, checksum(s.first(end), salt));
  return out;
}

result<manifest> parse_manifest(std::span<const std::byte> bytes,
                                const std::array<std::uint8_t, 16>& id,
                                std::uint64_t salt) noexcept {
  auto head = base::check_header(bytes, manifest_format);
  const bool v2 = !head && head.error() == errc::unsupported_version &&
                  base::check_header(bytes, manifest_format_v2).has_value();
  if (v2) head = base::header_state::ours;
  if (!head) return std::unexpected(head.error());
  const std::size_t header = v2 ? manifest_header_v2 : manifest_header;
  if (*head == base::header_state::blank || bytes.size() < header + 8) {
    return std::unexpected(corrupt_at(0).error());
  }
  const auto count = load<std::uint64_t>(bytes, manifest_count_at);
  if (count > max_segments || count > (bytes.size() - header - 8) / sizeof(manifest_entry)) {
    return std::unexpected(corrupt_at(manifest_count_at).error());
  }
  const std::size_t end = header + count * sizeof(manifest_entry);
  if (load<std::uint64_t>(bytes, end) != checksum(bytes.first(end), salt)) {
    return std::unexpected(corrupt_at(end).error());
  }
  if (std::memcmp(bytes.data() + manifest_id_at, id.data(), id.size()) != 0) {
    return std::unexpected(corrupt_at(manifest_id_at).error());
  }
  manifest m;
  m.generation = load<std::uint64_t>(bytes, manifest_generation_at);
  m.durable_below = load<std::uint64_t>(bytes, manifest_durable_at);
  m.version = v2 ? 2 : 3;
  if (!v2) m.numbered_below = load<std::uint64_t>(bytes, manifest_numbered_at);
  if (m.numbered_below > max_segment_number + 1) {
    return std::unexpected(corrupt_at(manifest_numbered_at).error());
  }
  try {
    m.entries.reserve(count);
    for (std::uint64_t i = 0; i < count; ++i) {
      const std::size_t at = header + i * sizeof(manifest_entry);
      const auto e = load<manifest_entry>(bytes, at);
      if (e.number == 0 || e.number > max_segment_number || e.size < segment_header_size ||
          e.size > max_segment_offset || e.sealed_blocks > e.size / sizeof(block_header) ||
          (!m.entries.empty() && e.number <= m.entries.back().number)) {
        return std::unexpected(corrupt_at(at).error());
      }
      m.entries.push_back(e);
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return m;
}

// ---- Blocks and records ----

std::uint64_t record_size(const record_in& r) noexcept {
  const std::uint64_t value_length = r.what == op::put ? r.value.size() : r.value_length;
  return sizeof(record_header) + pad8(r.key.size() + inline_length(r.what, value_length));
}

std::uint64_t block_size(std::span<const record_in> records) noexcept {
  std::uint64_t n = sizeof(block_header);
  for (const record_in& r : records)
    n += record_size(r);
  return n;
}

void encode_block(std::span<std::byte> out, block_kind kind, std::uint64_t seq,
                  std::span<const record_in> records, std::uint64_t salt, bool seal) noexcept {
  XXH3_state_t payload;
  XXH3_INITSTATE(&payload);  // as above
  XXH3_64bits_reset_withSeed(&payload, salt);
  std::size_t at = sizeof(block_header);
  for (const record_in& r : records) {
    record_header h{};
    h.key_length = static_cast<std::uint32_t>(r.key.size());
    h.op = static_cast<std::uint8_t>(r.what);
    h.value_length = r.what == op::put ? r.value.size() : r.what == op::erase ? 0 : r.value_length;
    h.seq = kind == block_kind::relocation ? r.seq : seq;
    h.prev = r.prev;
    h.prev_seq = r.prev_seq;
    const std::span<const std::byte> inline_part = r.what == op::put ? r.value
                                                   : r.what == op::put_blob
                                                       ? std::as_bytes(std::span(&r.blob, 1))
                                                       : std::span<const std::byte>{};
    h.checksum = record_checksum(h, r.key, inline_part, salt);
    const std::size_t body = r.key.size() + inline_part.size();
    store(out, at, h);
    std::memcpy(out.data() + at + sizeof h, r.key.data(), r.key.size());
    if (!inline_part.empty()) {  // an empty value's span may have no data at all
      std::memcpy(out.data() + at + sizeof h + r.key.size(), inline_part.data(),
                  inline_part.size());
    }
    std::memset(out.data() + at + sizeof h + body, 0, pad8(body) - body);
    XXH3_64bits_update(&payload, &h, sizeof h);
    at += sizeof h + pad8(body);
  }
  block_header b{};
  b.magic = block_magic;
  b.kind = static_cast<std::uint16_t>(kind);
  b.seq = kind == block_kind::commit ? seq : 0;
  b.length = at;
  b.records = static_cast<std::uint32_t>(records.size());
  b.payload_checksum = XXH3_64bits_digest(&payload);
  b.header_checksum = header_checksum(b, salt);
  // All but the seq word, then the seq word: a reader that loads it (block_seq) and finds
  // the seq it waits for sees a whole block.
  constexpr std::size_t seq_at = offsetof(block_header, seq);
  std::memcpy(out.data(), &b, seq_at);
  std::memcpy(out.data() + seq_at + 8, reinterpret_cast<const std::byte*>(&b) + seq_at + 8,
              sizeof b - seq_at - 8);
  if (seal) {
    std::atomic_ref(*reinterpret_cast<std::uint64_t*>(out.data() + seq_at))
        .store(b.seq, std::memory_order_release);
  }
}

namespace {

std::atomic_ref<std::uint64_t> seq_word(std::span<std::byte> block) noexcept {
  return std::atomic_ref(
      *reinterpret_cast<std::uint64_t*>(block.data() + offsetof(block_header, seq)));
}

}  // namespace

bool seal_block(std::span<std::byte> block, std::uint64_t seq) noexcept {
  std::uint64_t expected = 0;
  return seq_word(block).compare_exchange_strong(expected, seq, std::memory_order_acq_rel);
}

std::uint64_t void_block(std::span<std::byte> block) noexcept {
  std::uint64_t seen = 0;
  seq_word(block).compare_exchange_strong(seen, void_seq, std::memory_order_acq_rel);
  return seen;
}

namespace {
// The header of a block keel left on purpose, `length` bytes long (spanned_block reads it).
block_header spanning_header(std::uint64_t length, std::uint64_t salt) noexcept {
  block_header b{};
  b.magic = block_magic;
  b.kind = static_cast<std::uint16_t>(block_kind::commit);
  b.seq = void_seq;
  b.length = length;
  b.header_checksum = header_checksum(b, salt);
  b.magic = void_magic;
  return b;
}
}  // namespace

bool bury_block(std::span<std::byte> block, std::uint64_t length, std::uint64_t salt) noexcept {
  if (length < sizeof(block_header) || length % 8 != 0 || length > block.size()) return false;
  const std::uint64_t was = void_block(block);
  if (was != 0 && was != void_seq) return false;
  // A reader loads the seq word first (void_seq: not a commit) and a settler checks the
  // whole block (never whole now): neither takes the header written around it for anything.
  const block_header b = spanning_header(length, salt);
  constexpr std::size_t seq_at = offsetof(block_header, seq);
  std::memcpy(block.data(), &b, seq_at);
  std::memcpy(block.data() + seq_at + 8, reinterpret_cast<const std::byte*>(&b) + seq_at + 8,
              sizeof b - seq_at - 8);
  return true;
}

void span_unwritten(std::span<std::byte> space, std::uint64_t length, std::uint64_t salt) noexcept {
  const block_header b = spanning_header(length, salt);
  std::memcpy(space.data(), &b, sizeof b);
}

std::uint64_t block_seq(std::span<const std::byte> block) noexcept {
  if (block.size() < sizeof(block_header)) return 0;
  // The word is only ever written through an atomic_ref (encode_block) or before the
  // segment is shared; const_cast for the load only.
  auto* word = const_cast<std::uint64_t*>(
      reinterpret_cast<const std::uint64_t*>(block.data() + offsetof(block_header, seq)));
  return std::atomic_ref(*word).load(std::memory_order_acquire);
}

std::uint64_t encode_blob_block(std::span<std::byte> out, std::span<const std::byte> value,
                                std::uint64_t salt) noexcept {
  if (!value.empty()) std::memcpy(out.data() + sizeof(block_header), value.data(), value.size());
  const std::size_t end = sizeof(block_header) + value.size();
  std::memset(out.data() + end, 0, pad8(value.size()) - value.size());
  block_header b{};
  b.magic = block_magic;
  b.kind = static_cast<std::uint16_t>(block_kind::blob);
  b.flags = static_cast<std::uint16_t>(pad8(value.size()) - value.size());
  b.length = blob_block_size(value.size());
  b.payload_checksum = checksum(value, salt);
  b.header_checksum = header_checksum(b, salt);
  store(out, 0, b);
  return b.payload_checksum;
}

void encode_pad_block(std::span<std::byte> out, std::uint64_t salt) noexcept {
  std::memset(out.data() + sizeof(block_header), 0, out.size() - sizeof(block_header));
  block_header b{};
  b.magic = block_magic;
  b.kind = static_cast<std::uint16_t>(block_kind::relocation);
  b.length = out.size();
  b.payload_checksum = XXH3_64bits_withSeed(nullptr, 0, salt);
  b.header_checksum = header_checksum(b, salt);
  store(out, 0, b);
}

result<block_header> parse_block_header(std::span<const std::byte> bytes,
                                        std::uint64_t salt) noexcept {
  if (bytes.size() < sizeof(block_header)) return std::unexpected(corrupt_at(0).error());
  const auto b = load<block_header>(bytes, 0);
  if (b.magic != block_magic || b.header_checksum != header_checksum(b, salt) ||
      b.kind < static_cast<std::uint16_t>(block_kind::commit) ||
      b.kind > static_cast<std::uint16_t>(block_kind::relocation) || b.reserved != 0 ||
      b.length < sizeof(block_header) || b.length % 8 != 0 || b.length > bytes.size()) {
    return std::unexpected(corrupt_at(0).error());
  }
  // Only a commit has a seq, and it always has records.
  const bool commit = b.kind == static_cast<std::uint16_t>(block_kind::commit);
  if (commit != (b.seq != 0) || (commit && b.records == 0)) {
    return std::unexpected(corrupt_at(0).error());
  }
  const bool blob = b.kind == static_cast<std::uint16_t>(block_kind::blob);
  // A blob's flags are its padding (0-7 bytes, never the whole payload); other kinds have none.
  if (blob ? (b.records != 0 || b.flags > 7 || b.flags > b.length - sizeof(block_header))
           : b.flags != 0) {
    return std::unexpected(corrupt_at(0).error());
  }
  return b;
}

namespace {

// parse_record_head's checks, and the record's parts; `before_parts` runs once the parts are
// known to lie inside `bytes`, before any of them is read.
template <class BeforeParts>
result<record_view> parse_head(std::span<const std::byte> bytes, BeforeParts&& before_parts) {
  if (bytes.size() < sizeof(record_header)) return std::unexpected(corrupt_at(0).error());
  record_view r;
  r.head = load<record_header>(bytes, 0);
  const record_header& h = r.head;
  if (h.key_length == 0 || h.key_length > max_key || h.reserved[0] != 0 || h.reserved[1] != 0 ||
      h.reserved[2] != 0 || h.seq == 0 || h.value_length > max_value) {
    return std::unexpected(corrupt_at(0).error());
  }
  if (h.op < static_cast<std::uint8_t>(op::put) || h.op > static_cast<std::uint8_t>(op::put_blob)) {
    return std::unexpected(corrupt_at(0).error());
  }
  const auto what = static_cast<op>(h.op);
  if (what == op::erase && h.value_length != 0) return std::unexpected(corrupt_at(0).error());
  const std::uint64_t body = h.key_length + inline_length(what, h.value_length);
  // Both bounded above (1 KiB key, 2^36 value): no overflow in the sum.
  if (sizeof(record_header) + pad8(body) > bytes.size()) {
    return std::unexpected(corrupt_at(0).error());
  }
  before_parts(sizeof(record_header) + body);
  r.key = bytes.subspan(sizeof(record_header), h.key_length);
  const auto inline_part = bytes.subspan(sizeof(record_header) + h.key_length, body - h.key_length);
  if (what == op::put) r.value = inline_part;
  if (what == op::put_blob) std::memcpy(&r.blob, inline_part.data(), sizeof r.blob);
  r.size = sizeof(record_header) + pad8(body);
  return r;
}

}  // namespace

result<record_view> parse_record_head(std::span<const std::byte> bytes) noexcept {
  return parse_head(bytes, [](std::uint64_t) {});
}

result<record_view> parse_record(std::span<const std::byte> bytes, std::uint64_t salt,
                                 bool verify) noexcept {
  std::uint64_t unpadded = 0;  // the header, key and inline part
  auto parsed = parse_head(bytes, [&](std::uint64_t length) {
    unpadded = length;
    // A record read at random is rarely in the cache: ask for all its lines now, so that
    // their misses overlap instead of coming one after another as the checks below walk it.
    const std::uint64_t ahead = std::min<std::uint64_t>(length, 4096);
    for (std::uint64_t line = 64; line < ahead + 63; line += 64)
      __builtin_prefetch(bytes.data() + line);
  });
  if (!parsed) return parsed;
  record_view& r = *parsed;
  const record_header& h = r.head;
  const std::uint64_t inlined = unpadded - sizeof(record_header) - h.key_length;
  // Padding is zero: the checksum does not cover it, and no byte of a record may change
  // unnoticed.
  for (std::uint64_t i = unpadded; i < r.size; ++i) {
    if (bytes[i] != std::byte{0}) return std::unexpected(corrupt_at(0).error());
  }
  if (verify && !base::is_planted(base::planted_bug::kv_skips_record_checksum) &&
      record_checksum(h, r.key, bytes.subspan(unpadded - inlined, inlined), salt) != h.checksum) {
    return std::unexpected(corrupt_at(0).error());
  }
  return r;
}

std::span<const std::byte> blob_value(std::span<const std::byte> block,
                                      const block_header& h) noexcept {
  return block.subspan(sizeof(block_header), h.length - sizeof(block_header) - h.flags);
}

void void_torn_block(std::span<std::byte> block) noexcept {
  store(block, 0, void_magic);
}

std::optional<std::uint64_t> spanned_block(std::span<const std::byte> bytes,
                                           std::uint64_t salt) noexcept {
  if (bytes.size() < sizeof(block_header)) return std::nullopt;
  block_header b = load<block_header>(bytes, 0);
  if (b.magic == void_magic) {
    b.magic = block_magic;
  } else if (b.magic == block_magic && b.seq == void_seq &&
             b.kind == static_cast<std::uint16_t>(block_kind::commit) &&
             bytes.size() >= sizeof(block_header) + sizeof(record_header)) {
    b.seq = load<record_header>(bytes, sizeof(block_header)).seq;
  } else {
    return std::nullopt;
  }
  if (b.header_checksum != header_checksum(b, salt) || b.length < sizeof(block_header) ||
      b.length % 8 != 0 || b.length > bytes.size()) {
    return std::nullopt;
  }
  return b.length;
}

bool has_unwritten_sector(std::span<const std::byte> file, std::uint64_t offset,
                          std::uint64_t length) noexcept {
  const std::uint64_t end = std::min<std::uint64_t>(offset + length, file.size());
  for (std::uint64_t at = offset; at < end;) {
    const std::uint64_t next = std::min(end, (at / sector_size + 1) * sector_size);
    const auto part = file.subspan(at, next - at);
    if (std::all_of(part.begin(), part.end(), [](std::byte b) { return b == std::byte{0}; })) {
      return true;
    }
    at = next;
  }
  return false;
}

result<block_header> check_block(std::span<const std::byte> bytes, std::uint64_t salt) noexcept {
  auto b = parse_block_header(bytes, salt);
  if (!b) return b;
  const auto block = bytes.first(b->length);
  if (b->kind == static_cast<std::uint16_t>(block_kind::blob)) {
    if (checksum(blob_value(block, *b), salt) != b->payload_checksum) {
      return std::unexpected(corrupt_at(sizeof(block_header)).error());
    }
    // The padding after the value is zero: the checksum does not cover it.
    for (std::size_t i = block.size() - b->flags; i < block.size(); ++i) {
      if (block[i] != std::byte{0}) return std::unexpected(corrupt_at(i).error());
    }
    return b;
  }
  XXH3_state_t payload;
  XXH3_INITSTATE(&payload);  // as above
  XXH3_64bits_reset_withSeed(&payload, salt);
  std::size_t at = sizeof(block_header);
  for (std::uint32_t i = 0; i < b->records; ++i) {
    auto r = parse_record(block.subspan(at), salt, true);
    if (!r) return std::unexpected(corrupt_at(at).error());
    if (b->kind == static_cast<std::uint16_t>(block_kind::commit) && r->head.seq != b->seq) {
      return std::unexpected(corrupt_at(at).error());
    }
    XXH3_64bits_update(&payload, &r->head, sizeof r->head);
    at += r->size;
  }
  if (at != block.size()) {
    // Records do not fill the block: only a pad block (no records, zeros) may have room left.
    const bool pad =
        b->records == 0 && std::all_of(block.begin() + static_cast<std::ptrdiff_t>(at), block.end(),
                                       [](std::byte x) { return x == std::byte{0}; });
    if (!pad) return std::unexpected(corrupt_at(at).error());
  }
  if (XXH3_64bits_digest(&payload) != b->payload_checksum) {
    return std::unexpected(corrupt_at(0).error());
  }
  return b;
}

}  // namespace keel::kv::disk
