// Checkpoints (doc/kv-format.md, "Checkpoints and recovery"): a copy of the index exactly as
// of one seq S, written beside the log while readers and writers go on, so that a rebuild
// after a power loss loads it and replays only the log written since: recovery time is
// bounded by the checkpoint interval, not by the store's size.

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <new>
#include <thread>
#include <vector>

#include "base/per_thread.hpp"

#include "kv/checkpoint_file.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {

using namespace checkpoint_file;

std::uint64_t store::impl::log_distance(std::uint64_t from, std::uint64_t to) const noexcept {
  if (to <= from) return 0;
  // The log segments there are between, at their sizes in the table (a blob's segment of
  // its own is not the log's). Segment numbers are not the log: compactions hand out new
  // ones for good, and counting every number past a few thousand read gigabytes of replay
  // where the log held a megabyte. Asked at every commit: summed once for each run of
  // segments (segment_sum_memo), by number, or from the table's entries (8064 at most) where
  // the run's numbers are more.
  const std::uint64_t first = disk::segment_of(from), last = disk::segment_of(to);
  const segment_sum_memo::key k{first, last,
                                h64(header::compactions).load(std::memory_order_relaxed)};
  std::uint64_t d = 0;
  if (const auto kept = segment_sums.find(k)) {
    d = *kept;
  } else {
    // (Before the first, none yet: a segment's worth, so that a store's first checkpoint
    // comes early.)
    if (first == 0) {
      d = dir.params.first_segment_size != 0 ? dir.params.first_segment_size
                                             : dir.params.segment_size;
    }
    const auto add = [&](std::uint64_t n) {
      const std::uint64_t size = segtab(n, 0).load() == n ? segtab(n, 1).load() : 0;
      if (log_segment_size(size)) d += size;
    };
    if (last - first <= segtab_entries) {
      // By number (most runs are a few segments long).
      for (std::uint64_t n = std::max<std::uint64_t>(first, 1); n < last; ++n)
        add(n);
    } else {
      // By the table's entries, each segment's number in its own.
      for (std::uint64_t i = 0; i < segtab_entries; ++i) {
        const std::uint64_t n = segtab(i, 0).load();
        if (n != 0 && n % segtab_entries == i && n >= first && n < last) add(n);
      }
    }
    segment_sums.keep(k, d);
  }
  return d + disk::offset_of(to) - std::min(d + disk::offset_of(to), disk::offset_of(from));
}

result<void> store::impl::room_for_checkpoint(bool asked) const noexcept {
  const std::uint64_t copy = h64(header::pages_used).load() * disk::page_size;
  // Under a budget, the store's files on the device stay inside it: the checkpoint too (the
  // one there is counted until the new one replaces it), one asked for as well.
  if (opts.max_bytes != 0 && budget_used(room_for::compaction) + copy > opts.max_bytes) {
    return keel_error(errc::budget_reached);
  }
  if (asked) return {};
  auto free = fs->statfs(dir.segments);
  if (free && free->available_bytes < copy + 2 * next_segment_size()) {
    return std::unexpected(
        error(std::make_error_code(std::errc::no_space_on_device)).about(path + "/checkpoint"));
  }
  return {};
}

result<std::optional<std::pair<std::uint64_t, std::uint64_t>>>
store::impl::load_checkpoint() noexcept {
  using loaded = std::optional<std::pair<std::uint64_t, std::uint64_t>>;
  // Any checkpoint that cannot be read or does not check out is passed over: the log alone
  // rebuilds the index (the checkpoint only shortens that).
  auto f = io::file_handle::open_at(dir.dir, checkpoint_name,
                                    io::open_flags::read | io::open_flags::no_follow);
  if (!f) return loaded{};
  auto size = f->size();
  if (!size) return loaded{};
  std::array<std::byte, disk::page_size> head{};
  const auto read_all = [&](off_t at, std::span<std::byte> into) {
    while (!into.empty()) {
      auto n = f->read_at(at, into);
      if (!n || *n == 0) return false;
      into = into.subspan(*n);
      at += static_cast<off_t>(*n);
    }
    return true;
  };
  if (*size < static_cast<off_t>(disk::page_size + 8) || !read_all(0, head)) return loaded{};
  auto h = base::check_header(head, checkpoint_format);
  if (!h || *h != base::header_state::ours) return loaded{};
  if (std::memcmp(head.data() + cp::store_id, dir.params.id.data(), 16) != 0) return loaded{};
  const std::uint64_t used = get64(head.data() + cp::pages_used);
  if (used <= first_free_page || used > index_window / disk::page_size) return loaded{};
  const std::uint64_t count = get64(head.data() + cp::segments);
  if (count > segtab_entries) return loaded{};
  const std::uint64_t list_pages = (count * 8 + disk::page_size - 1) / disk::page_size;
  const std::uint64_t pages = 1 + used - first_free_page + list_pages;
  if (static_cast<std::uint64_t>(*size) != pages * disk::page_size + 8) return loaded{};
  // Its pages go straight into the index, at their own numbers.
  if (used > h64(header::pages_allocated).load()) {
    // No room for it (the log alone needs less): passed over.
    if (!index_file.allocate(0, static_cast<off_t>(used * disk::page_size))) return loaded{};
    h64(header::pages_allocated).store(used);
  }
  const std::span<std::byte> into(base() + first_free_page * disk::page_size,
                                  (used - first_free_page) * disk::page_size);
  std::array<std::byte, 8> trailer{};
  std::vector<std::byte> list;
  try {
    list.resize(list_pages * disk::page_size);
  } catch (const std::bad_alloc&) {
    return loaded{};
  }
  const off_t list_at = static_cast<off_t>((1 + used - first_free_page) * disk::page_size);
  if (!read_all(static_cast<off_t>(disk::page_size), into) || !read_all(list_at, list) ||
      !read_all(static_cast<off_t>(pages * disk::page_size), trailer)) {
    return loaded{};
  }
  std::uint64_t sum = chain(0, 0, head, salt);
  for (std::uint64_t i = 1; i < 1 + used - first_free_page; ++i) {
    sum = chain(sum, i, into.subspan((i - 1) * disk::page_size, disk::page_size), salt);
  }
  for (std::uint64_t i = 0; i < list_pages; ++i) {
    sum =
        chain(sum, 1 + used - first_free_page + i,
              std::span<const std::byte>(list).subspan(i * disk::page_size, disk::page_size), salt);
  }
  if (sum != get64(trailer.data())) return loaded{};
  // Every segment there was must still be: the copy may name records in any of them (a
  // store that lost one to something else than compaction, which deletes the checkpoint
  // first, is rebuilt from its log).
  auto now = segment_numbers(false);
  if (!now) return loaded{};
  for (std::uint64_t i = 0; i < count; ++i) {
    if (!std::ranges::binary_search(*now, get64(list.data() + i * 8))) return loaded{};
  }
  // The directory must lie in the pages loaded, and name bucket pages there.
  const std::uint64_t word = get64(head.data() + cp::directory);
  const unsigned depth = static_cast<unsigned>(word & 0xff);
  const std::uint64_t first = word >> 8;
  if (depth > index::max_depth || first < first_free_page ||
      first + ((std::uint64_t{8} << depth) + disk::page_size - 1) / disk::page_size > used) {
    return loaded{};
  }
  for (std::uint64_t i = 0; i < (std::uint64_t{1} << depth); ++i) {
    const std::uint64_t p = get64(base() + first * disk::page_size + i * 8);
    if (p < first_free_page || p >= used || table->page(p).magic().load() != index::bucket_magic) {
      return loaded{};
    }
  }
  h64(header::directory).store(word);
  h64(header::pages_used).store(used);
  h64(header::live_records).store(get64(head.data() + cp::live_records));
  h64(header::live_bytes).store(get64(head.data() + cp::live_bytes));
  h64(header::dead_bytes).store(get64(head.data() + cp::dead_bytes));
  h64(header::retired_pages).store(get64(head.data() + cp::retired_pages));
  collect_free_pages();
  const std::uint64_t S = get64(head.data() + cp::seq);
  const std::uint64_t from = get64(head.data() + cp::from);
  h64(header::checkpoint_seq).store(S);
  h64(header::checkpoint_from).store(from);
  return loaded{std::pair{from, S}};
}

result<void> store::checkpoint() noexcept {
  impl& s = *impl_;
  if (auto held = impl_->hold_open_byte(); !held) return std::unexpected(held.error());
  if (s.opts.read_only) return keel_error(errc::read_only);
  const io::countdown cd = io::deadline(s.opts.lock_timeout).start();
  if (auto b = s.take_checkpoint_byte(cd, byte_claim::wait); !b) return std::unexpected(b.error());
  // (Its room on the volume is not asked for: it is written while the volume has it.)
  auto r = s.room_for_checkpoint(true);
  if (r) r = s.checkpoint_locked(cd);
  s.release_checkpoint_byte();
  return r;
}

result<void> store::impl::remove_checkpoint() noexcept {
  // With any copy a checkpointer killed before its rename left, which the word below may have
  // counted, and which nothing would count after it is zeroed.
  remove_checkpoint_temps();
  if (auto r = io::unlink_at(dir.dir, "checkpoint");
      !r && r.error() != std::errc::no_such_file_or_directory) {
    return std::unexpected(r.error().about(path + "/checkpoint"));
  }
  if (auto r = dir.dir.sync_all(); !r) return std::unexpected(r.error().about(path));
  // (Where the volume may refuse the header's page: an escape leaves words that name a
  // checkpoint no longer there, which is a missing checkpoint to every reader of them.)
  if (!stored_escapably(io::deadline(opts.lock_timeout).start(), [&] {
        h64(header::checkpoint_from).store(0);
        h64(header::checkpoint_seq).store(0);
        h64(header::checkpoint_bytes).store(0);
      })) {
    return std::unexpected(index_write_refusal());
  }
  return {};
}

result<bool> store::impl::drop_checkpoint_for_room(std::uint64_t seen_seq) noexcept {
  if (opts.read_only) return false;
  const io::countdown cd = io::deadline(opts.lock_timeout).start();
  if (auto b = take_checkpoint_byte(cd, byte_claim::wait); !b) return std::unexpected(b.error());
  const maintenance_hold held{this};
  auto st = fs->stat_at(&dir.dir, "checkpoint", false);
  if (!st) {
    if (st.error() != std::errc::no_such_file_or_directory) {
      return std::unexpected(st.error().about(path + "/checkpoint"));
    }
    // None here: worth a retry only if one was there when the put failed (another user
    // removed it meanwhile).
    return seen_seq != 0 && h64(header::checkpoint_seq).load() == 0;
  }
  const auto before = fs->statfs(dir.dir);
  if (auto r = remove_checkpoint(); !r) return std::unexpected(r.error());
  if (auto r = show_freed_room(before, st->size); !r) return std::unexpected(r.error());
  return true;
}

void store::impl::checkpoint_after_compaction(const io::countdown& cd) noexcept {
  const auto note_error = [&](const error& e) {
    (void)stored_escapably(
        cd, [&] { h64(header::checkpoint_error).store(static_cast<std::uint64_t>(e.value())); });
  };
  if (auto r = room_for_checkpoint(); !r) {
    note_error(r.error());
  } else if (auto w = checkpoint_locked(cd); !w) {
    note_error(w.error());
  }
}

void store::impl::reconcile_checkpoint_bytes() noexcept {
  h64(header::checkpoint_bytes).store(checkpoint_file_bytes());
}

std::uint64_t store::impl::checkpoint_file_bytes() const noexcept {
  auto st = fs->stat_at(&dir.dir, "checkpoint", false);
  return st ? st->size : 0;
}

}  // namespace keel::kv
