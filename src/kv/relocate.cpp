// A record moved by compaction (doc/kv-format.md, "Compaction", moving a record): copied to
// the tail in a relocation block, and the entry that names it pointed at the copy, through
// the index's own probe (index::table), only if it still names the original.

#include <algorithm>
#include <vector>

#include "kv/store_impl.hpp"

namespace keel::kv {

bool store::impl::named_now(std::uint64_t at, std::span<const std::byte> key) const noexcept {
  const disk::key_hash h = hash_of(key);
  bool named = false;
  table->for_chain(table->page_of(h), h, [&](index::entry_ref e) {
    if (e.location().load(std::memory_order_acquire) != at) return true;
    named = true;
    return false;
  });
  return named;
}

result<bool> store::impl::repoint(std::uint64_t at, std::span<const std::byte> key,
                                  std::uint64_t to, const io::countdown& cd) noexcept {
  const disk::key_hash h = hash_of(key);
  for (;;) {
    const std::uint64_t page = table->page_of(h);
    auto g = locks->lock({lock::entity(page)}, io::deadline(cd.expiry()));
    if (!g) return std::unexpected(g.error());
    if (table->page_of(h) != page) continue;  // split meanwhile
    if (const index::split_journal j = table->pending_split();
        j.old == page || j.low == page || j.high == page) {
      (void)g->unlock();
      if (auto r = settle_split(cd); !r) return std::unexpected(r.error());
      continue;
    }
    // The entry that names this very record, if any still does (dead writers' marks of
    // the hash settled first: only theirs can be pending while we hold the page).
    if (auto r = settle_chain(page, h); !r) return std::unexpected(r.error());
    std::optional<index::entry_ref> entry;
    table->for_chain(page, h, [&](index::entry_ref e) {
      if (e.location().load(std::memory_order_acquire) != at) return true;
      entry = e;
      return false;
    });
    if (!entry) return false;  // superseded: dead
    const index::entry_ref e = *entry;
    const auto holding =
        static_cast<std::uint64_t>(table->page_holding(e).base - base()) / disk::page_size;
    if (auto w = index_write_ready(holding); !w) return std::unexpected(w.error());
    // (Made writable above, the page may be written back and refused again before the
    // stores: then, past the deadline, the move ends where a compactor killed there leaves
    // it, a copy no entry names or an entry that names the whole copy.)
    if (!stored_escapably(cd, [&] {
          index::change_entry(table->page_holding(e), e, [&] {
            // The copy is whole before the entry names it; the seq stays (the same version).
            // An erase forgotten frees the entry for any key: location first.
            e.location().store(to, std::memory_order_release);
            if (to == 0) e.seq().store(0, std::memory_order_release);
          });
        })) {
      return std::unexpected(index_write_refusal());
    }
    return true;
  }
}

result<void> store::impl::relocate(std::span<const move> moves,
                                   const std::set<std::uint64_t>& victims, const io::countdown& cd,
                                   compact_stats& st, std::uint64_t& moved) noexcept {
  // The copies, each with its blob copied first when that lies in a victim (a victim's blobs
  // are only ever its own records' or another victim's: see compact).
  std::vector<disk::record_in> records;
  std::vector<const move*> of;
  std::vector<std::uint64_t> blob_bytes;
  std::vector<std::uint64_t> cuts;
  try {
    records.reserve(moves.size());
    of.reserve(moves.size());
    blob_bytes.reserve(moves.size());
    cuts.reserve(moves.size());
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  for (const move& m : moves) {
    const disk::record_view& rec = m.rec;
    disk::record_in r;
    r.key = rec.key;
    r.what = static_cast<disk::op>(rec.head.op);
    r.value = rec.value;
    r.blob = rec.blob;
    r.value_length = rec.head.value_length;
    r.prev = rec.head.prev;
    r.prev_seq = rec.head.prev_seq;
    r.seq = rec.head.seq;
    std::uint64_t blob = 0;
    if (disk::is_blob(rec) && victims.contains(disk::segment_of(rec.blob.location))) {
      auto value = value_of(found_record{m.at, rec, nullptr}, true);  // copies are checked
      if (!value && value.error() == errc::corrupt) {
        st.records_unreadable += 1;  // its blob does not check out: it stays
        continue;
      }
      if (!value) return std::unexpected(value.error());
      blob = disk::blob_block_size(value->size());
      auto nb = reserve(blob, room_for::compaction);  // it may take the spare
      if (!nb) return std::unexpected(nb.error());
      if (auto w = segment_write_ready(*nb, blob); !w) return std::unexpected(w.error());
      auto out = bytes_at(*nb);
      if (!out) return std::unexpected(out.error());
      std::uint64_t made = 0;
      if (!stored_escapably(cd, [&] {
            made = write_dirty(
                *nb, [&] { return disk::encode_blob_block(out->first(blob), *value, salt); });
          })) {
        return std::unexpected(index_write_refusal());
      }
      r.blob = {*nb, made};
    }
    records.push_back(r);
    of.push_back(&m);
    blob_bytes.push_back(blob);
  }
  // Many records to a relocation block (one block each cost a header apiece: a segment of
  // single puts of 16-byte values could not be copied into its own size), each block as many
  // as fit the rest of the tail's segment, and the rest in the next.
  for (std::size_t first = 0; first < records.size();) {
    cuts.clear();
    std::uint64_t length = sizeof(disk::block_header);
    for (std::size_t i = first; i < records.size(); ++i) {
      length += disk::record_size(records[i]);
      cuts.push_back(length);
    }
    auto got = reserve_fitting(cuts, room_for::compaction);
    if (!got) return std::unexpected(got.error());
    const std::uint64_t block_at = got->at;
    length = cuts[got->count - 1];
    const std::span<const disk::record_in> part(records.data() + first, got->count);
    if (auto w = segment_write_ready(block_at, length); !w) return std::unexpected(w.error());
    auto out = bytes_at(block_at);
    if (!out) return std::unexpected(out.error());
    if (!stored_escapably(cd, [&] {
          write_dirty(block_at, [&] {
            disk::encode_block(out->first(length), disk::block_kind::relocation, 0, part, salt);
          });
        })) {
      return std::unexpected(index_write_refusal());
    }
    if (relocation_written_hook != nullptr) relocation_written_hook();
    // Each entry that still names its original now names the copy; a copy whose record was
    // superseded meanwhile is dead, and so is its blob's.
    std::uint64_t dead = 0;
    std::uint64_t at = block_at + sizeof(disk::block_header);
    for (std::size_t i = first; i < first + got->count; ++i) {
      const std::uint64_t size = disk::record_size(records[i]);
      auto pointed = repoint(of[i]->at, of[i]->rec.key, at, cd);
      if (!pointed) {
        (void)stored_escapably(cd, [&] { h64(header::dead_bytes).fetch_add(dead); });
        return std::unexpected(pointed.error());
      }
      if (*pointed) {
        st.records_moved += 1;
        st.bytes_moved += size + blob_bytes[i];
        moved += of[i]->rec.size;
      } else {
        dead += size + blob_bytes[i];
      }
      at += size;
    }
    st.bytes_moved += sizeof(disk::block_header);
    if (dead != 0 && !stored_escapably(cd, [&] { h64(header::dead_bytes).fetch_add(dead); })) {
      return std::unexpected(index_write_refusal());
    }
    first += got->count;
  }
  return {};
}

}  // namespace keel::kv
