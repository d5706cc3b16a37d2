#pragma once
// keel::kv's bytes on disk (doc/kv-format.md): the store file, segment headers, blocks and
// their records, and the checks that are everything the store believes about bytes before
// it uses them. Pure functions over spans, no files: fuzz/ feeds them garbage.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "base/format_header.hpp"
#include "keel/result.hpp"

namespace keel::kv::disk {

constexpr std::size_t page_size = 4096;
constexpr std::size_t max_key = 1024;
//! The largest value a record can describe (the API may allow less).
constexpr std::uint64_t max_value = (std::uint64_t{1} << 36);

// ---- Locations: segment number (top 24 bits) and offset in it (low 40 bits); 0 is none ----

constexpr unsigned offset_bits = 40;
constexpr std::uint64_t max_segment_number = (std::uint64_t{1} << 24) - 1;
constexpr std::uint64_t max_segment_offset = (std::uint64_t{1} << offset_bits) - 1;

[[nodiscard]] constexpr std::uint64_t make_location(std::uint64_t segment,
                                                    std::uint64_t offset) noexcept {
  return (segment << offset_bits) | offset;
}
[[nodiscard]] constexpr std::uint64_t segment_of(std::uint64_t location) noexcept {
  return location >> offset_bits;
}
[[nodiscard]] constexpr std::uint64_t offset_of(std::uint64_t location) noexcept {
  return location & max_segment_offset;
}

// ---- Hashes and checksums ----

//! XXH3-128 of a key, `hi` never 0 (0 marks an empty index entry).
struct key_hash {
  std::uint64_t hi;
  std::uint64_t lo;
  friend bool operator==(const key_hash&, const key_hash&) = default;
};
//! Seeded with the store's salt (random, made with the store): keys that share a hash cannot
//! be made by someone who cannot read the store's files (XXH3 is no cryptographic hash, and
//! unseeded, keys over 240 bytes of one chosen hash are easy to make). Keys of one hash still
//! cost only a probe (overflow chains), never an error; the seed keeps them from being made
//! by the thousand to slow every lookup of their page.
[[nodiscard]] key_hash hash_key(std::span<const std::byte> key, std::uint64_t seed) noexcept;
//! For tests: when set, the hash of every key, so that keys can be made to collide on purpose
//! (returns what hash_key returns, `hi` never 0). Set before the store's threads start and
//! never changed while they run.
inline key_hash (*hash_hook)(std::span<const std::byte> key, std::uint64_t seed) noexcept = nullptr;
//! hash_key as it is without the hook: what a hook returns for the keys it leaves alone.
[[nodiscard]] key_hash unhooked_hash_key(std::span<const std::byte> key,
                                         std::uint64_t seed) noexcept;

//! XXH3-64 seeded with the store's salt: what every checksum of a store is.
[[nodiscard]] std::uint64_t checksum(std::span<const std::byte> bytes, std::uint64_t salt) noexcept;

// ---- The store file `keel-kv` ----

constexpr std::uint64_t min_segment_size = std::uint64_t{1} << 20;
constexpr std::uint64_t max_segment_size = std::uint64_t{1} << 30;
constexpr std::uint64_t default_segment_size = std::uint64_t{64} << 20;
constexpr std::uint64_t default_blob_threshold = std::uint64_t{64} << 10;
//! The smallest a log segment of a growing store starts at (store_params::first_segment_size).
constexpr std::uint64_t min_first_segment_size = std::uint64_t{256} << 10;

struct store_params {
  std::array<std::uint8_t, 16> id{};
  std::uint64_t salt = 0;  //!< never 0
  std::uint64_t segment_size = default_segment_size;
  //! Values at least this long are written as blobs (at most the segment size less its
  //! header: a smaller value always fits a commit block of one segment).
  std::uint64_t blob_threshold = default_blob_threshold;
  std::uint64_t created_ns = 0;
  //! 0: every log segment is `segment_size` long (version 2). Else (version 3) log segments
  //! start this long and grow with the log, a power of two up to `segment_size` each: a
  //! small store takes little room, a large one has few segments.
  std::uint64_t first_segment_size = 0;
  friend bool operator==(const store_params&, const store_params&) = default;
};

constexpr std::size_t store_file_size = page_size;
constexpr std::size_t store_checksum_at = page_size - 8;
// Version 2: the store keeps a manifest of its segments (version 1 had none; its stores are
// refused with unsupported_version). Version 3: its log segments grow (first_segment_size).
// A store whose segments do not grow is still written as version 2, which keel of before
// reads; both are read.
inline constexpr base::format store_format_v2{
    "KEELKVS1", 2, base::layout_of({store_file_size, 72, store_checksum_at})};
inline constexpr base::format store_format{
    "KEELKVS1", 3, base::layout_of({store_file_size, 80, store_checksum_at})};

//! The store file's 4096 bytes for `p` (checksummed; the checksum's seed is 0, since the
//! salt is read from this file).
[[nodiscard]] std::array<std::byte, store_file_size> encode_store_file(
    const store_params& p) noexcept;

//! Reads a store file. Errors: not_keel_file (another magic, or too short to be one),
//! unsupported_version, corrupt at the offset of the bad part (checksum, a parameter out of
//! its range).
[[nodiscard]] result<store_params> parse_store_file(std::span<const std::byte> bytes) noexcept;

// ---- Segment headers ----

// 64 bytes, the first block right after (version 1 took a whole page: 0.4 % of a 1 MiB
// segment, room a full volume could not use).
constexpr std::size_t segment_header_size = 64;
inline constexpr base::format segment_format{"KEELKVG1", 2,
                                             base::layout_of({segment_header_size, 64})};

struct segment_params {
  std::array<std::uint8_t, 16> store_id{};
  std::uint64_t number = 0;
  std::uint64_t size = 0;
  friend bool operator==(const segment_params&, const segment_params&) = default;
};

[[nodiscard]] std::array<std::byte, segment_header_size> encode_segment_header(
    const segment_params& p, std::uint64_t salt) noexcept;

//! Reads a segment's header and checks it belongs: `store_id`, `number` (its name). Errors:
//! not_keel_file, unsupported_version, corrupt (checksum, another store, another number, a
//! size below the header).
[[nodiscard]] result<segment_params> parse_segment_header(std::span<const std::byte> bytes,
                                                          const std::array<std::uint8_t, 16>& id,
                                                          std::uint64_t number,
                                                          std::uint64_t salt) noexcept;

// ---- The manifest: which segments the store has ----

//! The most segments a store holds (the index's segment table has an entry for each).
constexpr std::uint64_t max_segments = 8064;
//! The manifest file is two slots of one size, allocated when it is made: a change is
//! written into the slot not in use and synced, so it needs no new room (compaction works on
//! a full volume) and a torn write leaves the other slot as it was. A slot starts at a page
//! and doubles (a new file, replaced whole) when a segment more would not fit, up to the
//! size that holds max_segments.
constexpr std::uint64_t manifest_min_slot = 4096;
constexpr std::uint64_t manifest_max_slot = 256 * 1024;
//! The segments a slot of `slot_size` bytes holds.
[[nodiscard]] constexpr std::uint64_t manifest_capacity(std::uint64_t slot_size) noexcept {
  return (slot_size - 80) / 24;
}
static_assert(manifest_capacity(manifest_max_slot) >= max_segments);
// Version 3: the slot says which segment numbers were handed out (*numbered below*), so that
// the highest segment it lists may go (a dead large value's) and a rebuild still never numbers
// a new segment with a number used before. Version 2 (read, never written; its slots held as
// many segments) had no such word: every number up to its highest listed was handed out.
// Version 2: each entry counts the segment's blocks below durable_below (version 1 did not:
// a block zeroed whole there went unseen). Version 1 manifests are refused as unsupported.
inline constexpr base::format manifest_format{"KEELKVM1", 3,
                                              base::layout_of({72, 24, 8, max_segments})};
inline constexpr base::format manifest_format_v2{"KEELKVM1", 2,
                                                 base::layout_of({64, 24, 8, max_segments})};

//! A segment the manifest lists.
struct manifest_entry {
  std::uint64_t number = 0;
  std::uint64_t size = 0;
  //! Blocks (commit, blob, relocation: headers that check out) in the segment below the
  //! manifest's durable_below, counted by the closes that recorded it: a walk that finds
  //! fewer there finds a block damaged past recognition (zeroed whole, say).
  std::uint64_t sealed_blocks = 0;
  friend bool operator==(const manifest_entry&, const manifest_entry&) = default;
};

//! A manifest slot as read.
struct manifest {
  std::uint64_t generation = 0;  //!< the slot with the higher one is current
  //! Every block at a location below it is on stable storage (written when the last user
  //! closed the store, after syncing every segment; 0: nothing known): a block there that
  //! does not check out was damaged, never torn by a power cut.
  std::uint64_t durable_below = 0;
  //! Every segment number below it has been handed out (a version 2 slot: 0), so a rebuild
  //! numbers new segments from it, or past the highest listed if higher.
  std::uint64_t numbered_below = 0;
  std::vector<manifest_entry> entries;  //!< ascending
  std::uint64_t slot_size = 0;          //!< of the file it was read from (0: none yet)
  std::uint32_t version = 3;            //!< of the slot as read (2 or 3)
  //! A slot of version 2 is in the file beside it (set by the store's read): the change
  //! written next is written into both slots, so that no version 2 slot stays for keel
  //! before version 3 to fall back on (it would find the segments since gone, `corrupt`).
  bool older_slot = false;
};

//! A slot's bytes: its 72-byte header (common header, store id, generation, count, durable
//! below, numbered below), the
//! entries in number order, and a checksum of all of it. At most max_segments entries.
[[nodiscard]] std::vector<std::byte> encode_manifest(const std::array<std::uint8_t, 16>& id,
                                                     const manifest& m, std::uint64_t salt);
//! Reads a slot (`bytes`: the slot, which may run on past its checksum). Errors:
//! not_keel_file, unsupported_version, corrupt (blank, another store's, a bad checksum, a
//! count past the slot, entries out of order or of a size below a segment header).
[[nodiscard]] result<manifest> parse_manifest(std::span<const std::byte> bytes,
                                              const std::array<std::uint8_t, 16>& id,
                                              std::uint64_t salt) noexcept;

// ---- Blocks and records ----

constexpr std::uint32_t block_magic = 0x314b4256;  // "VBK1"
enum class block_kind : std::uint16_t { commit = 1, blob = 2, relocation = 3 };
enum class op : std::uint8_t { put = 1, erase = 2, put_blob = 3 };

struct block_header {
  std::uint32_t magic;
  std::uint16_t kind;
  std::uint16_t flags;  // blob: its padding bytes (0-7); otherwise 0
  std::uint64_t seq;
  std::uint64_t length;  // the whole block, header included; a multiple of 8
  std::uint32_t records;
  std::uint32_t reserved;
  std::uint64_t payload_checksum;
  std::uint64_t header_checksum;  // of the 40 bytes before it
};
static_assert(sizeof(block_header) == 48);

struct record_header {
  std::uint32_t key_length;
  std::uint8_t op;
  std::uint8_t reserved[3];
  std::uint64_t value_length;
  std::uint64_t seq;
  std::uint64_t prev;      // location of the key's previous version, or 0
  std::uint64_t prev_seq;  // its seq, or 0
  std::uint64_t checksum;  // of the 40 bytes before it, the key and the inline part
};
static_assert(sizeof(record_header) == 48);

//! A blob reference: the inline part of a put_blob record.
struct blob_ref {
  std::uint64_t location;
  std::uint64_t checksum;  // the blob block's payload checksum
};
static_assert(sizeof(blob_ref) == 16);

//! What a record says, to write one.
struct record_in {
  std::span<const std::byte> key;
  op what = op::put;
  std::span<const std::byte> value;  //!< put: the value (inline)
  blob_ref blob{};                   //!< put_blob: where the value is
  std::uint64_t value_length = 0;    //!< put_blob: the value's length (put: value.size())
  std::uint64_t prev = 0;
  std::uint64_t prev_seq = 0;
  std::uint64_t seq = 0;  //!< relocation: the version's own seq (commit: the block's is used)
};

[[nodiscard]] constexpr std::uint64_t pad8(std::uint64_t n) noexcept {
  return (n + 7) & ~7ULL;
}

//! Bytes a record takes in a block (header, key, inline part, padding).
[[nodiscard]] std::uint64_t record_size(const record_in& r) noexcept;
//! Bytes a commit or relocation block of `records` takes.
[[nodiscard]] std::uint64_t block_size(std::span<const record_in> records) noexcept;
//! Bytes a blob block of a `length`-byte value takes.
[[nodiscard]] constexpr std::uint64_t blob_block_size(std::uint64_t length) noexcept {
  return sizeof(block_header) + pad8(length);
}

//! Writes a commit block (its records carry `seq`) or a relocation block (`seq` 0; each
//! record keeps its own) into `out`, exactly block_size(records) bytes. The header goes
//! last, and of the header its seq word, stored with release order: a block is complete
//! only once all of it is, and a reader that sees the seq word (block_seq) sees the rest.
//! Keys and lengths must already be valid (1–max_key bytes, values ≤ max_value); `out`
//! starts 8-aligned.
//! With `seal` false (a commit block of a commit in flight), the seq word is left as it is
//! (0), for seal_block: the block is whole only once sealed.
void encode_block(std::span<std::byte> out, block_kind kind, std::uint64_t seq,
                  std::span<const record_in> records, std::uint64_t salt,
                  bool seal = true) noexcept;
//! In a commit block's seq word: the block was abandoned (void_block) before it was sealed.
//! Above every seq: no snapshot ever counts the block, and its header's checksum fails.
constexpr std::uint64_t void_seq = ~std::uint64_t{0};
//! Seals the commit block encode_block wrote unsealed at `block`: its seq word goes from 0
//! to `seq` (compare and swap, release). False: another user abandoned it first
//! (void_block); the commit never happens.
[[nodiscard]] bool seal_block(std::span<std::byte> block, std::uint64_t seq) noexcept;
//! Abandons the commit block at `block` (being written by a user too slow to wait for) if it
//! is not sealed yet: its seq word goes from 0 to void_seq. Returns the word as it was: 0 (it
//! is abandoned now), void_seq (it was before), or the seq it was sealed with.
[[nodiscard]] std::uint64_t void_block(std::span<std::byte> block) noexcept;
//! Buries the commit block of `length` bytes at `block` whose writer died before sealing it
//! (or was abandoned: void_block): its seq word becomes void_seq unless it was sealed, and a
//! whole header is written around it, magic void_magic, with the block's length, so that every
//! later walk steps over it (spanned_block) whatever the writer left (its header or records
//! half written, or none). Returns false, changing nothing, if the block was sealed: its
//! commit happened. Only for a block whose writer is dead (nobody writes it any more).
[[nodiscard]] bool bury_block(std::span<std::byte> block, std::uint64_t length,
                              std::uint64_t salt) noexcept;
//! Writes, at `space`, the header of a block keel left on purpose (magic void_magic) of
//! `length` bytes (at least a header, a multiple of 8), so that every walk steps over it
//! whatever lies there: for space past the last block a rebuild found, which a writer killed
//! before its block's header (or seq word) was written left bytes in. Only by a rebuild alone.
void span_unwritten(std::span<std::byte> space, std::uint64_t length, std::uint64_t salt) noexcept;
//! The seq word of the commit block that starts at `block` (8-aligned), loaded with acquire
//! order: 0 while its writer has not finished it. Safe to call while a writer in this or
//! another process is still writing the block, which no other read of it is.
[[nodiscard]] std::uint64_t block_seq(std::span<const std::byte> block) noexcept;
//! Writes a blob block (exactly blob_block_size(value.size()) bytes). Returns the payload
//! checksum a put_blob record carries.
std::uint64_t encode_blob_block(std::span<std::byte> out, std::span<const std::byte> value,
                                std::uint64_t salt) noexcept;
//! Writes a pad block of `length` bytes (≥ 48, a multiple of 8): space a commit reserved and
//! gave up, stepped over by replay.
void encode_pad_block(std::span<std::byte> out, std::uint64_t salt) noexcept;

//! A record as read from a block.
struct record_view {
  record_header head;
  std::span<const std::byte> key;
  std::span<const std::byte> value;  //!< put: the value; otherwise empty
  blob_ref blob{};                   //!< put_blob
  std::uint64_t size = 0;            //!< bytes it takes, padding included
};

[[nodiscard]] inline bool is_blob(const record_view& r) noexcept {
  return r.head.op == static_cast<std::uint8_t>(op::put_blob);
}
//! Bytes a version takes in the segments: its record, and its blob block if it has one.
[[nodiscard]] inline std::uint64_t stored_size(const record_view& r) noexcept {
  return r.size + (is_blob(r) ? blob_block_size(r.head.value_length) : 0);
}

//! Reads the block header at the start of `bytes` (which may run on past the block: the rest
//! of the segment). Errors: corrupt at offset 0 (no magic, a bad header checksum, an unknown
//! kind, a length below 48, not a multiple of 8 or past the end of `bytes`).
[[nodiscard]] result<block_header> parse_block_header(std::span<const std::byte> bytes,
                                                      std::uint64_t salt) noexcept;

//! Reads the record at the start of `bytes` (the rest of its block). With `verify`, checks
//! its checksum. Errors: corrupt at offset 0 (lengths out of range or past the end, unknown
//! op, nonzero reserved bytes, a bad checksum).
[[nodiscard]] result<record_view> parse_record(std::span<const std::byte> bytes, std::uint64_t salt,
                                               bool verify) noexcept;

//! parse_record without reading past what locates the record's parts: checks its header's
//! fields and that its parts lie inside `bytes`, not its padding nor its checksum (so it
//! touches the record's first cache line, and a blob reference's). For walks that need only
//! sizes and ops, such as compaction's count of what is live. Errors: as parse_record's.
[[nodiscard]] result<record_view> parse_record_head(std::span<const std::byte> bytes) noexcept;

//! A blob block's value (its header already parsed).
[[nodiscard]] std::span<const std::byte> blob_value(std::span<const std::byte> block,
                                                    const block_header& h) noexcept;

//! In place of a block's magic: a block a power cut tore, voided by a rebuild so that no
//! later one judges it again (doc/kv-format.md, "Recovery"); the rest of its header stays.
constexpr std::uint32_t void_magic = 0x44494f56;  // "VOID"
//! Voids the torn block at the start of `block` (its header checked out): its magic becomes
//! void_magic.
void void_torn_block(std::span<std::byte> block) noexcept;
//! The length of the block at the start of `bytes` if it is one keel left there on purpose,
//! not damage: a torn block voided (void_torn_block), or a commit abandoned before it was
//! sealed (void_block: its seq word all ones, its header otherwise as written, with its
//! records' seq). nullopt otherwise.
[[nodiscard]] std::optional<std::uint64_t> spanned_block(std::span<const std::byte> bytes,
                                                         std::uint64_t salt) noexcept;

//! The unit a power cut writes whole or not at all (doc/kv-format.md, "Recovery": like
//! SQLite's powersafe overwrite, keel counts on a sector of a write being either all new or
//! all old after a cut).
constexpr std::uint64_t sector_size = 512;

//! Whether some sector (of the file, counted from its start) that [offset, offset + length)
//! of `file` overlaps holds only zeros in that overlap: bytes a write never put there. Space
//! keel writes a block into is fresh (allocated, zero), so a block a power cut tore has such
//! a sector; one that bits flipped in, written whole, has none (unless its own bytes there
//! are zeros). `file` is the file's bytes from its offset 0.
[[nodiscard]] bool has_unwritten_sector(std::span<const std::byte> file, std::uint64_t offset,
                                        std::uint64_t length) noexcept;

//! Whether the block at the start of `bytes` is complete: its header, its payload checksum
//! and every record check out and the records fill it exactly. The one test for "this commit
//! happened", shared by replay and by users clearing up after a dead writer. Returns the
//! header when complete; corrupt (at the offset of the first bad part) when not.
[[nodiscard]] result<block_header> check_block(std::span<const std::byte> bytes,
                                               std::uint64_t salt) noexcept;

}  // namespace keel::kv::disk
