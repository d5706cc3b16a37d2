// The index's page source (doc/kv-format.md, "The index", "Growth"): pages allocated from the
// file's end as the table grows, retired when a split or a directory doubling frees them, and
// reused once no snapshot can still reach them (the free list). Writes *pages used*, *pages
// allocated* and the free list's words of the index header (as do a rebuild and a loaded
// checkpoint, in recovery.cpp and checkpoint.cpp).

#include <algorithm>
#include <cstring>

#include "base/planted.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {

result<std::uint64_t> store::impl::allocate(std::size_t count) noexcept {
  // Callers hold the directory lock (or are alone): one allocator at a time.
  if (count == 1) {
    if (const std::uint64_t p = reuse_free_page(); p != 0) return p;
  }
  const std::uint64_t used = h64(header::pages_used).load();
  const std::uint64_t need = used + count;
  if (need * disk::page_size > index_window) return errc_error(std::errc::file_too_large);
  std::uint64_t have = h64(header::pages_allocated).load();
  if (need > have) {
    std::uint64_t grow = std::max<std::uint64_t>({need, have + have / 4, have + 256});
    grow = std::min<std::uint64_t>(grow, index_window / disk::page_size);
    // The index counts against options::max_bytes too: grow less, or not at all.
    const std::uint64_t left = budget_left(room_for::put) / disk::page_size;
    if (need - have > left) return keel_error(errc::budget_reached);
    grow = std::min(grow, have + left);
    // Ahead of need only while the volume has room to spare, and at most a 256th of it: near
    // full, pages allocated ahead would hold room the log needs (on a 64 MiB volume, 66 pages
    // ahead were 0.4 % of it when it filled).
    if (grow > need) {
      auto free = fs->statfs(dir.segments);
      const std::uint64_t ahead = (grow - need) * disk::page_size;
      if (free && free->available_bytes < 16 * ahead + 4 * dir.params.segment_size) {
        grow = std::max(need, std::min(grow, need + free->available_bytes / 256 / disk::page_size));
      }
    }
    // Puts leave a segment of the volume for deletes (room_for), and so do the pages their
    // keys need. Not while opening: a rebuild must fit in what the store had.
    if (serving) {
      if (auto h = check_headroom((grow - have) * disk::page_size); !h) {
        return std::unexpected(h.error());
      }
    }
    if (auto r = allocate_in(index_file, static_cast<off_t>(have * disk::page_size),
                             static_cast<off_t>((grow - have) * disk::page_size));
        !r) {
      return std::unexpected(r.error());
    }
    h64(header::pages_allocated).store(grow, std::memory_order_release);
  }
  h64(header::pages_used).store(need, std::memory_order_release);
  return used;
}

void store::impl::retire(std::uint64_t first, std::size_t count) noexcept {
  // Retired at the next seq, read once the directory no longer names the page (the switch's
  // stores and this load are all seq_cst): a snapshot at or above it was taken after that,
  // so its reader never reaches the page (see reuse_horizon). A directory run is only counted: a
  // reader of the old directory word may be in any of its entries, with no room in them for a link
  // (directories are a few pages).
  const std::uint64_t at = h64(header::next_seq).load(std::memory_order_seq_cst);
  for (std::size_t i = 0; i < count; ++i) {
    const index::bucket_ref b = table->page(first + i);
    if (b.magic().load() == index::bucket_magic) add_free_page(first + i, at, false);
  }
  h64(header::retired_pages).fetch_add(count);
}

void store::impl::release(std::uint64_t first, std::size_t count) noexcept {
  // Never named: no reader can be in it. (A run of several is only ever a directory, and
  // none is released: left unused.)
  if (count == 1) add_free_page(first, 0, true);
}

void store::impl::forget_horizon() noexcept {
  horizon_seen.store(0, std::memory_order_relaxed);
  horizon_looked_at.store(0, std::memory_order_relaxed);
}

std::uint64_t store::impl::reuse_horizon() noexcept {
  // A user publishes its snapshot in its slot before it reads the index (take_snapshot),
  // and takes the visible seq, which only grows: one published after this read of *visible*
  // is at least that, one published before is seen below.
  std::array<std::uint32_t, 4> passed{max_slots, max_slots, max_slots, max_slots};
  for (std::size_t round = 0;; ++round) {
    std::uint64_t h = h64(header::visible).load(std::memory_order_seq_cst);
    std::uint32_t oldest = max_slots;
    for (std::uint32_t u = 0; u < max_slots; ++u) {
      const std::uint64_t held = slot(u).snapshot().load(std::memory_order_seq_cst);
      // The slot holds 1 + its snapshot (0: none).
      if (held != 0 && held - 1 < h && std::ranges::find(passed, u) == passed.end()) {
        h = held - 1;
        oldest = u;
      }
    }
    // A user killed while it held a snapshot leaves it in its slot until the slot is taken
    // again: the oldest, when it held reuse back last time too, is asked whether it lives
    // (a lock probe), and a dead one is passed over (it reads nothing any more).
    const std::uint64_t last = horizon_seen.load(std::memory_order_relaxed);
    // A reader without a slot took the visible seq after its byte: found free after *visible*
    // was read above, every such reader reads at or above h; found held, one may read below
    // it, and the horizon stays where it was (each value it took was found so).
    if (h > last && !no_slotless_readers()) return last;
    if (oldest == max_slots || h > last || round == passed.size() || !slot_owner_dead(oldest)) {
      std::uint64_t seen = last;
      while (seen < h && !horizon_seen.compare_exchange_weak(seen, h, std::memory_order_relaxed)) {
      }
      return h;
    }
    free_dead_slot(oldest);
    passed[round] = oldest;
  }
}

bool store::impl::may_be_free(std::uint64_t p) const noexcept {
  // A page number off the list, which lives in memory every user writes: one of the index's
  // pages in use past the fixed ones, and none of the directory's.
  if (p < first_free_page || p >= h64(header::pages_used).load()) return false;
  const std::uint64_t word = h64(header::directory).load();
  const unsigned depth = std::min(static_cast<unsigned>(word & 0xff), index::max_depth);
  return p < (word >> 8) || p >= (word >> 8) + index::directory_pages(depth);
}

void store::impl::begin_free_list_change() noexcept {
  if (h64(header::free_changing).load() != 0) {
    // Its changer died in the middle (every change is made under the directory lock, which
    // the next holder gets only then). The list is what its head reaches: a page linked
    // before the tail moved on to it is in, one taken off the head is out (and left unused),
    // whatever the tail and the count say. A link that cannot name a free page ends it, and
    // so does a walk as long as the index (a cycle).
    std::uint64_t head = h64(header::free_head).load();
    if (!may_be_free(head)) head = 0;
    std::uint64_t last = 0;
    std::uint64_t count = 0;
    const std::uint64_t most = h64(header::pages_used).load();
    for (std::uint64_t p = head; p != 0 && count < most;) {
      last = p;
      ++count;
      p = table->page(p).next_free().load();
      if (!may_be_free(p)) p = 0;
    }
    if (last != 0) table->page(last).next_free().store(0);
    h64(header::free_head).store(head);
    h64(header::free_tail).store(last);
    h64(header::free_pages).store(count);
  }
  h64(header::free_changing).store(1);
}

void store::impl::add_free_page(std::uint64_t p, std::uint64_t at, bool front) noexcept {
  begin_free_list_change();
  const index::bucket_ref b = table->page(p);
  b.retired_at().store(at);
  const std::uint64_t head = h64(header::free_head).load();
  const std::uint64_t tail = h64(header::free_tail).load();
  const bool empty = !may_be_free(head) || !may_be_free(tail);
  b.next_free().store(front && !empty ? head : 0);
  if (empty) {
    h64(header::free_tail).store(p);
    h64(header::free_head).store(p);
  } else if (front) {
    h64(header::free_head).store(p);
  } else {
    table->page(tail).next_free().store(p);
    if (free_list_hook != nullptr) free_list_hook();  // linked, the tail not moved on yet
    h64(header::free_tail).store(p);
  }
  h64(header::free_pages).store(empty ? 1 : h64(header::free_pages).load() + 1);
  h64(header::free_changing).store(0);
}

std::uint64_t store::impl::reuse_free_page() noexcept {
  if (h64(header::free_head).load() == 0) return 0;
  begin_free_list_change();
  const std::uint64_t head = h64(header::free_head).load();
  bool take = may_be_free(head);
  // The list is oldest first: if its first page is still within some reader's reach, so is
  // the rest (pages released unread, retired at 0, go first). The slots are looked at again
  // only once a commit has become visible since the last look.
  if (take) {
    const std::uint64_t at = table->page(head).retired_at().load();
    if (at > horizon_seen.load(std::memory_order_relaxed)) {
      const std::uint64_t visible = h64(header::visible).load();
      take = visible != horizon_looked_at.exchange(visible, std::memory_order_relaxed) &&
             at <= reuse_horizon();
    }
  } else {
    h64(header::free_head).store(0);  // not a free page: the list is gone
    h64(header::free_pages).store(0);
  }
  if (take) {
    std::uint64_t next = table->page(head).next_free().load();
    if (!may_be_free(next) || next == head) next = 0;
    h64(header::free_head).store(next);
    if (free_list_hook != nullptr) free_list_hook();  // taken, the count not updated yet
    const std::uint64_t listed = h64(header::free_pages).load();
    h64(header::free_pages).store(next == 0 || listed == 0 ? 0 : listed - 1);
  }
  h64(header::free_changing).store(0);
  if (!take) return 0;
  // Handed out zeroed, as a page never used (nobody can read it: see above).
  std::memset(base() + head * disk::page_size, 0, disk::page_size);
  return head;
}

void store::impl::collect_free_pages() noexcept {
  // A loaded checkpoint holds the directory, the bucket pages it names, and zeroes.
  const std::uint64_t used = h64(header::pages_used).load();
  for (std::uint64_t p = first_free_page; p < used; ++p) {
    if (!may_be_free(p)) continue;  // the directory's
    const std::byte* const at = base() + p * disk::page_size;
    if (std::any_of(at, at + disk::page_size, [](std::byte c) { return c != std::byte{0}; })) {
      continue;
    }
    add_free_page(p, 0, false);
  }
}

result<void> store::impl::settle_split(const io::countdown& cd) noexcept {
  for (;;) {
    const index::split_journal j = table->pending_split();
    if (j.old == 0) return {};
    const std::array<lock::entity, 4> want{lock::entity(entity_directory), lock::entity(j.old),
                                           lock::entity(j.low), lock::entity(j.high)};
    auto g = locks->lock(want, io::deadline(cd.expiry()));
    if (!g) return std::unexpected(g.error());
    // Still the same split (a live splitter finishes its own before it lets go): finish it.
    if (table->pending_split() == j) table->finish_split(*this);
  }
}

result<void> store::impl::grow_page(std::uint64_t page, const disk::key_hash& h,
                                    std::span<const disk::key_hash> coming, std::size_t wanted,
                                    const io::countdown& cd) noexcept {
  for (;;) {
    if (auto r = settle_split(cd); !r) return r;
    const std::array<lock::entity, 2> want{lock::entity(page), lock::entity(entity_directory)};
    auto g = locks->lock(want, io::deadline(cd.expiry()));
    if (!g) return std::unexpected(g.error());
    if (table->pending_split().old != 0) continue;  // a splitter died since: finish it first
    // Split by someone else meanwhile: the key is routed elsewhere now.
    if (table->page_of(h) != page) return {};
    if (table->has_room(page, wanted)) return {};  // grown by someone else meanwhile
    // A split that separates nothing (keys of one hash) would only double the directory:
    // the page's chain gets a page more instead.
    if (table->split_separates(page, coming)) return table->split(page, *this);
    return table->add_overflow(page, *this);
  }
}

}  // namespace keel::kv
