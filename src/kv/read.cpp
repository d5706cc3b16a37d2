// Reading: records, values, snapshot lookups, scans and stats (doc/kv-format.md,
// "Reading at a snapshot", "Scanning").

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>

#include "kv/store_impl.hpp"

namespace keel::kv {

namespace {

// record_at's part before the parse: `parse(bytes)` reads the record at the start of `bytes`,
// the rest of its segment.
template <class Parse>
result<found_record> read_record(store::impl& st, std::uint64_t location, Parse&& parse) {
  auto s = st.segment_at(disk::segment_of(location));
  if (!s) return std::unexpected(s.error());
  const std::uint64_t off = disk::offset_of(location);
  if (off < disk::segment_header_size + sizeof(disk::block_header) || off >= (*s)->size) {
    return std::unexpected(error(errc::corrupt).about((*s)->path, off));
  }
  auto r = parse((*s)->bytes().subspan(off));
  if (!r) return std::unexpected(r.error().about((*s)->path, off));
  return found_record{location, *r, *s};
}

}  // namespace

result<found_record> store::impl::record_at(std::uint64_t location, bool verify) noexcept {
  return read_record(*this, location, [&](std::span<const std::byte> b) {
    return disk::parse_record(b, salt, verify);
  });
}

result<found_record> store::impl::record_head_at(std::uint64_t location) noexcept {
  return read_record(*this, location,
                     [](std::span<const std::byte> b) { return disk::parse_record_head(b); });
}

result<std::span<const std::byte>> store::impl::value_of(const found_record& r,
                                                         bool verify) noexcept {
  if (!disk::is_blob(r.rec)) return r.rec.value;
  auto s = segment_at(disk::segment_of(r.rec.blob.location));
  if (!s) return std::unexpected(s.error());
  const std::uint64_t off = disk::offset_of(r.rec.blob.location);
  const auto bad = [&] { return std::unexpected(error(errc::corrupt).about((*s)->path, off)); };
  if (off < disk::segment_header_size || off >= (*s)->size) return bad();
  const auto bytes = (*s)->bytes().subspan(off);
  auto head = disk::parse_block_header(bytes, salt);
  if (!head || head->kind != static_cast<std::uint16_t>(disk::block_kind::blob) ||
      head->payload_checksum != r.rec.blob.checksum) {
    return bad();
  }
  const auto value = disk::blob_value(bytes, *head);
  if (value.size() != r.rec.head.value_length) return bad();
  if (verify && disk::checksum(value, salt) != head->payload_checksum) return bad();
  return value;
}

result<std::optional<disk::block_header>> store::impl::complete_block(
    std::uint64_t location) noexcept {
  using complete = std::optional<disk::block_header>;
  auto bytes = bytes_at(location);
  if (!bytes) return std::unexpected(bytes.error());
  // Never sealed (its writer is still at it, died, or was abandoned): not read further, as
  // its writer or whoever buries it (bury_unsealed) may be writing the rest.
  if (const std::uint64_t seq = disk::block_seq(*bytes); seq == 0 || seq == disk::void_seq) {
    return complete{};
  }
  auto head = disk::check_block(*bytes, salt);
  if (!head || head->kind != static_cast<std::uint16_t>(disk::block_kind::commit)) {
    return complete{};
  }
  // A commit is complete only with every blob it names (a `none` commit's blob may not have
  // reached the disk before a power cut when its commit block did). A blob whose segment is
  // gone was removed by a compaction, which removes only blobs no live record names: the
  // commit was complete (a replay that once found it incomplete voided it for good). A blob
  // that cannot be read for another reason (EMFILE, ENOMEM) is an error, never "incomplete".
  std::uint64_t r = sizeof(disk::block_header);
  for (std::uint32_t i = 0; i < head->records; ++i) {
    auto rec = disk::parse_record(bytes->subspan(r, head->length - r), salt, false);
    if (!rec) return complete{};
    if (disk::is_blob(*rec)) {
      auto v = value_of(found_record{location + r, *rec, nullptr}, true);
      if (!v && v.error() == errc::corrupt) return complete{};
      if (!v && v.error() != std::errc::no_such_file_or_directory) {
        return std::unexpected(v.error());
      }
    }
    r += rec->size;
  }
  return complete(*head);
}

result<std::optional<disk::block_header>> store::impl::settled_block(
    std::uint64_t location, std::uint64_t snapshot) noexcept {
  auto bytes = bytes_at(location);
  if (!bytes) return std::unexpected(bytes.error());
  const std::uint64_t seq = disk::block_seq(*bytes);
  if (seq == 0 || seq > snapshot) return std::optional<disk::block_header>{};
  return complete_block(location);
}

result<std::optional<found_record>> store::impl::back_to(found_record rec, std::uint64_t snapshot,
                                                         bool verify) noexcept {
  while (rec.rec.head.seq > snapshot) {
    if (rec.rec.head.prev == 0) return std::optional<found_record>{};
    auto older = record_at(rec.rec.head.prev, verify);
    if (!older) return std::unexpected(older.error());
    rec = *older;
  }
  return std::optional<found_record>(rec);
}

result<std::optional<found_record>> store::impl::read_at_snapshot(std::span<const std::byte> key,
                                                                  const disk::key_hash& h,
                                                                  std::uint64_t snapshot,
                                                                  bool verify) noexcept {
  const std::uint64_t page = table->page_of(h);
  if (read_page_hook != nullptr) read_page_hook();
  auto rec = locate(page, h, key, snapshot, verify);
  if (!rec || !*rec) return rec;
  auto seen = back_to(**rec, snapshot, verify);
  if (!seen || !*seen || (*seen)->rec.head.op != static_cast<std::uint8_t>(disk::op::erase)) {
    return seen;
  }
  return std::optional<found_record>{};
}

// ---- scan, stats, verify ----

namespace {

std::string cursor_of(std::uint64_t hi, std::uint64_t lo) {
  char out[33];
  std::snprintf(out, sizeof out, "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return out;
}

bool parse_cursor(std::string_view c, std::uint64_t& hi, std::uint64_t& lo) noexcept {
  if (c.size() != 32) return false;
  auto a = std::from_chars(c.data(), c.data() + 16, hi, 16);
  auto b = std::from_chars(c.data() + 16, c.data() + 32, lo, 16);
  return a.ec == std::errc{} && a.ptr == c.data() + 16 && b.ec == std::errc{} &&
         b.ptr == c.data() + 32;
}

}  // namespace

result<scan_page> store::scan(std::string_view cursor, std::size_t limit, bool keys_only) noexcept {
  const call_scope call(*impl_);
  if (auto held = impl_->hold_open_byte(); !held) return std::unexpected(held.error());
  auto lease = impl_->acquire_slot(slot_use::reading);
  if (!lease) return std::unexpected(lease.error());
  struct guard {
    impl* s;
    slot_lease l;
    ~guard() { s->release_slot(l); }
  } g{impl_.get(), *lease};
  auto snap = impl_->take_snapshot(g.l, slot_use::reading);
  if (!snap) return std::unexpected(snap.error());
  return impl_->scan_at(cursor, limit, keys_only, *snap);
}

result<scan_page> store::impl::scan_at(std::string_view cursor, std::size_t limit, bool keys_only,
                                       std::uint64_t snap) noexcept {
  std::uint64_t after_hi = 0;
  std::uint64_t after_lo = 0;
  // Moves past every hash this call has handled: a split that other users' commits make while
  // the walk goes on can show an entry in its old page and again in the new one, and a hash
  // is listed once (keys come in hash order, so a hash at or below the last one is done).
  bool from_start = cursor.empty();
  if (!from_start && !parse_cursor(cursor, after_hi, after_lo)) {
    return errc_error(std::errc::invalid_argument);
  }
  if (limit == 0) return errc_error(std::errc::invalid_argument);
  scan_page out;
  try {
    // Every entry of a page's chain (one prefix range of hashes: sorted as one) past the
    // cursor, read once, in hash order (and, within a hash, in the chain's order).
    struct key_entry {
      index::entry_ref e;
      index::entry_ref::state whole;
    };
    // From the directory entry of the cursor's prefix.
    auto walked = table->for_each_page(
        after_hi,
        [&](std::uint64_t page) -> result<bool> {
          std::vector<key_entry> entries;
          table->for_page_chain(page, [&](std::uint64_t q) {
            table->page(q).for_each_key(
                [&](std::size_t, const index::entry_ref& e, const index::entry_ref::state& w) {
                  if (from_start || w.hi > after_hi || (w.hi == after_hi && w.lo > after_lo)) {
                    entries.push_back({e, w});
                  }
                  return true;
                });
            return true;
          });
          std::stable_sort(
              entries.begin(), entries.end(), [](const key_entry& x, const key_entry& y) {
                return x.whole.hi != y.whole.hi ? x.whole.hi < y.whole.hi : x.whole.lo < y.whole.lo;
              });
          for (auto group = entries.begin(); group != entries.end();) {
            const disk::key_hash h{group->whole.hi, group->whole.lo};
            const auto end = std::find_if(group, entries.end(), [&](const key_entry& x) {
              return x.whole.hi != h.hi || x.whole.lo != h.lo;
            });
            // Every key of this hash in the page (a collision is two of them), each once.
            std::vector<std::string> seen_keys;
            for (auto x = group; x != end; ++x) {
              auto at = named_by(page, h, x->e, x->whole.seq, x->whole.location, snap);
              if (!at) return std::unexpected(at.error());
              if (*at == 0) continue;
              auto named = record_head_at(*at);
              if (!named) return std::unexpected(named.error());
              std::string key(reinterpret_cast<const char*>(named->rec.key.data()),
                              named->rec.key.size());
              if (std::ranges::find(seen_keys, key) != seen_keys.end()) continue;
              seen_keys.push_back(key);
              auto seen = read_at_snapshot(as_bytes(key), h, snap, opts.verify_checksums);
              if (!seen) return std::unexpected(seen.error());
              if (!*seen) continue;
              item it;
              it.key = std::move(key);
              if (!keys_only) {
                auto v = value_of(**seen, opts.verify_checksums);
                if (!v) return std::unexpected(v.error());
                it.value.assign(reinterpret_cast<const char*>(v->data()), v->size());
              }
              out.items.push_back(std::move(it));
            }
            out.cursor = cursor_of(h.hi, h.lo);
            after_hi = h.hi;
            after_lo = h.lo;
            from_start = false;
            if (out.items.size() >= limit) return false;
            group = end;
          }
          return true;
        },
        false);
    if (!walked) return std::unexpected(walked.error());
    out.done = out.items.size() < limit;
    return out;
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
}

result<store_stats> store::stats() noexcept {
  const call_scope call(*impl_);
  if (auto held = impl_->hold_open_byte(); !held) return std::unexpected(held.error());
  store_stats st;
  st.records = impl_->h64(header::live_records).load();
  st.live_bytes = impl_->h64(header::live_bytes).load();
  st.dead_bytes = impl_->h64(header::dead_bytes).load();
  st.visible_seq = impl_->h64(header::visible).load();
  st.checkpoint_seq = impl_->h64(header::checkpoint_seq).load();
  st.unchecked_bytes = impl_->log_distance(impl_->h64(header::checkpoint_from).load(),
                                           impl_->h64(header::tail).load());
  st.replayed_bytes = impl_->replayed_bytes;
  st.checkpoint_errno = static_cast<int>(impl_->h64(header::checkpoint_error).load());
  st.compactions = impl_->h64(header::compactions).load();
  st.compaction_errno = impl_->compacting.background_errno.load(std::memory_order_relaxed);
  st.index_bytes = impl_->h64(header::pages_allocated).load() * disk::page_size;
  st.index_free_pages = impl_->h64(header::free_pages).load();
  auto numbers = impl_->segment_numbers(false);
  if (!numbers) return std::unexpected(numbers.error());
  for (const std::uint64_t n : *numbers) {
    auto s = impl_->fs->stat_at(&impl_->dir.segments, segment_name(n).c_str(), false);
    if (!s) continue;
    ++st.segments;
    st.segment_bytes += s->size;
  }
  // The users, before this call takes a slot of its own to read the index.
  try {
    const auto self = static_cast<std::uint32_t>(::getpid());
    for (std::uint32_t u = 0; u < max_slots; ++u) {
      const slot_ref sl = impl_->slot(u);
      const std::uint32_t pid = sl.pid().load(std::memory_order_acquire);
      if (pid == 0) continue;
      auto at = std::ranges::find(st.users, pid, &store_user::pid);
      if (at == st.users.end()) {
        st.users.push_back(store_user{.pid = pid,
                                      .started = sl.start_time().load(),
                                      .slots = 0,
                                      .reading = false,
                                      .oldest_snapshot = 0,
                                      .dead = false,
                                      .self = pid == self});
        at = st.users.end() - 1;
      }
      ++at->slots;
      // A slot holds its snapshot's seq + 1 (0: none).
      if (const std::uint64_t held = sl.snapshot().load(); held != 0) {
        if (!at->reading || held - 1 < at->oldest_snapshot) at->oldest_snapshot = held - 1;
        at->reading = true;
      }
      at->dead = at->dead || (pid != self && impl_->slot_owner_dead(u));
    }
    std::ranges::sort(st.users, {}, &store_user::pid);
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  std::uint64_t used = 0;
  auto snap = snapshot_hold::take(*impl_);
  if (!snap) return std::unexpected(snap.error());
  (void)impl_->table->for_each_page(0, [&](std::uint64_t page) -> result<bool> {
    ++st.index_pages;
    used += impl_->table->page(page).used().load();
    return true;
  });
  if (st.index_pages > 0) {
    st.index_load =
        static_cast<double>(used) / static_cast<double>(st.index_pages * index::entries_per_page);
  }
  return st;
}

}  // namespace keel::kv
