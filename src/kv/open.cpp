// Opening a store (doc/kv-format.md, "Files", "The index", "Checkpoints and recovery"): the
// options judged, the directory and the lock opened, the index mapped and checked, and, by an
// opener alone, what others left recovered or the index rebuilt. Writes the index header's
// identity words (format, store id, boot id, state), with recovery.cpp when it rebuilds.

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "base/per_thread.hpp"
#include "base/planted.hpp"
#include "io/process.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {

namespace {

// Walks the blocks of a segment's `bytes` from `off` while a header fits below `end`: where
// the walk stopped, or none once a commit block there carries a seq at or past `next` (one
// the index never handed out).
std::optional<std::uint64_t> blocks_below(std::span<const std::byte> bytes, std::uint64_t off,
                                          std::uint64_t end, std::uint64_t next,
                                          std::uint64_t salt) noexcept {
  while (off + sizeof(disk::block_header) <= end) {
    auto head = disk::parse_block_header(bytes.subspan(off), salt);
    if (!head) {
      off += 8;
      continue;
    }
    if (head->kind == static_cast<std::uint16_t>(disk::block_kind::commit) && head->seq >= next) {
      return std::nullopt;
    }
    off += head->length;
  }
  return off;
}

// What a budget keeps for the store's small files (budget_used): the store file, the two
// slots of the manifest, the lock files and the two directories, a page or two each.
constexpr std::uint64_t small_files_pages = 8;

// errc::needs_local_filesystem about `path` where the store (or, before it exists, the
// directory it would be made in) is on a filesystem other machines may share.
result<void> refuse_unless_local(io::filesystem& fs, const std::string& path) noexcept {
  auto where = io::stat_fs_of_path_or_parent(fs, path);
  if (!where) return std::unexpected(where.error());
  if (where->is_local) return {};
  return std::unexpected(error(make_error_code(errc::needs_local_filesystem),
                               path + " (a store on " + std::string(where->type_name()) +
                                   ": if every user is on this host, through this mount, say so: "
                                   "every_user_on_this_host, keel kv --single-host)"));
}

}  // namespace

// The header's words are read before the file's size, each before the one published before
// it (the file grows, then *pages allocated*, then *pages used*, then the directory word that
// names them): read in the other order beside a writer that grew the index meanwhile, a sound
// index looked cut short, and an opener that was not alone failed with corrupt (one of a
// thousand processes opening a store being written).
result<bool> store::impl::index_header_valid(error& why) const noexcept {
  const store::impl& s = *this;
  // (Its first pages there before any is touched: an index just made is empty.)
  auto made = s.index_file.size();
  if (!made) return std::unexpected(made.error());
  if (static_cast<std::uint64_t>(*made) < first_free_page * disk::page_size) return false;
  const std::span<const std::byte> page(s.base(), disk::page_size);
  auto h = base::check_header(page, index_format);
  if (!h) {
    why = h.error();
    return false;
  }
  if (*h != base::header_state::ours) return false;
  if (std::memcmp(s.base() + header::store_id, s.dir.params.id.data(), 16) != 0) return false;
  std::uint64_t sum = 0;
  std::memcpy(&sum, s.base() + header::checksum, 8);
  if (sum != disk::checksum(page.first(header::checksummed), s.salt)) return false;
  if (s.h64(header::state).load(std::memory_order_acquire) != state_valid) return false;
  const auto& boot = io::self().boot_id;
  if (std::all_of(boot.begin(), boot.end(), [](std::uint8_t b) { return b == 0; })) return false;
  if (std::memcmp(s.base() + header::boot_id, boot.data(), 16) != 0) return false;
  // Its pages are all in the file (one cut short by hand would be a SIGBUS at the first
  // touch past its end) and its directory among them: else it is damaged, and rebuilt by an
  // opener alone, refused by one that is not.
  const std::uint64_t word = s.h64(header::directory).load(std::memory_order_acquire);
  const std::uint64_t used = s.h64(header::pages_used).load(std::memory_order_acquire);
  const std::uint64_t allocated = s.h64(header::pages_allocated).load(std::memory_order_acquire);
  auto file_size = s.index_file.size();
  if (!file_size) return std::unexpected(file_size.error());
  const unsigned depth = static_cast<unsigned>(word & 0xff);
  if (allocated * disk::page_size > static_cast<std::uint64_t>(*file_size) || used > allocated ||
      used < first_free_page || depth > index::max_depth || (word >> 8) < first_free_page ||
      (word >> 8) + index::directory_pages(depth) > used) {
    why = error(errc::corrupt);
    return false;
  }
  return true;
}

result<bool> store::impl::index_valid_or_let_go(const io::file_handle& f) noexcept {
  error why;
  auto valid = index_header_valid(why);
  if (!valid || *valid) return valid;
  if (why) return std::unexpected(why.about(index_file.shared_path(), 0));
  // Its rebuilder died part-way: the byte let go, for an opener alone to rebuild it.
  (void)fs->lock(f, open_byte, 1, io::lock_request::unlock, false);
  return false;
}

bool store::impl::waits_for_private_build(const io::file_handle& f) noexcept {
  // Asked after taking the open byte: a reader that builds either sees this opener or is seen.
  // (An error asking: taken as no build, and the open goes on.)
  auto free =
      fs->lock_is_free(dir.store_file, private_opening_byte, 1, io::lock_request::exclusive);
  if (!free || *free) return false;
  (void)fs->lock(f, open_byte, 1, io::lock_request::unlock, false);
  (void)fs->lock(dir.store_file, opener_waiting_byte, 1, io::lock_request::shared, false);
  return true;
}

result<io::file_handle> store::impl::open_store_hold() noexcept {
  const std::string store_path = path + "/" + store_file_name;
  auto held = io::file_handle::open_at(dir.dir, store_file_name,
                                       io::open_flags::read | io::open_flags::no_follow);
  if (!held) return std::unexpected(held.error().about(store_path));
  auto ours = fs->stat(*held);
  auto first = ours ? fs->stat(dir.store_file) : ours;
  if (!first) return std::unexpected(first.error().about(store_path));
  // (The store file is written once: one replaced by hand is another store's.)
  if (!ours->same_file(*first)) {
    return std::unexpected(errno_error(ESTALE).error().about(store_path));
  }
  return held;
}

result<void> store::impl::take_presence_byte(const io::file_handle& held) noexcept {
  auto r = fs->lock(held, presence_byte, 1, io::lock_request::shared, false);
  if (!r) return std::unexpected(r.error().about(path + "/" + store_file_name));
  return {};
}

result<bool> store::impl::alone_in_store(const io::file_handle& held) noexcept {
  // Taken, then asked whether another holds it (this descriptor's own hold is no conflict):
  // of two openers alone on two index files at once, one sees the other at least.
  if (auto in = take_presence_byte(held); !in) return std::unexpected(in.error());
  auto free = fs->lock_is_free(held, presence_byte, 1, io::lock_request::exclusive);
  if (free && *free) return true;
  (void)fs->lock(held, presence_byte, 1, io::lock_request::unlock, false);
  if (!free) return std::unexpected(free.error().about(path + "/" + store_file_name));
  return false;
}

result<void> store::impl::index_at_path_is(const io::file_handle& f) const noexcept {
  auto at_path = fs->stat_at(&dir.dir, "index", false);
  // (Removed since: stale too, not a store that is not there.)
  if (!at_path && at_path.error() == std::errc::no_such_file_or_directory) {
    return std::unexpected(errno_error(ESTALE).error().about(path + "/index"));
  }
  auto locked = at_path ? fs->stat(f) : at_path;
  if (!locked) return std::unexpected(locked.error().about(path + "/index"));
  if (!at_path->same_file(*locked)) {
    return std::unexpected(errno_error(ESTALE).error().about(path + "/index"));
  }
  return {};
}

bool store::impl::user_of_another_index() const noexcept {
  auto free = fs->lock_is_free(dir.store_file, presence_byte, 1, io::lock_request::exclusive);
  return !free || !*free;
}

bool store::impl::index_sound() noexcept {
  // The index outlives its users, on disk: an opener alone checks what it can of it before
  // it trusts it (a flipped bit would otherwise read a present key as absent, or send the
  // next commit over blocks already written). Its bucket pages add up to their sums...
  if (!table->pages_sound(first_free_page, h64(header::pages_used).load())) return false;
  // ...and its tail is where the log ends.
  const std::uint64_t tail = h64(header::tail).load();
  return (tail == 0 || tail_segment_ends_at_tail(tail)) && nothing_past_tail_segment(tail) &&
         nothing_in_flight_past_next_seq(tail) && every_table_segment_listed();
}

bool store::impl::tail_segment_ends_at_tail(std::uint64_t tail) noexcept {
  // The tail lies past every block of its segment, with every seq there below the next one.
  auto seg = segment_at(disk::segment_of(tail));
  if (!seg) return false;  // the rebuild says why
  const std::uint64_t at = disk::offset_of(tail);
  if (at < disk::segment_header_size || at > (*seg)->size) return false;
  const std::uint64_t next = h64(header::next_seq).load();
  const auto bytes = (*seg)->bytes();
  const auto off = blocks_below(bytes, disk::segment_header_size, at, next, salt);
  // Not inside a block, and nothing written right at it: the tail never goes back, so its
  // place holds the zeros nothing-written leaves. (Not only no block header: a block abandoned
  // there (disk::void_block) has its seq word alone, and the commits after it follow it.)
  const auto there = bytes.subspan(at).first(
      std::min<std::uint64_t>(sizeof(disk::block_header), bytes.size() - at));
  return off && *off <= at &&
         std::ranges::all_of(there, [](std::byte b) { return b == std::byte{0}; }) &&
         h64(header::visible).load() < next;
}

bool store::impl::nothing_in_flight_past_next_seq(std::uint64_t tail) noexcept {
  // A commit in flight when the index was last written, with its space reserved and no seq
  // taken yet, may have written its block since with a seq the index never handed out, and
  // in a segment below the tail's (the log moved on meanwhile), which the tail's walk does not
  // reach: an index put back from a copy taken then. Its slot says where (a lower bound while
  // *reserved*): every block from there up to the tail's segment carries a seq below *next
  // seq*. (After clean closes no slot is in flight: nothing to walk.)
  std::uint64_t from = UINT64_MAX;
  for (std::uint32_t u = 0; u < max_slots; ++u) {
    const slot_ref sl = slot(u);
    const std::uint64_t state = sl.state().load();
    if (state < static_cast<std::uint64_t>(commit_state::reserved) ||
        state > static_cast<std::uint64_t>(commit_state::writing)) {
      continue;
    }
    if (const std::uint64_t at = sl.block().load(); at != 0) from = std::min(from, at);
  }
  const std::uint64_t tail_segment = disk::segment_of(tail);
  if (from == UINT64_MAX || disk::segment_of(from) >= tail_segment) return true;
  auto listed = listed_segments();
  if (!listed) return false;  // the rebuild says why
  const std::uint64_t next = h64(header::next_seq).load();
  for (const disk::manifest_entry& e : *listed) {
    if (e.number < disk::segment_of(from) || e.number >= tail_segment) continue;
    auto seg = segment_at(e.number);
    if (!seg) return false;
    if (!log_segment_size((*seg)->size)) continue;
    const std::uint64_t start = e.number == disk::segment_of(from)
                                    ? std::max(disk::offset_of(from), disk::segment_header_size)
                                    : disk::segment_header_size;
    if (!blocks_below((*seg)->bytes(), start, (*seg)->size, next, salt)) return false;
  }
  return true;
}

bool store::impl::every_table_segment_listed() noexcept {
  // Compaction takes its victims off the manifest before it empties their entries in the
  // segment table and removes their files: a table that names a segment the manifest no
  // longer lists is older than the log's last compaction (a copy put back, taken while the
  // records were moved: some entries still name the originals, in a file since removed), or
  // was left by a compactor killed in between. Rebuilt either way.
  auto listed = listed_segments();
  if (!listed) return false;  // the rebuild says why
  try {
    std::vector<std::uint64_t> numbers;
    for (const disk::manifest_entry& e : *listed)
      numbers.push_back(e.number);
    std::ranges::sort(numbers);
    return std::ranges::all_of(table_segment_numbers(), [&](std::uint64_t n) {
      return std::ranges::binary_search(numbers, n);
    });
  } catch (const std::bad_alloc&) {
    return false;
  }
}

bool store::impl::nothing_past_tail_segment(std::uint64_t tail) noexcept {
  // The log moves on into a later segment when the rest of the tail's cannot hold a block:
  // an index behind its log (a copy of it put back by hand) whose tail ended its segment
  // shows nothing past that tail there. A listed log segment numbered past the tail's has
  // nothing written in it (made ahead of the tail, abandoned, or a victim kept as the next:
  // zeros where its first block goes, as adopt_named_leftover finds them); a blob's segment
  // of its own is never a log segment's size.
  auto listed = listed_segments();
  if (!listed) return false;  // the rebuild says why
  const std::uint64_t last = disk::segment_of(tail);
  for (const disk::manifest_entry& e : *listed) {
    if (e.number <= last) continue;
    auto seg = segment_at(e.number);
    if (!seg) return false;
    if (!log_segment_size((*seg)->size)) continue;
    const auto first =
        (*seg)->bytes().subspan(disk::segment_header_size, sizeof(disk::block_header));
    if (!std::ranges::all_of(first, [](std::byte b) { return b == std::byte{0}; })) return false;
  }
  return true;
}

result<void> store::impl::map_index() noexcept {
  auto m = io::mapped_file::map(index_file, io::map_access::read_write, index_window, 0);
  if (!m) return std::unexpected(m.error().about(index_file.shared_path()));
  index_map = std::move(*m);
  table.emplace(base(), h64(header::directory),
                reinterpret_cast<std::uint64_t*>(base() + header::split_journal));
  // (also for users that charge nothing: they free dead users' pins)
  ledger.emplace(*reinterpret_cast<space::ledger_words*>(base() + header::ledger),
                 base() + slot_first_page * disk::page_size + slot_ledger_pin, max_slots,
                 slot_size);
  return {};
}

result<void> store::impl::open_index() noexcept {
  // Both descriptors hold bytes before this process's users have them: a child forked
  // meanwhile must not keep its copies.
  io::file_handle held;
  closed_in_forked_children held_in_no_child{held};
  if (auto h = held_in_no_child.make([&] { return open_store_hold(); }); !h) return h;
  io::file_handle probe;  // the liveness descriptor, on the file mapped
  closed_in_forked_children probe_in_no_child{probe};
  const auto until = now_ms() + static_cast<std::uint64_t>(opts.lock_timeout.count());
  for (;;) {
    // The file mapped and the one locked are one: an index removed and made anew between two
    // opens by path would have this opener lock one file and work through another.
    auto f = io::file_handle::open_at(
        dir.dir, "index",
        io::open_flags::read_write | io::open_flags::create | io::open_flags::no_follow, 0644);
    if (!f) return std::unexpected(f.error().about(path + "/index"));
    index_file = std::move(*f);
    if (auto m = map_index(); !m) return m;
    if (index_opened_hook != nullptr) index_opened_hook();
    auto p = probe_in_no_child.make([&] {
      return io::file_handle::open_at(dir.dir, "index",
                                      io::open_flags::read_write | io::open_flags::no_follow);
    });
    if (!p && p.error() != std::errc::no_such_file_or_directory) return p;
    if (p) {
      auto one = fs->stat(probe);
      auto other = one ? fs->stat(index_file) : one;
      if (!other) return std::unexpected(other.error().about(path + "/index"));
      if (one->same_file(*other)) break;
      (void)probe.close();
    }
    if (now_ms() > until) return errc_error(std::errc::timed_out);
  }
  const done_waiting_for_builds done{*this};
  for (;;) {
    auto alone = fs->lock(probe, open_byte, 1, io::lock_request::exclusive, false);
    if (alone && waits_for_private_build(probe)) {
      if (now_ms() > until) return errc_error(std::errc::timed_out);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    if (alone) {
      // Alone on this index, and alone in the store: a user that goes on through an index
      // removed from the path (or replaced) since holds the presence byte, and another index
      // built here over the same log would lose commits; so does an opener alone on another
      // index file. Waited out (a killed user's bytes go one after another), then refused.
      auto only = alone_in_store(held);
      if (!only) return std::unexpected(only.error());
      if (!*only) {
        (void)fs->lock(probe, open_byte, 1, io::lock_request::unlock, false);
        if (now_ms() > until) {
          return std::unexpected(errc_error(std::errc::device_or_resource_busy)
                                     .error()
                                     .about(path + "/index (another process has the store "
                                                   "open through an index other than the one "
                                                   "at this path, such as one removed by hand: "
                                                   "it must close the store first)"));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      // (The index at the path is the one locked: an opener that replaces it from now on
      // finds the presence byte held.)
      if (auto at = index_at_path_is(probe); !at) return at;
      if (alone_opening_hook != nullptr) alone_opening_hook();
      // Nobody else has the store open: check the index, or rebuild it.
      error why;
      auto header = index_header_valid(why);
      if (!header) return std::unexpected(header.error());
      const bool valid = *header && index_sound();
      if (valid) {
        if (auto w = alone_write_ready(); !w) return w;  // recover_alone writes
      }
      auto r = valid ? recover_alone() : rebuild();
      if (!r) return r;
      if (!opts.read_only) {
        if (auto u = finish_manifest_upgrade(); !u) return u;
      }
      // What dead users charged is nobody's now.
      if (auto w = store_or_refuse([&] { reset_ledger(); }); !w) return w;
      // A rebuild does not know which segment was made of the deletes' room: on a volume
      // puts could not grow on, the tail's is taken for it.
      if (h64(header::deletes_segment).load() == 0 && h64(header::tail).load() != 0 &&
          !could_put(0)) {
        if (auto w = store_or_refuse([&] {
              h64(header::deletes_segment).store(disk::segment_of(h64(header::tail).load()));
            });
            !w) {
          return w;
        }
      }
      if (auto d = fs->lock(probe, open_byte, 1, io::lock_request::shared, false); !d) {
        return std::unexpected(d.error());
      }
      break;
    }
    if (alone.error() != std::errc::operation_would_block &&
        alone.error() != std::errc::resource_unavailable_try_again) {
      return std::unexpected(alone.error());
    }
    auto shared = fs->lock(probe, open_byte, 1, io::lock_request::shared, false);
    if (shared && waits_for_private_build(probe)) {
      shared = errc_error(std::errc::operation_would_block);
    }
    if (shared) {
      // (Let go if its rebuilder died part-way, to try to be alone again.)
      auto valid = index_valid_or_let_go(probe);
      if (!valid) return std::unexpected(valid.error());
      if (*valid) {
        if (auto in = take_presence_byte(held); !in) return in;
        if (auto at = index_at_path_is(probe); !at) return at;
        break;
      }
    }
    if (now_ms() > until) return errc_error(std::errc::timed_out);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  base::lock_guard g(users.mutex);
  users.adopt(std::move(probe), std::move(held));
  return {};
}

result<void> store::impl::recover_alone() noexcept {
  // Every other user is gone. What they left in flight: a commit whose block is complete
  // happened (its entries are settled by the next holder of their pages), one whose block is
  // not is a hole. Every seq handed out is therefore settled.
  // (Its pages were asked for (alone_write_ready), and each group of stores escapes a page
  // the volume refuses again past lock_timeout: the open then fails as an opener killed
  // there would have, and the next one alone recovers again.)
  for (std::uint32_t u = 0; u < max_slots; ++u) {
    const slot_ref s = slot(u);
    bury_unsealed(s);
    if (auto w = store_or_refuse([&] {
          s.state().store(0);
          s.seq().store(0);
          s.block().store(0);
          s.block_length().store(0);
          s.snapshot().store(0);
          s.pid().store(0);
        });
        !w) {
      return w;
    }
  }
  const std::uint64_t next = h64(header::next_seq).load();
  if (auto w = store_or_refuse([&] {
        h64(header::visible).store(next - 1);
        if (base::is_planted(base::planted_bug::kv_forgets_last_commit) && next > 1) {
          h64(header::visible).store(next - 2);
          h64(header::next_seq).store(next - 1);
        }
        h64(header::sync_error).store(0);
        h64(header::sync_error_segment).store(0);
        h64(header::visible_waiters).store(0);
        // A hint of the users gone: the next compaction looks.
        h64(header::fruitless_below).store(0);
      });
      !w) {
    return w;
  }
  table->finish_split(*this);  // alone: no locks to take
  if (auto r = reconcile_rooms(); !r) return std::unexpected(r.error());
  reconcile_checkpoint_bytes();
  // The manifest's segments must all be there (corrupt, naming one that is not); those it
  // does not list are leftovers, removed by a writable opener. One listed and not in the
  // table was made by a user killed before it entered it: nothing was written there, and it
  // is entered as dead room (the next writer that needs a segment takes the last one made,
  // compaction removes the others).
  auto census = check_segments();
  if (!census) return std::unexpected(census.error());
  for (const std::uint64_t n : census->listed) {
    if (segtab(n, 0).load() != 0) continue;
    auto seg = segment_at(n);
    if (!seg) return std::unexpected(seg.error());
    if (auto e = enter_segment(n, (*seg)->size); !e) return std::unexpected(e.error());
    if (auto w = store_or_refuse(
            [&] { h64(header::dead_bytes).fetch_add((*seg)->size - disk::segment_header_size); });
        !w) {
      return w;
    }
  }
  // What users that died part-way left in the store's files is cleared by a writable
  // opener; a read-only one changes nothing of them.
  if (auto r = remove_leftovers(census->unlisted, !opts.read_only); !r) return r;
  if (opts.read_only) return {};
  remove_checkpoint_leftovers();
  return {};
}

void store::impl::remove_checkpoint_leftovers() noexcept {
  remove_checkpoint_temps();
  if (auto entries = fs->list_directory(dir.dir)) {
    for (const auto& e : *entries) {
      if (e.name.starts_with(".manifest.")) (void)io::unlink_at(dir.dir, e.name.c_str());
    }
  }
}

void store::impl::remove_checkpoint_temps() noexcept {
  // What a checkpointer killed between writing its copy and renaming it left
  // (io::atomic_replace's temporary name).
  if (auto entries = fs->list_directory(dir.dir)) {
    for (const auto& e : *entries) {
      if (e.name.starts_with(".checkpoint.keel-tmp.")) {
        (void)io::unlink_at(dir.dir, e.name.c_str());
      }
    }
  }
}

result<std::vector<std::uint64_t>> store::impl::segment_numbers(bool remove_leftovers) noexcept {
  auto entries = fs->list_directory(dir.segments);
  if (!entries) return std::unexpected(entries.error().about(path + "/seg"));
  std::vector<std::uint64_t> numbers;
  try {
    for (const auto& e : *entries) {
      if (auto n = segment_number_of(e.name)) {
        numbers.push_back(*n);
      } else if (remove_leftovers && e.name.starts_with(segment_temp_prefix)) {
        (void)io::unlink_at(dir.segments, e.name.c_str());
      }
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  std::sort(numbers.begin(), numbers.end());
  return numbers;
}

result<std::unique_ptr<store>> store::open(const std::string& path, const options& o) noexcept {
  // Options that cannot work are refused before anything is made.
  const auto invalid = [&] {
    return std::unexpected(error(std::make_error_code(std::errc::invalid_argument)).about(path));
  };
  if (o.lock_timeout.count() < 0) return invalid();
  if (!(o.compact_dead_fraction >= 0 && o.compact_dead_fraction < 1)) return invalid();
  if (!o.every_user_on_this_host) {
    if (auto here = refuse_unless_local(o.fs != nullptr ? *o.fs : io::os(), path); !here) {
      return std::unexpected(here.error());
    }
  }
  // Room for the index as made, a segment to write in and the index pages its keys may need
  // (of 1 KiB records: put_needs), the deletes' room, the spare, and the small files
  // (budget_used). Segments of a fixed size need one more, below the tail's: compaction
  // takes only those, and with three a tail's segment full of dead versions was never
  // taken (every put after was refused, test
  // `KvBudget.AStoreOfFixedSegmentsAtItsLeastBudgetComesBackFromFull`). Growing segments
  // need none: near the budget a put makes a smaller one, and they grow to no more than a
  // 256th of the budget (store::impl::room_scale).
  const auto budget_too_small = [&](std::uint64_t segment_size, std::uint64_t first_size,
                                    std::uint64_t index_pages) {
    const bool fixed = first_size == 0;
    if (!fixed && o.max_bytes != 0) {
      std::uint64_t most = first_size;
      while (most < segment_size && most * 2 <= o.max_bytes / 256)
        most *= 2;
      segment_size = most;
    }
    constexpr std::uint64_t half_page = index::entries_per_page / 2;
    const std::uint64_t pages = index_pages +
                                (keys_in_segment(segment_size, 1024) + half_page - 1) / half_page +
                                small_files_pages;
    const std::uint64_t segments = fixed ? 4 : 3;
    return o.max_bytes != 0 && o.max_bytes < segments * segment_size + pages * disk::page_size;
  };
  store_dir_options d;
  d.create_if_missing = false;
  d.error_if_exists = o.error_if_exists;
  d.segment_size = o.segment_size;
  d.fs = o.fs;
  auto sd = open_store_dir(path, d);
  if (!sd && sd.error() == std::errc::no_such_file_or_directory && o.create_if_missing &&
      !o.read_only) {
    // None yet: judged as the store it would make, then made.
    auto size = new_store_segment_size(path, d);
    if (!size) return std::unexpected(size.error());
    const std::uint64_t first_size = o.segment_size != 0 ? 0 : disk::min_first_segment_size;
    if (budget_too_small(*size, first_size, initial_index_pages_for(first_size))) {
      return invalid();
    }
    d.create_if_missing = true;
    sd = open_store_dir(path, d);
  }
  if (!sd) return std::unexpected(sd.error());
  if (!o.read_only) {
    // Copy-on-write (btrfs) writes a changed block to new room, which fallocate did not
    // reserve: a write through a map then finds a full volume, a SIGBUS. The store's files
    // are written in place instead: those made from now on inherit the directories' flag
    // (doc/kv-format.md, Space). Best effort: a user who does not own the directories keeps
    // copy-on-write, as the docs say.
    io::filesystem& fs = o.fs != nullptr ? *o.fs : io::os();
    (void)fs.disable_copy_on_write(sd->dir);
    (void)fs.disable_copy_on_write(sd->segments);
  }
  if (budget_too_small(sd->params.segment_size, sd->params.first_segment_size,
                       initial_index_pages_for(sd->params.first_segment_size))) {
    return invalid();
  }
  auto p = std::make_unique<impl>();
  // Before any descriptor of it holds a byte: a child forked from now on lets go of them.
  register_store(p.get());
  p->path = path;
  p->opts = o;
  p->fs = o.fs != nullptr ? o.fs : &io::os();
  p->dir = std::move(*sd);
  p->salt = p->dir.params.salt;
  if (auto fsi = p->fs->statfs(p->dir.segments)) {
    if (fsi->type == io::fs_type::btrfs) p->writes_refusable.store(true);
    p->room_scale = fsi->total_bytes;
  }
  if (o.max_bytes != 0) p->room_scale = std::min(p->room_scale, o.max_bytes);
  const call_scope call(*p);
  // A reader that may not write the lock or the index (a read-only filesystem, files it may
  // only read, a volume full or at its quota: btrfs refuses even a rewrite in place under a
  // qgroup at its limit) builds an index of its own: a reader never needs to write.
  const auto may_not_write = [&](const error& e) {
    return o.read_only &&
           (e == std::errc::read_only_file_system || e == std::errc::permission_denied ||
            e == std::errc::operation_not_permitted || e == std::errc::no_space_on_device ||
            e == std::error_code(EDQUOT, std::system_category()));
  };
  lock::memory_map::options lo;
  lo.fs = o.fs;
  auto locks = lock::memory_map::open(path + "/lock", lo);
  if (!locks && !may_not_write(locks.error())) {
    return std::unexpected(locks.error().about(path + "/lock"));
  }
  if (locks) {
    p->locks = std::move(*locks);
    auto r = p->open_index();
    // (Refused room, the index may be open already: a rebuild of it could not allocate.)
    if (!r && !(may_not_write(r.error()) && (!p->index_file.is_open() || out_of_room(r.error())))) {
      return std::unexpected(r.error().about(path + "/index"));
    }
    if (!r) {
      p->locks.reset();
      // What the failed open left goes: the private index is built anew.
      p->index_map = {};
      p->index_file = {};
    }
  }
  if (!p->locks) {
    p->private_index = true;
    if (auto r = p->open_private_index(); !r) {
      return std::unexpected(r.error().about(path + "/index"));
    }
  }
  if (budget_too_small(p->dir.params.segment_size, p->dir.params.first_segment_size,
                       p->h64(header::pages_allocated).load())) {
    return invalid();  // an index grown since
  }
  p->serving = true;
  // A rebuild that replayed much writes a checkpoint (in the background), so that the next
  // one replays little.
  p->maybe_maintain();
  return std::unique_ptr<store>(new store(std::move(p)));
}

}  // namespace keel::kv
