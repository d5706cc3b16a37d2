// The log's segments (doc/kv-format.md, "Segments"): their files (made whole, entered in the
// segment table, mapped), their numbers, and the sizes they are made at (segments that start
// small and grow with the log). Maps segments into the process's segment_map (segment_map.hpp)
// and enters segments in the segment table (compaction and recovery empty
// entries).

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "base/planted.hpp"
#include "io/map_guard.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {

std::string segment_name(std::uint64_t n) {
  char name[17];
  std::snprintf(name, sizeof name, "%016llx", static_cast<unsigned long long>(n));
  return name;
}

result<segment*> store::impl::segment_at(std::uint64_t number) noexcept {
  if (number == 0 || number > disk::max_segment_number) {
    return std::unexpected(error(errc::corrupt).about(path));
  }
  if (segment* s = mapped.find(number)) return s;
  const io::map_guard::no_escape held_back;  // no escape leaves the map's mutex held
  return mapped.find_or_map(number, [&]() -> result<std::unique_ptr<segment>> {
    if (segment_map_hook) segment_map_hook();
    const std::string name = segment_name(number);
    const bool writable = !opts.read_only;
    auto f = io::file_handle::open_at(
        dir.segments, name.c_str(),
        (writable ? io::open_flags::read_write : io::open_flags::read) | io::open_flags::no_follow);
    if (!f) return std::unexpected(f.error().about(path + "/seg/" + name));
    auto size = f->size();
    if (!size) return std::unexpected(size.error());
    if (static_cast<std::uint64_t>(*size) < disk::segment_header_size) {
      return std::unexpected(error(errc::corrupt).about(f->shared_path(), 0));
    }
    auto m =
        io::mapped_file::map(*f, writable ? io::map_access::read_write : io::map_access::read_only,
                             static_cast<std::size_t>(*size));
    if (!m) return std::unexpected(m.error().about(f->shared_path()));
    auto head = disk::parse_segment_header(m->bytes(), dir.params.id, number, salt);
    if (!head) return std::unexpected(head.error().about(f->shared_path()));
    if (head->size != static_cast<std::uint64_t>(*size)) {
      // Cut short or grown by something not keel: where the file and its header part ways.
      return std::unexpected(
          error(errc::corrupt)
              .about(f->shared_path(),
                     std::min<std::uint64_t>(head->size, static_cast<std::uint64_t>(*size))));
    }
    std::unique_ptr<segment> s(new (std::nothrow) segment());
    if (!s) return errc_error(std::errc::not_enough_memory);
    s->number = number;
    s->size = head->size;
    s->path = f->shared_path();
    s->map = std::move(*m);
    (void)f->close();  // the map stays; so does no descriptor
    return s;
  });
}

result<std::uint64_t> store::impl::new_segment_number() noexcept {
  // A number whose segment table entry no live segment holds (compaction leaves live
  // segments far apart in numbers; two must never share an entry).
  std::uint64_t number = h64(header::next_segment).load();
  for (std::size_t skipped = 0;; ++number, ++skipped) {
    if (skipped >= segtab_entries) return errc_error(std::errc::file_too_large);
    const std::uint64_t holder = segtab(number, 0).load();
    if (holder == 0 || holder == number) break;
  }
  if (number > disk::max_segment_number) return errc_error(std::errc::file_too_large);
  // (A maker that dies leaves a gap, no harm; so does one refused here.)
  if (auto r = store_or_refuse([&] { h64(header::next_segment).store(number + 1); }); !r) {
    return std::unexpected(r.error());
  }
  return number;
}

result<void> store::impl::make_whole_file(const char* name, std::uint64_t size,
                                          std::span<const std::byte> head) noexcept {
  // Allocated whole, `head` written and synced, then named: a named file is always whole.
  auto t = io::make_temp_file(dir.segments, segment_temp_prefix, io::open_flags::read_write, 0644);
  if (!t) return std::unexpected(t.error());
  auto r = allocate_in(t->file, 0, static_cast<off_t>(size));
  if (r && !head.empty()) r = t->file.write_at(0, head);
  if (r) r = t->file.sync_data();
  if (r) r = t->link_as(dir.segments, name);
  (void)t->remove_name(dir.segments);
  return r;
}

result<void> store::impl::allocate_in(const io::file_handle& file, off_t offset,
                                      off_t length) const noexcept {
  auto r = file.allocate(offset, length);
  if (r || r.error() != std::errc::no_space_on_device) return r;
  // btrfs reserves metadata room for every dirty range of a file, and a shared map dirtied
  // all over (the index) under many writers can take so much that it refuses an allocation
  // with the volume far from full; a sync writes those ranges out and frees what they held.
  // Once only: what still fails is full.
  auto free = fs->statfs(file);
  if (!free || free->available_bytes < static_cast<std::uint64_t>(length)) return r;
  if (auto s = file.sync_filesystem(); !s) return s;
  return file.allocate(offset, length);
}

result<void> store::impl::enter_segment(std::uint64_t number, std::uint64_t size) noexcept {
  // The number last: a reader of the table (budget_left) never pairs it with another's size.
  return store_or_refuse([&] {
    segtab(number, 1).store(size);
    segtab(number, 2).store(0);
    segtab(number, 3).store(0);  // reserved
    segtab(number, 0).store(number);
  });
}

result<std::uint64_t> store::impl::make_segment(std::uint64_t size) noexcept {
  // Under the `segment` lock (or alone): one maker at a time.
  if (auto m = ensure_manifest(); !m) return std::unexpected(m.error());
  auto picked = new_segment_number();
  if (!picked) return picked;
  const std::uint64_t number = *picked;
  const std::string name = segment_name(number);
  const auto head = disk::encode_segment_header({dir.params.id, number, size}, salt);
  if (auto r = make_whole_file(name.c_str(), size, head); !r) {
    // Named as the segment being made (the unnamed file's own path says only "seg/.").
    return std::unexpected(error(r.error().code()).about(path + "/seg/" + name));
  }
  if (auto d = dir.segments.sync_all(); !d) return std::unexpected(d.error().about(path + "/seg"));
  // Listed once its name is durable, before anything is written into it: a listed segment
  // that is missing is damage, never a maker's leftover.
  if (auto l = list_segment(number, size);
      !l && !base::is_planted(base::planted_bug::kv_ignores_failed_manifest_write)) {
    (void)io::unlink_at(dir.segments, name.c_str());  // unlisted: nobody's
    return std::unexpected(l.error());
  }
  if (auto e = enter_segment(number, size); !e) return std::unexpected(e.error());
  return number;
}

std::vector<std::uint64_t> store::impl::table_segment_numbers() const {
  std::vector<std::uint64_t> out;
  for (std::uint64_t i = 0; i < segtab_entries; ++i) {
    const std::uint64_t n = segtab(i, 0).load();
    if (n != 0 && n % segtab_entries == i) out.push_back(n);
  }
  std::ranges::sort(out);
  return out;
}

store::impl::table_segments store::impl::segments_in_table() const noexcept {
  table_segments t;
  for (std::uint64_t i = 0; i < segtab_entries; ++i) {
    const std::uint64_t n = segtab(i, 0).load();
    if (n != 0 && n % segtab_entries == i) {
      t.count += 1;
      t.bytes += segtab(n, 1).load();
      // (A blob's segment of its own is header and blob long, not a whole number of pages:
      // the volume allocates the last page whole.)
      t.allocated +=
          (segtab(n, 1).load() + disk::page_size - 1) / disk::page_size * disk::page_size;
    }
  }
  return t;
}

bool store::impl::log_segment_size(std::uint64_t size) const noexcept {
  const std::uint64_t most = dir.params.segment_size;
  const std::uint64_t first = dir.params.first_segment_size;
  if (first == 0) return size == most;
  return size >= first && size <= most && (size & (size - 1)) == 0;
}

std::uint64_t store::impl::next_segment_size(std::uint64_t at_least) const noexcept {
  const std::uint64_t most = dir.params.segment_size;
  std::uint64_t size = dir.params.first_segment_size;
  if (size == 0) return most;
  // A sixteenth of what the log holds, live and dead (the counters: asked at every commit):
  // what the rooms and the tail's unwritten rest hold back stays a small part of a store of
  // any size, and a large store has few segments. And past the first size, a 256th of what
  // the store could ever take (room_scale), so that on a small volume the spare stays a
  // small part of it when full.
  const std::uint64_t log = h64(header::live_bytes).load(std::memory_order_relaxed) +
                            h64(header::dead_bytes).load(std::memory_order_relaxed);
  while (size < most && size * 2 <= log / 16 && size * 2 <= room_scale / 256)
    size *= 2;
  return std::max(size, least_segment_size(at_least));
}

std::uint64_t store::impl::log_segment_size_at(std::uint64_t location) const noexcept {
  const std::uint64_t n = disk::segment_of(location);
  if (n != 0 && segtab(n, 0).load() == n) return segtab(n, 1).load();
  const std::uint64_t first = dir.params.first_segment_size;
  return first != 0 ? first : dir.params.segment_size;
}

std::uint64_t store::impl::least_segment_size(std::uint64_t bytes) const noexcept {
  const std::uint64_t most = dir.params.segment_size;
  std::uint64_t size = dir.params.first_segment_size;
  if (size == 0) return most;
  while (size < most && size < bytes)
    size *= 2;
  return size;
}

std::uint64_t store::impl::largest_log_segment(
    std::span<const std::uint64_t> except) const noexcept {
  std::uint64_t largest = 0;
  for (std::uint64_t i = 0; i < segtab_entries; ++i) {
    const std::uint64_t n = segtab(i, 0).load();
    if (n == 0 || n % segtab_entries != i || std::ranges::find(except, n) != except.end()) continue;
    const std::uint64_t size = segtab(n, 1).load();
    if (log_segment_size(size)) largest = std::max(largest, size);
  }
  return largest;
}

void store::impl::prefault(std::uint64_t segment, std::uint64_t offset,
                           std::uint64_t length) noexcept {
  if (auto s = segment_at(segment)) (*s)->populate(offset, length);
}

result<std::span<std::byte>> store::impl::bytes_at(std::uint64_t location) noexcept {
  auto s = segment_at(disk::segment_of(location));
  if (!s) return std::unexpected(s.error());
  const std::uint64_t off = disk::offset_of(location);
  if (off < disk::segment_header_size || off >= (*s)->size) {
    return std::unexpected(error(errc::corrupt).about((*s)->path, off));
  }
  return (*s)->map.bytes().subspan(off);
}

}  // namespace keel::kv
