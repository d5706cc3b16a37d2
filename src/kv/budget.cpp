// What the store may still take (doc/kv-format.md, "Space"): the budget (options::max_bytes,
// counted as the files take the volume, the rooms made or still to make), the volume's free
// space less what puts leave to others, and the room a put, a compaction or the index needs.
// Reads only: what it counts, other parts own.

#include <algorithm>

#include "kv/store_impl.hpp"

namespace keel::kv {

std::uint64_t store::impl::budget_used(room_for who) const noexcept {
  const std::uint64_t seg_size = next_segment_size();
  std::uint64_t total =
      h64(header::pages_allocated).load() * disk::page_size + segments_in_table().allocated;
  // The checkpoint counts as written (a commit that finds the budget reached with nothing
  // dead to compact removes it).
  total += h64(header::checkpoint_bytes).load();
  // The spare counts, made or still to make (a commit makes it first); so does the deletes'
  // room, made, or for a put still to make.
  const std::uint64_t spare = h64(header::spare).load();
  total += spare != 0 || who == room_for::compaction ? spare : seg_size;
  const std::uint64_t deletes = h64(header::deletes_room).load();
  total += deletes != 0 || who != room_for::put ? deletes : seg_size;
  // The store's other files as they take the volume (the store file, the manifest, the lock
  // files, the two directories): small, but a budget that left them out was passed by them.
  for (const auto& [in, name] : {std::pair{&dir.dir, store_file_name},
                                 {&dir.dir, "manifest"},
                                 {&dir.dir, "lock"},
                                 {&dir.dir, "lock.fallback"},
                                 {&dir.dir, "."},
                                 {&dir.segments, "."}}) {
    if (auto st = fs->stat_at(in, name, false)) total += st->allocated;
  }
  return total;
}

std::uint64_t store::impl::budget_left(room_for who) const noexcept {
  if (opts.max_bytes == 0) return UINT64_MAX;
  const std::uint64_t total = budget_used(who);
  return total >= opts.max_bytes ? 0 : opts.max_bytes - total;
}

std::uint64_t store::impl::room_left(room_for who) const noexcept {
  const std::uint64_t seg_size = next_segment_size();
  const std::uint64_t tail = h64(header::tail).load();
  const std::uint64_t left = budget_left(who);
  // The segment made and never moved into (its maker's commit failed, or it was killed) is
  // the next one whoever asks, and is counted as used: its room is left too (without it, at
  // a budget of four fixed segments, every commit with a blob was refused for good).
  const std::uint64_t last = abandoned_segment();
  return (tail == 0 ? 0 : log_segment_size_at(tail) - disk::offset_of(tail)) +
         (last == 0 ? 0 : segtab(last, 1).load() - disk::segment_header_size) +
         (left == UINT64_MAX ? UINT64_MAX / 2 : left / seg_size * seg_size);
}

std::uint64_t store::impl::compaction_room() const noexcept {
  const std::uint64_t fixed = compacting.segment_size.load(std::memory_order_relaxed);
  const std::uint64_t seg_size = fixed != 0 ? fixed : next_segment_size();
  const std::uint64_t tail = h64(header::tail).load();
  std::uint64_t whole = budget_left(room_for::compaction) / seg_size;
  // The volume's free space (what an unprivileged user may take: the least it may be).
  auto free = fs->statfs(dir.segments);
  whole = std::min(whole, free ? free->available_bytes / seg_size : 0);
  // Each new segment, the spare too, begins with its header; so does one made and abandoned
  // (the next writer that needs a segment takes it).
  // (The abandoned one at its own size: a victim kept as the next segment keeps its size.)
  const std::uint64_t spare = h64(header::spare).load();
  const std::uint64_t last = abandoned_segment();
  return (tail == 0 ? 0 : log_segment_size_at(tail) - disk::offset_of(tail)) +
         (spare == 0 ? 0 : spare - disk::segment_header_size) +
         (last == 0 ? 0 : segtab(last, 1).load() - disk::segment_header_size) +
         whole * (seg_size - disk::segment_header_size);
}

bool store::impl::short_of_room() const noexcept {
  const std::uint64_t seg_size = next_segment_size();
  const std::uint64_t need = put_needs(seg_size);
  if (!check_budget(need, room_for::put)) return true;
  // A spare still to make needs its room too.
  const std::uint64_t spare = h64(header::spare).load() == 0 ? seg_size : 0;
  return !check_headroom(need + spare);
}

bool store::impl::could_put(std::uint64_t more) const noexcept {
  const std::uint64_t need = put_needs(more);
  return check_budget(need, room_for::put) && check_headroom(need);
}

std::uint64_t store::impl::put_needs(std::uint64_t more, bool blob) const noexcept {
  if (more == 0) return 0;
  // A blob's own segment holds one key: a page, if it splits one.
  const std::uint64_t pages = blob ? 1 : index_pages_for(more);
  return more + pages * disk::page_size + index_headroom();
}

std::uint64_t keys_in_segment(std::uint64_t size, std::uint64_t mean) noexcept {
  // A put's own block: its header and a record, at least a header and an 8-byte key.
  constexpr std::uint64_t least_record = sizeof(disk::record_header) + 8;
  return size / (sizeof(disk::block_header) + std::max(least_record, mean));
}

std::uint64_t store::impl::index_pages_for(std::uint64_t size) const noexcept {
  const std::uint64_t records = h64(header::live_records).load(std::memory_order_relaxed);
  const std::uint64_t directory = h64(header::directory).load(std::memory_order_acquire);
  const auto at = static_cast<std::size_t>(std::countr_zero(size)) % 64;
  {
    base::lock_guard g(split_estimates_mutex);
    const split_estimate& kept = split_estimates[at];
    if (kept.size == size && kept.directory == directory && records >= kept.records &&
        records - kept.records <= kept.slack) {
      return kept.pages;
    }
  }
  // The live bytes count blobs too; a record in a log segment is at most a header, the
  // longest key and a value below the blob threshold.
  const std::uint64_t longest =
      sizeof(disk::record_header) + kv::max_key_size + dir.params.blob_threshold;
  const std::uint64_t mean =
      records == 0
          ? 1024
          : std::min(longest, h64(header::live_bytes).load(std::memory_order_relaxed) / records);
  // Made for a sixteenth more keys, it holds until that many more are live (or fewer: erased
  // keys split nothing), the directory unchanged.
  const std::uint64_t keys = keys_in_segment(size, mean);
  const std::uint64_t slack = keys / 16;
  const std::uint64_t pages = table->pages_for_keys(
      keys + slack, std::atomic_ref<const std::uint64_t>(
                        *reinterpret_cast<const std::uint64_t*>(base() + header::pages_used)));
  base::lock_guard g(split_estimates_mutex);
  split_estimates[at] = {size, records, directory, slack, pages};
  return pages;
}

std::uint64_t store::impl::index_headroom() const noexcept {
  const std::uint64_t doubling = index::directory_pages(table->depth() + 1);
  const std::uint64_t allocated = h64(header::pages_allocated).load(std::memory_order_relaxed);
  const std::uint64_t used = h64(header::pages_used).load(std::memory_order_relaxed);
  const std::uint64_t ahead = allocated > used ? allocated - used : 0;
  return doubling > ahead ? (doubling - ahead) * disk::page_size : 0;
}

result<void> store::impl::check_budget(std::uint64_t more, room_for who) const noexcept {
  // Not through budget_left, which stops at 0: a budget already passed (by the spare still
  // to make) must fail a check of nothing more too.
  if (opts.max_bytes != 0 && budget_used(who) + more > opts.max_bytes) {
    return keel_error(errc::budget_reached);
  }
  return {};
}

std::uint64_t store::impl::kept_free(const io::fs_info& free) const noexcept {
  // The deletes' room still to make needs its segment. And btrfs reserves data room for
  // every write fault on a map, a preallocated page's too (btrfs_page_mkwrite): on a volume
  // with none left, writes through the maps crawl from fault to fault, so puts leave it a
  // segment free as well.
  return has_room(deletes_room) && free.type != io::fs_type::btrfs ? 0 : next_segment_size();
}

result<void> store::impl::check_headroom(std::uint64_t more) const noexcept {
  // What an unprivileged user may take; a volume that cannot tell (statfs failed) is not
  // held back here (the allocation itself then says whether it is full).
  auto free = fs->statfs(dir.segments);
  if (free && free->available_bytes < more + kept_free(*free)) {
    return std::unexpected(
        error(std::make_error_code(std::errc::no_space_on_device)).about(path + "/seg"));
  }
  return {};
}

}  // namespace keel::kv
