// Which entry of a probe chain is which key's (doc/kv-format.md, "Reading at a snapshot",
// "Dead users"): the one place that turns the index's entries of a hash into keys' records.
//
// Two keys may share a 128-bit hash, so an entry is a key's only when the record it names
// holds the key's bytes. A writer marks each entry it will publish with pending | its block's
// location, leaving the location as it was: the key's previous record, or 0 for a new key.
// Once the block counts (complete; for a reader, settled at or below its snapshot) a pending
// entry names its own key's record in the block: for a key that existed, the record with the
// bytes its previous record holds; for new keys, the records of the hash no such entry
// claims, given to the new keys' entries in chain order (all of them new keys of one hash in
// one commit, any of them may have any). Writers, readers, scans and checkpoints all ask
// here, so they always agree.

#include <algorithm>
#include <array>
#include <vector>

#include "kv/store_impl.hpp"

namespace keel::kv {
namespace {

bool same(std::span<const std::byte> a, std::span<const std::byte> b) noexcept {
  return std::ranges::equal(a, b);
}

// An entry as read: its seq first, then its location. A publish stores them the other way
// round (location, then seq), so a settled seq comes with its own location or a newer one
// of the same key (whose record's seq says so: a read at a snapshot walks back from it); a
// pending one with either the previous location or the settled one, which name the same key.
struct seen_entry {
  index::entry_ref e{nullptr};
  std::uint64_t seq = 0;
  std::uint64_t at = 0;
  [[nodiscard]] bool pending() const noexcept { return (seq & index::pending) != 0; }
  [[nodiscard]] std::uint64_t block() const noexcept { return seq & ~index::pending; }
};

seen_entry see(index::entry_ref e) noexcept {
  const std::uint64_t seq = e.seq().load(std::memory_order_acquire);
  return {e, seq, e.location().load(std::memory_order_acquire)};
}

// The entries of one hash in a page's chain, as read: a page's worth without the heap (more
// only when keys of one hash overflowed into its chain).
struct chain {
  std::array<seen_entry, index::entries_per_page> first{};
  std::vector<seen_entry> more;
  std::size_t n = 0;
  bool any_pending = false;
  [[nodiscard]] const seen_entry& operator[](std::size_t i) const noexcept {
    return i < first.size() ? first[i] : more[i - first.size()];
  }
};

result<chain> read_chain(const index::table& t, std::uint64_t page,
                         const disk::key_hash& h) noexcept {
  result<chain> out{std::in_place};
  chain& c = *out;
  try {
    t.for_chain(page, h, [&](index::entry_ref e) {
      const seen_entry se = see(e);
      if (c.n < c.first.size()) {
        c.first[c.n] = se;
      } else {
        c.more.push_back(se);
      }
      c.any_pending |= se.pending();
      ++c.n;
      return true;
    });
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return out;
}

// A record of a block that cannot be parsed: corrupt, naming its segment and offset.
error bad_record(store::impl& s, std::uint64_t location, const error& e) noexcept {
  auto seg = s.segment_at(disk::segment_of(location));
  if (!seg) return e;
  return e.about((*seg)->path, disk::offset_of(location));
}

// A record of a complete block.
struct block_record {
  std::uint64_t location;
  std::span<const std::byte> key;
};

}  // namespace

namespace {

// The records of hash `h` in the complete block at `block`, in block order.
result<std::vector<block_record>> records_of(store::impl& s, std::uint64_t block,
                                             const disk::block_header& head,
                                             const disk::key_hash& h) noexcept {
  auto bytes = s.bytes_at(block);
  if (!bytes) return std::unexpected(bytes.error());
  std::vector<block_record> out;
  try {
    std::uint64_t r = sizeof(disk::block_header);
    for (std::uint32_t i = 0; i < head.records; ++i) {
      auto rec = disk::parse_record(bytes->subspan(r, head.length - r), s.salt, false);
      if (!rec) return std::unexpected(bad_record(s, block + r, rec.error()));
      if (s.hash_of(rec->key) == h) out.push_back({block + r, rec->key});
      r += rec->size;
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return out;
}

// The location of `key`'s record in the complete block at `block`, if it has one.
result<std::optional<std::uint64_t>> key_in_block(store::impl& s, std::uint64_t block,
                                                  const disk::block_header& head,
                                                  std::span<const std::byte> key) noexcept {
  auto bytes = s.bytes_at(block);
  if (!bytes) return std::unexpected(bytes.error());
  std::uint64_t r = sizeof(disk::block_header);
  for (std::uint32_t i = 0; i < head.records; ++i) {
    auto rec = disk::parse_record(bytes->subspan(r, head.length - r), s.salt, false);
    if (!rec) return std::unexpected(bad_record(s, block + r, rec.error()));
    if (same(rec->key, key)) return std::optional<std::uint64_t>(block + r);
    r += rec->size;
  }
  return std::optional<std::uint64_t>{};
}

// For the entries of `c` pending on `block` (complete, its records of the hash `records`):
// each one's own record there (0: none). A record some entry names already is taken (its
// entry was published); an entry of a key that existed takes the record with its previous
// record's key; the new keys' entries take the others, in chain order.
result<std::vector<std::uint64_t>> assign(store::impl& s, const chain& c, std::uint64_t block,
                                          const std::vector<block_record>& records) noexcept {
  std::vector<std::uint64_t> out;
  std::vector<bool> used;
  try {
    out.assign(c.n, 0);
    used.assign(records.size(), false);
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  // A record an entry names already is that entry's: its writer published it (the rest of
  // its commit's entries may still be pending: a writer killed part-way through step 9).
  for (std::size_t j = 0; j < records.size(); ++j) {
    for (std::size_t i = 0; i < c.n; ++i) {
      if (c[i].at != records[j].location) continue;
      used[j] = true;
      if (c[i].pending() && c[i].block() == block) out[i] = records[j].location;
    }
  }
  for (std::size_t i = 0; i < c.n; ++i) {
    const seen_entry& se = c[i];
    if (!se.pending() || se.block() != block || se.at == 0 || out[i] != 0) continue;
    auto before = s.record_head_at(se.at);
    if (!before) return std::unexpected(before.error());
    for (std::size_t j = 0; j < records.size(); ++j) {
      if (used[j] || !same(records[j].key, before->rec.key)) continue;
      used[j] = true;
      out[i] = records[j].location;
      break;
    }
  }
  std::size_t next = 0;
  for (std::size_t i = 0; i < c.n; ++i) {
    const seen_entry& se = c[i];
    if (!se.pending() || se.block() != block || se.at != 0) continue;
    while (next < records.size() && used[next])
      ++next;
    if (next == records.size()) break;
    used[next] = true;
    out[i] = records[next].location;
  }
  return out;
}

// The record at `at` if it is `key`'s (checked as `verify` says), nullopt if it is another
// key's. A record that does not check out is `key`'s error: its entry holds `key`'s 128-bit
// hash, and the bytes that would say whose it is are what may be damaged (another key of
// the hash, damaged, is the rare case that costs a lookup an error, never an answer).
result<std::optional<found_record>> keyed_record(store::impl& s, std::uint64_t at,
                                                 std::span<const std::byte> key,
                                                 bool verify) noexcept {
  auto r = verify ? s.record_at(at, true) : s.record_head_at(at);
  if (!r) return std::unexpected(r.error());
  if (same(r->rec.key, key)) return std::optional<found_record>(*r);
  if (!verify) {
    // Told apart by bytes that did not check out yet: only a record that does is another's.
    auto whole = s.record_at(at, true);
    if (!whole) return std::unexpected(whole.error());
  }
  return std::optional<found_record>{};
}

}  // namespace

result<std::optional<found_record>> store::impl::locate(std::uint64_t page, const disk::key_hash& h,
                                                        std::span<const std::byte> key,
                                                        std::uint64_t snapshot,
                                                        bool verify) noexcept {
  using found = std::optional<found_record>;
  // The common case first, as cheap as a probe without collisions: a settled entry whose
  // record is the key's (a key has one entry; the first whose record holds it is it).
  bool pending_seen = false;
  bool done = false;
  result<found> out{found{}};
  table->for_chain(page, h, [&](index::entry_ref e) {
    const seen_entry se = see(e);
    if (se.pending()) {
      pending_seen = true;
      return true;
    }
    if (se.at == 0) return true;  // holds nothing
    out = keyed_record(*this, se.at, key, verify);
    done = !out || out->has_value();
    return !done;
  });
  if (done || !pending_seen) return out;

  // A writer marked some entry of the hash: read the chain as it is now.
  auto read = read_chain(*table, page, h);
  if (!read) return std::unexpected(read.error());
  const chain& c = *read;
  // The key's own entry: one whose location (settled, or the previous one of a pending
  // entry) names a record holding the key.
  for (std::size_t i = 0; i < c.n; ++i) {
    const seen_entry& se = c[i];
    if (se.at == 0) continue;
    auto mine = keyed_record(*this, se.at, key, false);
    if (!mine) return std::unexpected(mine.error());
    if (!*mine) continue;
    if (se.pending()) {
      auto counts = settled_block(se.block(), snapshot);
      if (!counts) return std::unexpected(counts.error());
      if (*counts) {
        auto in = key_in_block(*this, se.block(), **counts, key);
        if (!in) return std::unexpected(in.error());
        if (*in) return keyed_record(*this, **in, key, verify);
      }
    }
    return keyed_record(*this, se.at, key, verify);
  }
  // None: the key, if anywhere, is new in the block of a pending entry of a new key.
  for (std::size_t i = 0; i < c.n; ++i) {
    const seen_entry& se = c[i];
    if (!se.pending() || se.at != 0) continue;
    auto counts = settled_block(se.block(), snapshot);
    if (!counts) return std::unexpected(counts.error());
    if (!*counts) continue;
    auto in = key_in_block(*this, se.block(), **counts, key);
    if (!in) return std::unexpected(in.error());
    if (*in) return keyed_record(*this, **in, key, verify);
  }
  return found{};
}

result<void> store::impl::settle_chain(std::uint64_t page, const disk::key_hash& h) noexcept {
  auto read = read_chain(*table, page, h);
  if (!read) return std::unexpected(read.error());
  const chain& c = *read;
  if (!c.any_pending) return {};
  // Block by block: each decides all of its entries at once (new keys' entries share out
  // the records no existing key's entry claims).
  for (std::size_t i = 0; i < c.n; ++i) {
    if (!c[i].pending()) continue;
    const std::uint64_t block = c[i].block();
    bool done = false;  // by an earlier entry of the block
    for (std::size_t j = 0; j < i && !done; ++j)
      done = c[j].pending() && c[j].block() == block;
    if (done) continue;
    auto whole = complete_block(block);
    if (!whole) return std::unexpected(whole.error());
    std::vector<std::uint64_t> to;
    if (*whole) {
      auto records = records_of(*this, block, **whole, h);
      if (!records) return std::unexpected(records.error());
      auto given = assign(*this, c, block, *records);
      if (!given) return std::unexpected(given.error());
      to = std::move(*given);
    }
    for (std::size_t j = i; j < c.n; ++j) {
      const seen_entry& se = c[j];
      if (!se.pending() || se.block() != block) continue;
      std::uint64_t seq = se.seq;
      if (!to.empty() && to[j] != 0) {
        // The commit happened: its writer died before publishing this entry.
        if (auto w = change_entry_escapably(
                se.e,
                [&] {
                  se.e.location().store(to[j], std::memory_order_release);
                  se.e.seq().compare_exchange_strong(seq, (*whole)->seq, std::memory_order_acq_rel);
                });
            !w) {
          return w;
        }
        continue;
      }
      // Not complete (or no record of its key there): back to the version its location
      // names; a new key's entry then holds nothing.
      std::uint64_t restored = 0;
      if (se.at != 0) {
        auto before = record_head_at(se.at);
        if (!before) return std::unexpected(before.error());
        restored = before->rec.head.seq;
      }
      if (auto w = change_entry_escapably(se.e,
                                          [&] {
                                            se.e.seq().compare_exchange_strong(
                                                seq, restored, std::memory_order_acq_rel);
                                          });
          !w) {
        return w;
      }
    }
  }
  return {};
}

result<std::optional<index::entry_ref>> store::impl::find_locked(
    std::uint64_t page, const disk::key_hash& h, std::span<const std::byte> key) noexcept {
  // One walk in the common case: a pending entry met on the way (a dead or abandoned
  // writer's) is settled first, with the whole chain, and the walk starts again.
  for (bool settled = false;; settled = true) {
    result<std::optional<index::entry_ref>> out{std::optional<index::entry_ref>{}};
    // With no entry whose record holds the key, one under its hash whose record does not
    // check out is taken for the key's own (its key's bytes may be what was damaged):
    // writing the key anew repairs it (readers get `corrupt` from it meanwhile, never
    // another answer).
    std::optional<index::entry_ref> damaged;
    bool pending_met = false;
    table->for_chain(page, h, [&](index::entry_ref e) {
      if (!settled && (e.seq().load(std::memory_order_acquire) & index::pending) != 0) {
        pending_met = true;
        return false;
      }
      const std::uint64_t at = e.location().load(std::memory_order_acquire);
      if (at == 0) return true;
      auto mine = keyed_record(*this, at, key, false);
      if (!mine) {
        if (mine.error() == errc::corrupt) {
          if (!damaged) damaged = e;
          return true;
        }
        out = std::unexpected(mine.error());
        return false;
      }
      if (!*mine) return true;
      out = std::optional<index::entry_ref>(e);
      return false;
    });
    if (pending_met) {
      if (auto r = settle_chain(page, h); !r) return std::unexpected(r.error());
      continue;
    }
    if (out && !*out && damaged) return damaged;
    return out;
  }
}

result<std::uint64_t> store::impl::named_by(std::uint64_t page, const disk::key_hash& h,
                                            index::entry_ref e, std::uint64_t seq, std::uint64_t at,
                                            std::uint64_t snapshot) noexcept {
  if ((seq & index::pending) == 0) return at;
  const std::uint64_t block = seq & ~index::pending;
  auto counts = settled_block(block, snapshot);
  if (!counts) return std::unexpected(counts.error());
  if (!*counts) return at;
  auto read = read_chain(*table, page, h);
  if (!read) return std::unexpected(read.error());
  const chain& c = *read;
  std::size_t i = 0;
  while (i < c.n && c[i].e.w != e.w)
    ++i;
  // Settled meanwhile (by a writer of the page): what it names now.
  if (i == c.n || !c[i].pending() || c[i].block() != block) {
    return i == c.n ? at : c[i].at;
  }
  auto records = records_of(*this, block, **counts, h);
  if (!records) return std::unexpected(records.error());
  auto given = assign(*this, c, block, *records);
  if (!given) return std::unexpected(given.error());
  return (*given)[i] != 0 ? (*given)[i] : c[i].at;
}

}  // namespace keel::kv
