// Rebuilding the index from the log (doc/kv-format.md, "Checkpoints and recovery",
// "Recovery"), by one rule: recovery rolls back nothing it cannot prove absent. A commit
// block is judged by its bytes: complete, torn (a sector of it, or of a blob it names, was
// never written: a power cut took it, and it never happened), or damaged (written whole and
// changed since: it happened, and its damage is reported, never taken for "never happened").
// What cannot be read is the rebuild's error, and nothing of the log is changed then.

#include <algorithm>
#include <array>
#include <cstring>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "io/process.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {

// Records of damaged blocks replay could not apply (they do not check out): the rebuild
// stands only if each was superseded, which is proven only by a record that checks out and
// names it as its previous version (its own bytes, key and seq included, may be what is
// damaged). Previous versions always lie at lower locations, so each is proven, if ever,
// after it was noted.
struct unread_records {
  std::set<std::uint64_t> at;  // records whose header could be read: their locations
  struct tail {
    std::uint64_t from, end;  // a block's records from the first unreadable header on
    std::uint32_t count;      // how many of them are still unproven
  };
  std::vector<tail> tails;
  //! A record that checks out names `prev` as its previous version.
  void superseded(std::uint64_t prev) noexcept {
    if (prev == 0 || (at.empty() && tails.empty())) return;
    if (at.erase(prev) != 0) return;
    for (tail& t : tails) {
      if (prev >= t.from && prev < t.end && t.count > 0) {
        --t.count;
        return;
      }
    }
  }
  //! The first record still unproven (0: none).
  [[nodiscard]] std::uint64_t first() const noexcept {
    std::uint64_t first = at.empty() ? 0 : *at.begin();
    for (const tail& t : tails) {
      if (t.count > 0 && (first == 0 || t.from < first)) first = t.from;
    }
    return first;
  }
};

struct store::impl::replay_state {
  //! Every block below this location is durable (the manifest says so): one there that does
  //! not check out is damaged, never torn.
  std::uint64_t durable_below = 0;
  //! The seq the loaded checkpoint is a copy at (0: none): commits at or below are in it.
  std::uint64_t checkpoint_seq = 0;
  std::uint64_t max_seq = 0;
  unread_records unread;
  //! Blocks a power cut tore: voided once the replay is done (their magic replaced, synced:
  //! disk::void_torn_block), so that no later replay judges them again, when what the bytes show
  //! has changed: once the blob a whole commit block names is compacted away (its missing segment
  //! then reads as a removed blob), or once a close has recorded every block below the tail as
  //! durable (a torn block there would read as damage).
  std::vector<std::uint64_t> voids;
  //! Of those, a whole commit block naming a torn blob: it must be voided before anything
  //! else happens to the store (a read-only opener refuses the store).
  bool must_void = false;
};

result<void> store::impl::reset_index() noexcept {
  if (auto r = index_file.truncate(0); !r) return r;
  if (index_reset_hook != nullptr) index_reset_hook();
  const std::uint64_t pages = initial_index_pages_for(dir.params.first_segment_size);
  if (auto r = index_file.allocate(0, static_cast<off_t>(pages * disk::page_size)); !r) return r;
  const auto head = index_format.header();
  std::memcpy(base(), &head, sizeof head);
  std::memcpy(base() + header::store_id, dir.params.id.data(), 16);
  h64(header::state).store(state_building);
  h64(header::pages_allocated).store(pages);
  h64(header::pages_used).store(first_free_page);
  h64(header::next_segment).store(1);
  return table->create(*this);
}

result<store::impl::segment_census> store::impl::check_segments() noexcept {
  // What the manifest lists must be there: one missing (deleted by hand, lost) is damage,
  // named, never a shorter log replayed. What it does not list is not the store's log: a
  // maker's or a compactor's leftover (nothing is written into a segment before it is
  // listed, and a compacted one is taken off before it is removed), never replayed, and
  // removed once proven dead (remove_leftovers).
  auto listed = read_manifest();
  if (!listed) return std::unexpected(listed.error());
  auto present = segment_numbers(!opts.read_only);
  if (!present) return std::unexpected(present.error());
  segment_census census;
  census.numbered_below = std::max<std::uint64_t>(1, listed->numbered_below);
  try {
    for (const disk::manifest_entry& e : listed->entries) {
      if (!std::ranges::binary_search(*present, e.number)) {
        return std::unexpected(error(errc::corrupt).about(path + "/seg/" + segment_name(e.number)));
      }
      census.listed.push_back(e.number);
    }
    for (const std::uint64_t n : *present) {
      if (!std::ranges::binary_search(census.listed, n)) census.unlisted.push_back(n);
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return census;
}

result<void> store::impl::remove_leftovers(const std::vector<std::uint64_t>& unlisted,
                                           bool remove) noexcept {
  // Alone, with the index built. A leftover is removed (by a writable opener; a read-only
  // one only looks) only once nothing in it can be live: every record in it checks out and its
  // key's entry holds that version or a newer one (an erase record's key may have none: forgotten).
  // Else the manifest has lost a segment that still matters (damage): the store is refused, naming
  // the manifest, and the file stays. So does one that an entry names: the record it holds, its
  // pending block, or the blob of its record (an index kept from before the manifest lost it
  // names the very versions in it, which no seq comparison tells from superseded ones).
  if (unlisted.empty()) return {};
  const auto lost = error(errc::corrupt).about(path + "/manifest");
  std::vector<location_range> ranges;
  try {
    for (const std::uint64_t n : unlisted)
      ranges.push_back({disk::make_location(n, 0), disk::make_location(n + 1, 0)});
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  if (auto named = index_names(ranges, true); !named) {
    return std::unexpected(named.error());
  } else if (*named) {
    return std::unexpected(lost);
  }
  // Every leftover proven before any is removed: a refused store keeps every file (salvage
  // reads them). (One holding only a live blob was once removed before the next was refused.)
  std::vector<std::uint64_t> dead;
  for (const std::uint64_t n : unlisted) {
    auto seg = segment_at(n);
    if (!seg) continue;  // not one of this store's segments as far as can be told: left alone
    const segment& sg = **seg;
    const auto bytes = sg.bytes();
    auto proven =
        for_each_block(sg, [&](std::uint64_t off, const disk::block_header& head) -> result<void> {
          if (head.kind == static_cast<std::uint16_t>(disk::block_kind::blob)) return {};
          std::uint64_t r = off + sizeof(disk::block_header);
          for (std::uint32_t i = 0; i < head.records; ++i) {
            auto rec = disk::parse_record(bytes.subspan(r, off + head.length - r), salt, true);
            if (!rec) return keel_error(errc::corrupt);
            const disk::key_hash h = hash_of(rec->key);
            auto e = find_locked(table->page_of(h), h, rec->key);
            if (!e) return std::unexpected(e.error());
            const bool erase = rec->head.op == static_cast<std::uint8_t>(disk::op::erase);
            if (*e ? (*e)->seq().load() < rec->head.seq : !erase) return keel_error(errc::corrupt);
            r += rec->size;
          }
          return {};
        });
    if (!proven) {
      if (proven.error() != errc::corrupt) return std::unexpected(proven.error());
      return std::unexpected(lost);
    }
    try {
      dead.push_back(n);
    } catch (const std::bad_alloc&) {
      return errc_error(std::errc::not_enough_memory);
    }
  }
  if (!remove) return {};  // (a read-only opener changes nothing)
  bool removed = false;
  for (const std::uint64_t n : dead) {
    // Its entry in the segment table too, where it still holds it: a compactor killed after
    // it took its victims off the manifest, and before it emptied their entries, left them
    // there, and once their files were gone every sync commit (which syncs each segment the
    // table names) and every compaction failed with ENOENT, reopened or not.
    std::uint64_t holder = n;
    if (auto w = store_or_refuse(
            [&] { segtab(n, 0).compare_exchange_strong(holder, 0, std::memory_order_seq_cst); });
        !w) {
      return w;
    }
    mapped.forget(n);  // its room comes back only once nobody maps it
    removed = io::unlink_at(dir.segments, segment_name(n).c_str()) || removed;
  }
  if (removed) {
    if (auto d = dir.segments.sync_all(); !d)
      return std::unexpected(d.error().about(path + "/seg"));
  }
  return {};
}

result<bool> store::impl::index_names(std::span<const location_range> ranges,
                                      bool pending) noexcept {
  const auto in = [&](std::uint64_t location) {
    return location != 0 && std::ranges::any_of(ranges, [&](const location_range& r) {
             return location >= r.from && location < r.to;
           });
  };
  bool named = false;
  auto walked = table->for_each_page(0, [&](std::uint64_t page) -> result<bool> {
    table->page(page).for_each_key(
        [&](std::size_t, const index::entry_ref&, const index::entry_ref::state& e) {
          const std::uint64_t seq = e.seq;
          const std::uint64_t at = e.location;
          named = (pending && (seq & index::pending) != 0 && in(seq & ~index::pending)) || in(at);
          if (named || at == 0) return !named;
          // (A record that cannot be read is not this walk's to judge: reading it says
          // corrupt.)
          if (auto rec = record_head_at(at); rec && disk::is_blob(rec->rec)) {
            named = in(rec->rec.blob.location);
          }
          return !named;
        });
    return !named;
  });
  if (!walked) return std::unexpected(walked.error());
  return named;
}

result<store::impl::commit_judgement> store::impl::judge_commit(
    std::uint64_t location, const disk::block_header& head) noexcept {
  using kind = commit_judgement::kind;
  auto seg = segment_at(disk::segment_of(location));
  if (!seg) return std::unexpected(seg.error());
  const std::uint64_t off = disk::offset_of(location);
  const auto bytes = (*seg)->bytes().subspan(off);
  if (!disk::check_block(bytes, salt)) {
    const bool torn = disk::has_unwritten_sector((*seg)->bytes(), off, head.length);
    return commit_judgement{torn ? kind::torn : kind::damaged, false};
  }
  std::uint64_t r = sizeof(disk::block_header);
  for (std::uint32_t i = 0; i < head.records; ++i) {
    auto rec = disk::parse_record(bytes.subspan(r, head.length - r), salt, false);
    if (!rec) return commit_judgement{kind::damaged, false};  // cannot be: check_block read it
    r += rec->size;
    if (!disk::is_blob(*rec)) continue;
    auto v = value_of(found_record{location + r - rec->size, *rec, nullptr}, true);
    if (v || v.error() == std::errc::no_such_file_or_directory) continue;  // (removed whole)
    if (v.error() != errc::corrupt) return std::unexpected(v.error());
    // The blob does not check out: never written (torn), or written and changed since (the
    // commit stands; reading that value is `corrupt`).
    auto blob_seg = segment_at(disk::segment_of(rec->blob.location));
    if (!blob_seg) return std::unexpected(blob_seg.error());
    if (disk::has_unwritten_sector((*blob_seg)->bytes(), disk::offset_of(rec->blob.location),
                                   disk::blob_block_size(rec->head.value_length))) {
      return commit_judgement{kind::torn, true};
    }
  }
  return commit_judgement{kind::complete, false};
}

namespace {

// The records of the block at `off` of `bytes` (whose header checks out) one by one, each
// checked by its own checksum: `apply(location, record)` for those that check out, and
// `unread(location, end, count)` for those that do not: one (count 1, `end` 0) whose header
// could be read, or, from one whose header could not (where the next starts is unknown), the
// `count` records left in [location, end).
template <class Apply, class Unread>
result<void> each_record(std::span<const std::byte> bytes, std::uint64_t segment, std::uint64_t off,
                         const disk::block_header& head, std::uint64_t salt, Apply&& apply,
                         Unread&& unread) noexcept {
  std::uint64_t r = off + sizeof(disk::block_header);
  for (std::uint32_t i = 0; i < head.records; ++i) {
    const auto rest = bytes.subspan(r, off + head.length - r);
    const std::uint64_t at = disk::make_location(segment, r);
    auto rec = disk::parse_record(rest, salt, true);
    if (rec) {
      if (auto a = apply(at, *rec); !a) return a;
      r += rec->size;
      continue;
    }
    auto shape = disk::parse_record_head(rest);
    if (!shape)
      return unread(at, disk::make_location(segment, off + head.length), head.records - i);
    if (auto u = unread(at, std::uint64_t{0}, 1u); !u) return u;
    r += shape->size;
  }
  return {};
}

}  // namespace

result<void> store::impl::replay_segment(segment& s, replay_state& st,
                                         std::uint64_t& end) noexcept {
  using kind = commit_judgement::kind;
  const std::span<const std::byte> bytes = s.bytes();
  const auto note_unread = [&st](std::uint64_t at, std::uint64_t until,
                                 std::uint32_t count) -> result<void> {
    try {
      if (until == 0) {
        st.unread.at.insert(at);
      } else {
        st.unread.tails.push_back({at, until, count});
      }
    } catch (const std::bad_alloc&) {
      return errc_error(std::errc::not_enough_memory);
    }
    return {};
  };
  const auto note_void = [&st](std::uint64_t at) -> result<void> {
    try {
      st.voids.push_back(at);
    } catch (const std::bad_alloc&) {
      return errc_error(std::errc::not_enough_memory);
    }
    return {};
  };
  // Below durable_below every byte is a block, zeros, or one keel left on purpose: anything
  // else is a block whose header was damaged, which could hide a commit: refused, naming it.
  const auto unexplained = [&](std::uint64_t off, std::uint64_t) -> result<void> {
    return std::unexpected(error(errc::corrupt).about(s.path, off));
  };
  // Past a block keel left on purpose too: nothing new is written inside it.
  const auto spanned = [&](std::uint64_t off, std::uint64_t length) -> result<void> {
    end = off + length;
    return {};
  };
  return for_each_block(
      s, end,
      [&](std::uint64_t off, const disk::block_header& head) -> result<void> {
        // Every block whose header checks out is stepped over whole, complete or not: its
        // writer reserved all of it, and nothing new may be written inside it.
        end = off + head.length;
        const std::uint64_t at = disk::make_location(s.number, off);
        if (head.kind == static_cast<std::uint16_t>(disk::block_kind::commit)) {
          auto judged = judge_commit(at, head);
          if (!judged) return std::unexpected(judged.error());
          if (judged->what == kind::torn && at < st.durable_below) judged->what = kind::damaged;
          switch (judged->what) {
            case kind::torn:
              // It never happened: voided (see replay_state::voids).
              st.must_void |= judged->blob_torn;
              return note_void(at);
            case kind::complete:
            case kind::damaged:
              break;
          }
          // It happened. Its records that check out are applied; a damaged one is noted, and
          // stands in the way unless a newer version of its key is found (rebuild). One at or
          // below the checkpoint's seq is in the copy already, damage and all.
          st.max_seq = std::max(st.max_seq, head.seq);
          const bool in_copy = head.seq <= st.checkpoint_seq;
          return each_record(
              bytes, s.number, off, head, salt,
              [&](std::uint64_t rec_at, const disk::record_view& rec) {
                st.unread.superseded(rec.head.prev);
                return apply_record(rec_at, rec, head.seq);
              },
              [&](std::uint64_t rec_at, std::uint64_t rec_end, std::uint32_t count) {
                return in_copy ? result<void>{} : note_unread(rec_at, rec_end, count);
              });
        }
        if (head.kind != static_cast<std::uint16_t>(disk::block_kind::relocation)) return {};
        // Records compaction moved, each with its own seq; a copy counts toward *visible*
        // even when its commit block is gone. A copy is synced before its original's segment
        // goes: one a power cut tore (or whose blob copy it tore) still has its original.
        if (!disk::check_block(bytes.subspan(off), salt) && at >= st.durable_below &&
            disk::has_unwritten_sector(bytes, off, head.length)) {
          return note_void(at);
        }
        return each_record(
            bytes, s.number, off, head, salt,
            [&](std::uint64_t rec_at, const disk::record_view& rec) -> result<void> {
              auto blob = value_of(found_record{rec_at, rec, nullptr}, true);
              if (!blob) {
                if (blob.error() == std::errc::no_such_file_or_directory) return {};
                if (blob.error() != errc::corrupt) return std::unexpected(blob.error());
                auto blob_seg = segment_at(disk::segment_of(rec.blob.location));
                if (!blob_seg) return std::unexpected(blob_seg.error());
                if (rec.blob.location >= st.durable_below &&
                    disk::has_unwritten_sector((*blob_seg)->bytes(),
                                               disk::offset_of(rec.blob.location),
                                               disk::blob_block_size(rec.head.value_length))) {
                  return note_void(at);  // torn: its original is still there
                }
              }
              st.unread.superseded(rec.head.prev);
              if (auto a = apply_record(rec_at, rec, rec.head.seq); !a) return a;
              st.max_seq = std::max(st.max_seq, rec.head.seq);
              return {};
            },
            // (A damaged copy's seq cannot be believed: never taken as in the checkpoint.)
            note_unread);
      },
      st.durable_below, unexplained, spanned);
}

result<void> store::impl::span_past_tail(std::uint64_t& tail, std::uint64_t tail_size,
                                         bool writable) noexcept {
  // Bytes past the last block found in the tail's segment: a writer (or a compactor, its
  // copies) killed before its block's header was written. Never a block (its header never
  // checked out; a relocation's originals are still there), so nothing reads them; but a
  // block written over them could not be sealed (its seq word was not zero), and every put
  // there failed with timed_out until the tail had passed them (31 in a row after a
  // compactor killed mid-copy). Spanned as a block keel left on purpose, and the tail goes
  // past them.
  if (tail == 0) return {};
  auto s = segment_at(disk::segment_of(tail));
  if (!s) return std::unexpected(s.error());
  const std::span<const std::byte> bytes = (*s)->bytes();
  const std::uint64_t off = disk::offset_of(tail);
  std::uint64_t last = std::min<std::uint64_t>(tail_size, bytes.size()) / 8 * 8;
  const auto zero_before = [&](std::uint64_t at) {
    std::uint64_t word = 0;
    std::memcpy(&word, bytes.data() + at - 8, 8);
    return word == 0;
  };
  while (last > off && zero_before(last))
    last -= 8;
  if (last <= off) return {};
  const std::uint64_t length = std::min<std::uint64_t>(
      std::max<std::uint64_t>(last - off, sizeof(disk::block_header)), tail_size - off);
  // Only where a header would be is all zero (a header never written), and by a writable
  // rebuild. Else the tail stays: bytes there that are not a header that checks out may be a
  // block whose header was damaged (kept for salvage), and stepping over them unspanned kept
  // every later close from recording anything past them as durable, so that damage there was
  // later taken for a torn write (found by review); a read-only rebuild writes nothing.
  const auto header_place =
      bytes.subspan(off, std::min<std::uint64_t>(length, sizeof(disk::block_header)));
  const bool unwritten =
      length >= sizeof(disk::block_header) &&
      std::ranges::all_of(header_place, [](std::byte b) { return b == std::byte{0}; });
  if (!writable || !unwritten) return {};
  disk::span_unwritten((*s)->map.bytes().subspan(off), length, salt);
  if (auto synced = (*s)->sync(); !synced) return synced;
  h64(header::dead_bytes).fetch_add(length);
  tail += length;
  return {};
}

result<void> store::impl::rebuild() noexcept {
  const bool writable = !opts.read_only;
  if (writable) remove_checkpoint_leftovers();
  auto checked = check_segments();
  if (!checked) return std::unexpected(checked.error());
  const std::vector<std::uint64_t>& numbers = checked->listed;

  // From the checkpoint, if there is one that checks out and whose replay start is still
  // there; else from the start of the log.
  if (auto r = reset_index(); !r) return r;
  std::uint64_t from = 0;
  replay_state st;
  auto m = read_manifest();
  if (!m) return std::unexpected(m.error());
  st.durable_below = m->durable_below;
  auto cp = load_checkpoint();
  if (!cp) return std::unexpected(cp.error());
  if (*cp &&
      ((*cp)->first == 0 || std::ranges::binary_search(numbers, disk::segment_of((*cp)->first)))) {
    std::tie(from, st.checkpoint_seq) = **cp;
    st.max_seq = st.checkpoint_seq;
  } else {
    // None, or one passed over after part of it was read in.
    if (auto r = reset_index(); !r) return r;
  }

  std::uint64_t tail = 0;
  std::uint64_t tail_size = 0;  // of the tail's segment
  replayed_bytes = 0;
  for (const std::uint64_t n : numbers) {
    auto s = segment_at(n);
    if (!s) return std::unexpected(s.error());
    segtab(n, 0).store(n);
    segtab(n, 1).store((*s)->size);
    if (from != 0 && n < disk::segment_of(from)) continue;  // in the checkpoint's copy
    // Every block the closes counted must still be there (else one was zeroed whole, and
    // what it held would read as space).
    if (auto c = check_sealed(**s, *m); !c) return c;
    const bool mid = from != 0 && n == disk::segment_of(from);
    std::uint64_t end = mid ? disk::offset_of(from) : disk::segment_header_size;
    replayed_bytes += (*s)->size - (mid ? std::min((*s)->size, end) : 0);
    if (auto r = replay_segment(**s, st, end); !r) return r;
    if (log_segment_size((*s)->size)) {
      // The space left at the end of the segment before is dead (as reserve counts it when
      // it moves on). The tail goes after the last block whose header checks out: nothing
      // past it was ever a block, and what is written there next is never inside one.
      if (tail != 0) h64(header::dead_bytes).fetch_add(tail_size - disk::offset_of(tail));
      tail = disk::make_location(n, end);
      tail_size = (*s)->size;
    }
  }

  // Damage that may hide a key's newest version: the store is refused (corrupt, naming it)
  // unless each such record was superseded (unread_records). Never an older version served
  // in its place.
  if (const std::uint64_t first = st.unread.first(); first != 0) {
    auto s = segment_at(disk::segment_of(first));
    if (!s) return std::unexpected(s.error());
    return std::unexpected(error(errc::corrupt).about((*s)->path, disk::offset_of(first)));
  }
  if (auto r = remove_leftovers(checked->unlisted, writable); !r) return r;
  h64(header::unvoided_torn).store(0);
  if (!st.voids.empty()) {
    if (!writable && st.must_void) {
      // Voiding writes: a read-only opener cannot recover this store (a writable open can).
      auto s = segment_at(disk::segment_of(st.voids.front()));
      return std::unexpected(error(errc::read_only)
                                 .about(s ? (*s)->path : keel::detail::shared_path{},
                                        disk::offset_of(st.voids.front())));
    }
    if (!writable) {
      // Left as they are: no close may record them as durable (seal_durable stops below the
      // first), and the next writable rebuild voids them.
      h64(header::unvoided_torn).store(*std::ranges::min_element(st.voids));
    } else {
      for (const std::uint64_t at : st.voids) {
        auto s = segment_at(disk::segment_of(at));
        if (!s) return std::unexpected(s.error());
        disk::void_torn_block((*s)->map.bytes().subspan(disk::offset_of(at)));
        if (auto synced = (*s)->sync(); !synced) return synced;
      }
    }
  }
  if (auto r = span_past_tail(tail, tail_size, writable); !r) return r;
  // Never a number handed out before, even one whose segment compaction removed: an old
  // commit's dead blob location would point into a stranger's bytes, and read as torn.
  // (The manifest as read says at least the highest listed plus one.)
  h64(header::next_segment).store(checked->numbered_below);
  if (auto r = reconcile_rooms(); !r) return std::unexpected(r.error());
  reconcile_checkpoint_bytes();
  h64(header::tail).store(tail);
  h64(header::visible).store(st.max_seq);
  h64(header::counting).store(st.max_seq);
  h64(header::next_seq).store(st.max_seq + 1);
  const auto& boot = io::self().boot_id;
  std::memcpy(base() + header::boot_id, boot.data(), 16);
  const std::uint64_t sum =
      disk::checksum(std::span<const std::byte>(base(), header::checksummed), salt);
  std::memcpy(base() + header::checksum, &sum, 8);
  h64(header::state).store(state_valid, std::memory_order_release);
  return {};
}

result<void> store::impl::apply_record(std::uint64_t location, const disk::record_view& r,
                                       std::uint64_t seq) noexcept {
  const disk::key_hash h = hash_of(r.key);
  for (;;) {
    const std::uint64_t page = table->page_of(h);
    auto found = find_locked(page, h, r.key);  // alone: nothing is pending
    if (!found) return std::unexpected(found.error());
    std::optional<index::entry_ref> e = *found;
    if (!e) e = table->claim(page, h, 0, 0);  // holds nothing until set below
    if (!e) {
      // Alone: no locks. A split that separates nothing gives the chain a page instead.
      const std::array<disk::key_hash, 1> coming{h};
      auto grown = table->split_separates(page, coming) ? table->split(page, *this)
                                                        : table->add_overflow(page, *this);
      if (!grown) return grown;
      continue;
    }
    const std::uint64_t old_at = e->location().load();
    const std::uint64_t old_seq = e->seq().load();
    if (old_at != 0 && old_seq >= seq) return {};  // a newer version is there already
    const std::uint64_t size = disk::stored_size(r);
    if (old_at != 0) {
      auto old = record_at(old_at, false);
      if (old && old->rec.head.op != static_cast<std::uint8_t>(disk::op::erase)) {
        const std::uint64_t old_size = disk::stored_size(old->rec);
        h64(header::live_records).fetch_sub(1);
        h64(header::live_bytes).fetch_sub(old_size);
        h64(header::dead_bytes).fetch_add(old_size);
      }
    }
    if (r.head.op == static_cast<std::uint8_t>(disk::op::erase)) {
      h64(header::dead_bytes).fetch_add(size);
    } else {
      h64(header::live_records).fetch_add(1);
      h64(header::live_bytes).fetch_add(size);
    }
    index::change_entry(table->page_holding(*e), *e, [&] {
      e->location().store(location);
      e->seq().store(seq);
    });
    return {};
  }
}

}  // namespace keel::kv
