// The manifest (doc/kv-format.md, "The manifest"): the store's own list of the segments it
// has, so that a segment deleted or lost outside the store is `corrupt`, naming it, never an
// older state served. Two slots in a file allocated whole when it is made: generation g lives
// in slot g % 2, a change writes generation g + 1 into the other slot and syncs it, and a
// reader takes the valid slot of the higher generation. So a change needs no new room (it
// works on a full volume) and a write a power cut tore leaves the slot before. Changed by
// whoever makes, takes or removes a segment, under the `segment` lock or alone.

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "kv/store_impl.hpp"

namespace keel::kv {
namespace {

constexpr const char* manifest_name = "manifest";

// Segments a manifest keeps room for beyond those it lists: of the most a full volume adds
// before a segment is made again (the deletes' room, the spare, the next segment compaction
// keeps, one made and abandoned), with one to spare.
constexpr std::uint64_t manifest_headroom = 5;

// A slot size the file may have: a page, doubled, up to the largest.
bool valid_slot(std::uint64_t slot) noexcept {
  return slot >= disk::manifest_min_slot && slot <= disk::manifest_max_slot &&
         (slot & (slot - 1)) == 0;
}

}  // namespace

result<disk::manifest> store::impl::read_manifest() noexcept {
  const std::string named = path + "/" + manifest_name;
  auto f = io::file_handle::open_at(dir.dir, manifest_name,
                                    io::open_flags::read | io::open_flags::no_follow);
  if (!f) {
    if (f.error() != std::errc::no_such_file_or_directory) {
      return std::unexpected(f.error().about(named));
    }
    // None: a store that never made a segment has none yet. A store with segments and no
    // manifest lost it: what it should hold cannot be known.
    auto present = segment_numbers(false);
    if (!present) return std::unexpected(present.error());
    if (!present->empty()) return std::unexpected(error(errc::corrupt).about(named));
    return disk::manifest{};
  }
  auto size = f->size();
  if (!size) return std::unexpected(size.error().about(named));
  const auto file_size = static_cast<std::uint64_t>(*size);
  const std::uint64_t slot_bytes = file_size / 2;
  if (file_size % 2 != 0 || !valid_slot(slot_bytes)) {
    return std::unexpected(error(errc::corrupt).about(named, file_size));
  }
  std::vector<std::byte> bytes;
  try {
    bytes.resize(file_size);
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  auto n = f->read_at(0, bytes);
  if (!n) return std::unexpected(n.error().about(named));
  if (*n != bytes.size()) return std::unexpected(error(errc::corrupt).about(named, *n));
  // Slot 0 blank is generation 0, listing nothing: the file as made, before its first
  // change (generation 1, in slot 1) was written, or while a power cut or a failed write tore
  // that change. Slot 1 blank is no generation: generation 2 and later go to slot 0 only
  // after generation 1 went to slot 1.
  const auto blank = [&](std::uint64_t slot) {
    const auto head =
        std::span<const std::byte>(bytes).subspan(slot * slot_bytes, sizeof(base::format_header));
    return std::ranges::all_of(head, [](std::byte b) { return b == std::byte{0}; });
  };
  std::optional<disk::manifest> current;
  if (blank(0)) {
    current.emplace();
    current->slot_size = slot_bytes;
  }
  error why;
  bool older = false;
  for (std::uint64_t slot = 0; slot < 2; ++slot) {
    if (slot == 0 && current) continue;
    auto m = disk::parse_manifest(
        std::span<const std::byte>(bytes).subspan(slot * slot_bytes, slot_bytes), dir.params.id,
        salt);
    if (!m) {
      if (!why) why = m.error().about(named, slot * slot_bytes);
      continue;
    }
    m->slot_size = slot_bytes;
    if (m->version < disk::manifest_format.version) older = true;
    if (m->generation % 2 != slot) continue;  // not where that generation is written
    if (!current || m->generation > current->generation) current = std::move(*m);
  }
  if (!current) return std::unexpected(why ? why : error(errc::corrupt).about(named));
  current->older_slot = older;
  // Every number up to the highest listed was handed out (all a version 2 slot says): so the
  // changes made of this reading, removing that one too, keep it handed out.
  if (!current->entries.empty()) {
    current->numbered_below = std::max(current->numbered_below, current->entries.back().number + 1);
  }
  return std::move(*current);
}

result<std::vector<disk::manifest_entry>> store::impl::listed_segments() noexcept {
  auto m = read_manifest();
  if (!m) return std::unexpected(m.error());
  return std::move(m->entries);
}

result<void> store::impl::ensure_manifest() noexcept {
  const std::string named = path + "/" + manifest_name;
  auto st = fs->stat_at(&dir.dir, manifest_name, false);
  if (st) return {};
  if (st.error() != std::errc::no_such_file_or_directory) {
    return std::unexpected(st.error().about(named));
  }
  // Made whole (both slots allocated, zero), synced, then named, like a segment: before the
  // first segment, so that a store with segments and no manifest is one that lost it.
  auto t = io::make_temp_file(dir.dir, ".manifest.", io::open_flags::read_write, 0644);
  if (!t) return std::unexpected(t.error().about(named));
  auto r = allocate_in(t->file, 0, static_cast<off_t>(2 * disk::manifest_min_slot));
  if (r) r = t->file.sync_data();
  if (r) {
    r = t->link_as(dir.dir, manifest_name);
    if (!r && r.error() == std::errc::file_exists) r = {};  // another's, made meanwhile
  }
  (void)t->remove_name(dir.dir);
  if (r) r = dir.dir.sync_all();
  if (!r) return std::unexpected(r.error().about(named));
  return {};
}

result<void> store::impl::write_manifest(const disk::manifest& m) noexcept {
  const std::string named = path + "/" + manifest_name;
  if (m.entries.size() > disk::max_segments) return errc_error(std::errc::file_too_large);
  // A change made whose durability is not known: reported as any failed sync is, never
  // retried, and the store is read-only until reopened alone (writable).
  const auto made_unsynced = [&](const error& e) {
    h64(header::sync_error_segment).store(0);
    h64(header::sync_error).store(static_cast<std::uint64_t>(e.value()));
    failed.store(true);
  };
  try {
    disk::manifest next;
    next.generation = m.generation + 1;
    next.durable_below = m.durable_below;
    next.numbered_below = m.numbered_below;
    next.entries = m.entries;
    const auto bytes = disk::encode_manifest(dir.params.id, next, salt);
    const std::uint64_t slot = next.generation % 2;
    const std::uint64_t count = next.entries.size();
    const bool fits = m.slot_size != 0 && count <= disk::manifest_capacity(m.slot_size);
    // Slots with room for fewer than manifest_headroom segments more grow while this change
    // may take room (a put's new segment): the segments a full volume's erases and
    // compaction take (the deletes' room, the spare, the next one kept) then fit in place.
    const bool grow = !fits || (count + manifest_headroom > disk::manifest_capacity(m.slot_size) &&
                                m.slot_size < disk::manifest_max_slot);
    if (grow) {
      // A new file of slots twice as large (or more), replaced whole.
      std::uint64_t slot_bytes = std::max(m.slot_size, disk::manifest_min_slot);
      while (disk::manifest_capacity(slot_bytes) < count + manifest_headroom &&
             slot_bytes < disk::manifest_max_slot)
        slot_bytes *= 2;
      std::vector<std::byte> file(2 * slot_bytes);
      std::memcpy(file.data() + slot * slot_bytes, bytes.data(), bytes.size());
      io::replace_options ro;
      ro.fs = fs;
      auto r = io::atomic_replace(named.c_str(), file, ro);
      if (r) return {};
      // Only the sync of the directory comes after the rename: the size tells whether the
      // new file is in place (manifest changes are all made under the `segment` lock).
      auto st = fs->stat_at(&dir.dir, manifest_name, false);
      if (st && st->size == file.size()) {
        // In place, so the change is made (a caller that undid what it listed would leave
        // the manifest naming a segment that is gone); whether the rename survives a power
        // cut is not known.
        made_unsynced(r.error());
        return {};
      }
      // Early, and refused for room: in place after all, into the file as it was.
      if (!fits || !out_of_room(r.error()) || !st || st->size != 2 * m.slot_size) {
        return std::unexpected(r.error().about(named));
      }
    }
    // In place, into the slot not in use: no new room, and a torn write spares the other.
    auto f = io::file_handle::open_at(dir.dir, manifest_name,
                                      io::open_flags::read_write | io::open_flags::no_follow);
    if (!f) return std::unexpected(f.error().about(named));
    const auto at = static_cast<off_t>(slot * m.slot_size);
    auto r = f->write_at(at, bytes);
    if (r) r = f->sync_data();
    if (!r) return std::unexpected(r.error().about(named, static_cast<std::uint64_t>(at)));
    if (m.older_slot) {
      // The other slot, still version 2, gets the change too (the next generation): keel
      // before version 3 then refuses the store (unsupported_version) instead of falling back
      // on it and finding segments since removed gone (`corrupt`, naming one). The change is
      // made already: a failure here makes it one whose durability is not known.
      next.generation += 1;
      const auto again = disk::encode_manifest(dir.params.id, next, salt);
      const auto other = static_cast<off_t>((1 - slot) * m.slot_size);
      auto w = f->write_at(other, again);
      if (w) w = f->sync_data();
      if (!w) made_unsynced(w.error());
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return {};
}

result<void> store::impl::finish_manifest_upgrade() noexcept {
  // A version 2 slot beside a current version 3 one: a user was killed between the two
  // writes of the first change (write_manifest). Written over now, or keel before version 3
  // would fall back on it, and find segments since removed gone (`corrupt`). A store whose
  // slots are all version 2 stays so until it changes.
  auto m = read_manifest();
  if (!m) return std::unexpected(m.error());
  if (!m->older_slot || m->version < disk::manifest_format.version) return {};
  return write_manifest(*m);
}

result<void> store::impl::list_segment(std::uint64_t number, std::uint64_t size) noexcept {
  auto m = read_manifest();
  if (!m) return std::unexpected(m.error());
  try {
    auto at = std::ranges::lower_bound(m->entries, number, {}, &disk::manifest_entry::number);
    if (at != m->entries.end() && at->number == number) {
      at->size = size;
    } else {
      m->entries.insert(at, disk::manifest_entry{number, size, 0});
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return write_manifest(*m);
}

result<void> store::impl::unlist_segments(const std::set<std::uint64_t>& numbers) noexcept {
  auto m = read_manifest();
  if (!m) return std::unexpected(m.error());
  std::erase_if(m->entries,
                [&](const disk::manifest_entry& e) { return numbers.contains(e.number); });
  return write_manifest(*m);
}

result<void> store::impl::seal_durable() noexcept {
  // Alone (the caller holds the open byte exclusively): nobody writes meanwhile, so a sync of
  // every segment in the table puts every block below the tail on stable storage.
  for (std::uint64_t i = 0; i < segtab_entries; ++i) {
    const std::uint64_t n = segtab(i, 0).load();
    if (n == 0 || n % segtab_entries != i) continue;
    auto seg = segment_at(n);
    if (!seg) return std::unexpected(seg.error());
    if (auto r = (*seg)->sync(); !r) return r;
  }
  auto m = read_manifest();
  if (!m) return std::unexpected(m.error());
  std::uint64_t tail = h64(header::tail).load();
  if (const std::uint64_t torn = h64(header::unvoided_torn).load(); torn != 0) {
    tail = std::min(tail, torn);
  }
  if (m->slot_size == 0 || tail <= m->durable_below) return {};  // nothing new to say
  // Only as far as a rebuild's walk would find every byte explained (blocks, zeros, blocks
  // keel left on purpose): whatever else lies there (a dead writer's block nobody could
  // bury, what a rebuild stepped over past its tail, damage) is not claimed durable, as a
  // rebuild would take it for damage then. Each close walks only what is new since.
  // Each segment's blocks below the new mark are counted into its entry (the walk from the
  // old mark adds to what earlier closes counted): a later walk that finds fewer finds a
  // block damaged past recognition (zeroed whole), never space nobody wrote. The mark stops
  // at the end of the last block the walk explains, never inside a block.
  const std::uint64_t from = m->durable_below;
  std::vector<segment*> buried;
  for (disk::manifest_entry& e : m->entries) {
    const std::uint64_t n = e.number;
    if (n < disk::segment_of(from)) continue;
    if (n > disk::segment_of(tail)) break;
    auto seg = segment_at(n);
    if (!seg) return std::unexpected(seg.error());
    segment& sg = **seg;
    std::uint64_t start = n == disk::segment_of(from) ? disk::offset_of(from) : 0;
    std::uint64_t odd = 0;
    for (;;) {
      std::uint64_t last_end = std::max<std::uint64_t>(start, disk::segment_header_size);
      std::uint64_t odd_off = 0;
      (void)for_each_block(
          sg, start,
          [&](std::uint64_t off, const disk::block_header& head) -> result<void> {
            if (disk::make_location(n, off) >= tail) return keel_error(errc::corrupt);  // done
            ++e.sealed_blocks;
            last_end = off + head.length;
            return {};
          },
          ~std::uint64_t{0},
          [&](std::uint64_t off, std::uint64_t) -> result<void> {
            odd_off = off;
            return keel_error(errc::corrupt);  // stops the walk
          },
          [&](std::uint64_t off, std::uint64_t length) -> result<void> {
            last_end = off + length;
            return {};
          });
      if (odd_off == 0 || disk::make_location(n, odd_off) >= tail) break;
      // Alone, nobody writes: a block whose header was never written is a dead writer's (a
      // blob it wrote value first, or a commit block it was filling): buried, as the one who
      // clears a dead writer's slot buries its commit block, and the walk goes on past it.
      if (bury_headerless(sg, last_end, odd_off, tail)) {
        if (buried.empty() || buried.back() != &sg) buried.push_back(&sg);
        start = last_end;
        continue;
      }
      odd = disk::make_location(n, last_end);
      break;
    }
    if (odd != 0) {
      tail = std::min(tail, odd);
      break;
    }
  }
  for (segment* sg : buried) {
    if (auto r = sg->sync(); !r) return r;
  }
  if (tail <= m->durable_below) return {};
  m->durable_below = tail;
  return write_manifest(*m);
}

bool store::impl::bury_headerless(segment& s, std::uint64_t at, std::uint64_t odd,
                                  std::uint64_t tail) noexcept {
  // [at, odd) is zeros (the walk stepped over it): a header never written there is 48 zero
  // bytes before the first that is not. Anything else (bytes of a header, damaged) stays,
  // and the mark stops before it.
  if (odd < at + sizeof(disk::block_header)) return false;
  const std::uint64_t limit = s.number == disk::segment_of(tail)
                                  ? disk::offset_of(tail)
                                  : static_cast<std::uint64_t>(s.size);
  // Up to the next block (or block keel left on purpose), or the end of the written space.
  std::uint64_t next = limit;
  const auto found = [&](std::uint64_t off, std::uint64_t) -> result<void> {
    next = std::min(next, off);
    return keel_error(errc::corrupt);  // stops the walk
  };
  (void)for_each_block(
      s, odd + 8,
      [&](std::uint64_t off, const disk::block_header& head) { return found(off, head.length); }, 0,
      [](std::uint64_t, std::uint64_t) { return result<void>{}; }, found);
  if (next <= at) return false;
  // A block an index entry names was whole once (its commit published): its header was
  // damaged since, and burying it would make that for good. It stays, and the mark stops.
  const location_range space[] = {
      {disk::make_location(s.number, at), disk::make_location(s.number, next)}};
  if (auto named = index_names(space, false); !named || *named) return false;
  // Where the volume may refuse the pages (btrfs at a qgroup's limit), asked for first, and
  // buried escapably: refused, it stays, as when this closer is killed here.
  if (!segment_write_ready(space[0].from, next - at, false)) return false;
  bool buried = false;
  if (!store_or_refuse([&] {
        buried = disk::bury_block(s.map.bytes().subspan(at, next - at), next - at, salt);
      })) {
    return false;
  }
  return buried;
}

store::impl::sealed_census store::impl::count_sealed(const segment& s,
                                                     std::uint64_t below) const noexcept {
  sealed_census c;
  if (s.number > disk::segment_of(below)) return c;
  const std::uint64_t end =
      s.number == disk::segment_of(below) ? disk::offset_of(below) : ~std::uint64_t{0};
  std::uint64_t last_end = disk::segment_header_size;
  const auto next = [&](std::uint64_t off, std::uint64_t length) -> result<void> {
    if (off >= end) return keel_error(errc::corrupt);  // done
    if (off > last_end && c.gap == 0) c.gap = last_end;
    last_end = off + length;
    return {};
  };
  (void)for_each_block(
      s, disk::segment_header_size,
      [&](std::uint64_t off, const disk::block_header& head) -> result<void> {
        auto r = next(off, head.length);
        if (r) ++c.blocks;
        return r;
      },
      0, [](std::uint64_t, std::uint64_t) { return result<void>{}; }, next);
  if (c.gap == 0) c.gap = last_end;
  return c;
}

result<void> store::impl::check_sealed(const segment& s, const disk::manifest& m) const noexcept {
  const auto e = std::ranges::lower_bound(m.entries, s.number, {}, &disk::manifest_entry::number);
  if (e == m.entries.end() || e->number != s.number || e->sealed_blocks == 0) return {};
  const sealed_census c = count_sealed(s, m.durable_below);
  if (c.blocks >= e->sealed_blocks) return {};
  return std::unexpected(error(errc::corrupt).about(s.path, c.gap));
}

}  // namespace keel::kv
