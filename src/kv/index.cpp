// The index's hash table (index.hpp, doc/kv-format.md "The index", "Growth"): claiming an
// entry, splitting a page, doubling the directory, overflow chains, and the checks an opener
// makes. Writes bucket pages and the directory; the store decides which entry is which key's
// (probe.cpp).

#include "kv/index.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numbers>
#include <system_error>
#include <vector>

namespace keel::kv::index {
namespace {

constexpr std::size_t words_per_page = page_size / sizeof(std::uint64_t);

void init_bucket(const bucket_ref& b, unsigned depth, std::uint64_t prefix) noexcept {
  b.local_depth().store(depth);
  b.prefix().store(prefix);
  b.used().store(0);
  b.retired_at().store(0);
  b.sum().store(0);
  b.changing().store(0);
  b.overflow().store(0);
  b.magic().store(bucket_magic, std::memory_order_release);
}

std::uint64_t fmix(std::uint64_t k) noexcept {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

std::uint64_t rotl(std::uint64_t v, unsigned r) noexcept {
  return (v << r) | (v >> (64 - r));
}

// Places a copy of an entry in a page being filled (nobody reads it yet): from its home slot
// on, the first empty one. A page split into two never overflows: each gets at most what
// the old page held.
bool place(const bucket_ref& b, std::uint64_t hi, std::uint64_t lo, std::uint64_t location,
           std::uint64_t seq) noexcept {
  const std::size_t start = lo % entries_per_page;
  for (std::size_t k = 0; k < entries_per_page; ++k) {
    const entry_ref e = b.entry((start + k) % entries_per_page);
    if (e.hi().load(std::memory_order_relaxed) != 0) continue;
    e.lo().store(lo, std::memory_order_relaxed);
    e.location().store(location, std::memory_order_relaxed);
    e.seq().store(seq, std::memory_order_relaxed);
    e.hi().store(hi, std::memory_order_relaxed);
    b.used().fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  return false;
}

// Whether an entry holds something: a location, or a writer's pending mark.
bool holds_something(const entry_ref& e) noexcept {
  return e.hi().load() != 0 && (e.location().load() != 0 || (e.seq().load() & pending) != 0);
}

}  // namespace

std::uint64_t entry_sum(const entry_ref& e) noexcept {
  return fmix(e.hi().load(std::memory_order_relaxed) ^
              rotl(e.lo().load(std::memory_order_relaxed), 16) ^
              rotl(e.location().load(std::memory_order_relaxed), 32) ^
              rotl(e.seq().load(std::memory_order_relaxed), 48));
}

std::uint64_t count_sum(const bucket_ref& b) noexcept {
  std::uint64_t sum = 0;
  for (std::size_t k = 0; k < entries_per_page; ++k)
    sum += entry_sum(b.entry(k));
  return sum;
}

bool table::pages_sound(std::uint64_t first_page, std::uint64_t pages_used) noexcept {
  const std::uint64_t dir = directory_.load(std::memory_order_acquire);
  const unsigned global = static_cast<unsigned>(dir & 0xff);
  std::uint64_t last = 0;
  for (std::uint64_t i = 0; i < (std::uint64_t{1} << global); ++i) {
    const std::uint64_t p = directory_entry(dir >> 8, i).load(std::memory_order_acquire);
    if (p < first_page || p >= pages_used) return false;
    const bucket_ref b = page(p);
    const unsigned local = b.local_depth().load();
    if (b.magic().load() != bucket_magic || local > global ||
        (local != 0 && (i >> (global - local)) != b.prefix().load())) {
      return false;
    }
    if (p == last) continue;
    last = p;
    bool sound = true;
    for_page_chain(p, [&](std::uint64_t q) {
      const bucket_ref c = page(q);
      if (q < first_page || q >= pages_used || c.magic().load() != bucket_magic ||
          c.local_depth().load() != local || c.prefix().load() != b.prefix().load()) {
        return sound = false;
      }
      const std::uint64_t counted = count_sum(c);
      if (c.changing().load() != 0) {
        c.sum().store(counted);  // its writer was killed in the middle: what is there stands
        c.changing().store(0);
      } else if (c.sum().load() != counted) {
        return sound = false;
      }
      return true;
    });
    if (!sound) return false;
  }
  return true;
}

std::size_t directory_pages(unsigned depth) noexcept {
  const std::size_t words = std::size_t{1} << depth;
  return (words + words_per_page - 1) / words_per_page;
}

std::atomic_ref<std::uint64_t> table::directory_entry(std::uint64_t first,
                                                      std::uint64_t i) const noexcept {
  return std::atomic_ref(*reinterpret_cast<std::uint64_t*>(base_ + first * page_size + i * 8));
}

result<void> table::create(page_source& pages) noexcept {
  auto dir = pages.allocate(directory_pages(initial_depth));
  if (!dir) return std::unexpected(dir.error());
  const std::uint64_t n = std::uint64_t{1} << initial_depth;
  auto buckets = pages.allocate(n);
  if (!buckets) {
    pages.release(*dir, directory_pages(initial_depth));
    return std::unexpected(buckets.error());
  }
  for (std::uint64_t i = 0; i < n; ++i) {
    init_bucket(page(*buckets + i), initial_depth, i);
    directory_entry(*dir, i).store(*buckets + i, std::memory_order_release);
  }
  directory_.store(directory_word(*dir, initial_depth), std::memory_order_release);
  return {};
}

std::uint64_t table::pages_for_keys(std::uint64_t keys,
                                    std::atomic_ref<const std::uint64_t> used_word) const noexcept {
  const std::uint64_t dir = directory_.load(std::memory_order_acquire);
  const std::uint64_t pages_used = used_word.load(std::memory_order_acquire);
  const unsigned global = static_cast<unsigned>(dir & 0xff);
  const std::uint64_t first = dir >> 8;
  if (global > max_depth || first + directory_pages(global) > pages_used) return keys;
  const std::uint64_t entries = std::uint64_t{1} << global;
  // Pages sure to split (perhaps more than once), and for the rest the expected number that
  // split and its variance (each a Bernoulli draw: the keys a page gets are about Poisson).
  std::uint64_t sure = 0;
  double expected = 0;
  double variance = 0;
  const double full = static_cast<double>(entries_per_page);
  for (std::uint64_t i = 0; i < entries;) {
    const std::uint64_t p = directory_entry(first, i).load(std::memory_order_acquire);
    if (p == 0 || p >= pages_used) {
      ++i;
      continue;
    }
    const bucket_ref b = page(p);
    // A page of local depth d is named by 2^(global - d) entries in a row, aligned.
    const unsigned local =
        std::min<unsigned>(b.local_depth().load(std::memory_order_relaxed), global);
    const std::uint64_t run = std::uint64_t{1} << (global - local);
    const double share = std::ldexp(static_cast<double>(keys), -static_cast<int>(local));
    std::uint64_t used =
        std::min<std::uint64_t>(b.used().load(std::memory_order_relaxed), entries_per_page);
    const double sigma = std::sqrt(share);
    if (static_cast<double>(used) + share + 0.5 > full - 3 * sigma) {
      // Near full by its claimed entries: counted by what they hold. An erased key compaction
      // forgot leaves its entry claimed and empty, and any key takes it (counted as used, a
      // store refilled after its keys were erased held back room for a wave of splits that
      // never came: 179 pages for a 256 KiB segment, on a 6 MiB volume).
      used = 0;
      for (std::size_t k = 0; k < entries_per_page; ++k)
        used += holds_something(b.entry(k)) ? 1 : 0;
    }
    const double after = static_cast<double>(used) + share;
    if (after + 0.5 > full + 3 * sigma) {
      const auto halves = static_cast<std::uint64_t>(std::ceil((after + 3 * sigma) / full));
      sure += std::bit_ceil(std::max<std::uint64_t>(halves, 2)) - 1;
    } else if (sigma > 0) {
      const double chance = 0.5 * std::erfc((full + 0.5 - after) / (sigma * std::numbers::sqrt2));
      expected += chance;
      variance += chance * (1 - chance);
    }
    i = (i / run + 1) * run;
  }
  return sure + static_cast<std::uint64_t>(std::ceil(expected + 3 * std::sqrt(variance) + 2));
}

std::uint64_t table::page_of(const disk::key_hash& h) const noexcept {
  // Sequentially consistent (a plain load on x86 and ARMv8 alike), as are the switch's
  // stores: a reader's snapshot is published by a seq_cst store before this, and whoever
  // reuses a retired page reads the snapshots with seq_cst loads after the switch
  // (store::impl::reuse_horizon).
  const std::uint64_t dir = directory_.load(std::memory_order_seq_cst);
  if (directory_hook != nullptr) [[unlikely]]
    directory_hook();
  const unsigned depth = static_cast<unsigned>(dir & 0xff);
  const std::uint64_t i = depth == 0 ? 0 : h.hi >> (64 - depth);
  return directory_entry(dir >> 8, i).load(std::memory_order_seq_cst);
}

std::optional<entry_ref> table::claim(std::uint64_t p, const disk::key_hash& h,
                                      std::uint64_t location, std::uint64_t seq) const noexcept {
  const std::size_t start = h.lo % entries_per_page;
  std::optional<entry_ref> out;
  for_page_chain(p, [&](std::uint64_t q) {
    const bucket_ref b = page(q);
    for (std::size_t k = 0; k < entries_per_page; ++k) {
      const entry_ref e = b.entry((start + k) % entries_per_page);
      const std::uint64_t hi = e.hi().load();
      if (hi == 0) {
        change_entry(b, e, [&] {
          e.seq().store(seq);
          e.location().store(location);
          e.lo().store(h.lo);
          b.used().fetch_add(1);
          e.hi().store(h.hi, std::memory_order_release);  // readers check hi first, then lo
        });
        out = e;
        return false;
      }
      // One that holds nothing (as holds_something counts room): emptied, also half way (a
      // compactor killed between the location's store and the seq's left an old seq).
      if (e.location().load() == 0 && (e.seq().load() & pending) == 0) {
        change_entry(b, e, [&] {
          if (hi != h.hi || e.lo().load() != h.lo) {
            e.lo().store(h.lo);
            e.hi().store(h.hi, std::memory_order_release);
          }
          e.location().store(location, std::memory_order_release);
          e.seq().store(seq, std::memory_order_release);
        });
        out = e;
        return false;
      }
    }
    return true;  // full: on into the next page of the chain
  });
  return out;
}

bool table::has_room(std::uint64_t p, std::size_t wanted) const noexcept {
  // Every commit asks: first by the pages' counts of used entries (an entry counted used may
  // hold nothing, which room() counts as free too).
  std::size_t sure = 0;
  for_page_chain(p, [&](std::uint64_t q) {
    const std::uint64_t used = page(q).used().load();
    sure += used < entries_per_page ? entries_per_page - used : 0;
    return sure < wanted;
  });
  return sure >= wanted || room(p) >= wanted;
}

std::size_t table::room(std::uint64_t p) const noexcept {
  std::size_t free = 0;
  for_page_chain(p, [&](std::uint64_t q) {
    const bucket_ref b = page(q);
    for (std::size_t k = 0; k < entries_per_page; ++k)
      free += holds_something(b.entry(k)) ? 0 : 1;
    return true;
  });
  return free;
}

bool table::split_separates(std::uint64_t p,
                            std::span<const disk::key_hash> hashes) const noexcept {
  const unsigned local = page(p).local_depth().load();
  if (local >= max_depth) return false;
  bool side[2] = {false, false};
  const auto bit = [&](std::uint64_t hi) { return ((hi >> (63 - local)) & 1) != 0; };
  for (const disk::key_hash& h : hashes)
    side[bit(h.hi) ? 1 : 0] = true;
  for_page_chain(p, [&](std::uint64_t q) {
    const bucket_ref b = page(q);
    for (std::size_t k = 0; k < entries_per_page; ++k) {
      const entry_ref e = b.entry(k);
      if (holds_something(e)) side[bit(e.hi().load()) ? 1 : 0] = true;
    }
    return !(side[0] && side[1]);
  });
  return side[0] && side[1];
}

result<void> table::add_overflow(std::uint64_t p, page_source& pages) noexcept {
  auto q = pages.allocate(1);
  if (!q) return std::unexpected(q.error());
  const bucket_ref base = page(p);
  init_bucket(page(*q), base.local_depth().load(), base.prefix().load());
  std::uint64_t last = p;
  for_page_chain(p, [&](std::uint64_t r) {
    last = r;
    return true;
  });
  // Whole before it is linked: a reader that follows the link finds an empty page.
  page(last).overflow().store(*q, std::memory_order_release);
  return {};
}

result<void> table::split(std::uint64_t p, page_source& pages) noexcept {
  const bucket_ref old = page(p);
  const unsigned local = old.local_depth().load();
  if (local >= max_depth) return errc_error(std::errc::file_too_large);
  const auto upper = [&](std::uint64_t hi) { return ((hi >> (63 - local)) & 1) != 0; };
  // The pages each half needs: its entries (of the whole chain) that hold something.
  std::uint64_t count[2] = {0, 0};
  for_page_chain(p, [&](std::uint64_t q) {
    const bucket_ref b = page(q);
    for (std::size_t k = 0; k < entries_per_page; ++k) {
      const entry_ref e = b.entry(k);
      if (holds_something(e)) ++count[upper(e.hi().load()) ? 1 : 0];
    }
    return true;
  });
  // Every page first (nothing is changed when one cannot be had): the halves' chains.
  std::vector<std::uint64_t> made[2];
  const auto give_back = [&] {
    for (const auto& side : made) {
      for (const std::uint64_t q : side)
        pages.release(q, 1);
    }
  };
  try {
    for (int side = 0; side < 2; ++side) {
      const std::uint64_t need =
          std::max<std::uint64_t>(1, (count[side] + entries_per_page - 1) / entries_per_page);
      for (std::uint64_t i = 0; i < need; ++i) {
        auto q = pages.allocate(1);
        if (!q) {
          give_back();
          return std::unexpected(q.error());
        }
        made[side].push_back(*q);
      }
    }
  } catch (const std::bad_alloc&) {
    give_back();
    return errc_error(std::errc::not_enough_memory);
  }
  const std::uint64_t low = made[0].front();
  const std::uint64_t high = made[1].front();
  const std::uint64_t dir = directory_.load(std::memory_order_acquire);
  const unsigned global = static_cast<unsigned>(dir & 0xff);
  const std::uint64_t first = dir >> 8;
  if (local == global) {
    // Double the directory: each entry i of the old one becomes entries 2i and 2i + 1 of
    // the new one, published by one store of the directory word.
    auto bigger = pages.allocate(directory_pages(global + 1));
    if (!bigger) {
      give_back();
      return std::unexpected(bigger.error());
    }
    const std::uint64_t n = std::uint64_t{1} << global;
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint64_t v = directory_entry(first, i).load(std::memory_order_relaxed);
      directory_entry(*bigger, 2 * i).store(v, std::memory_order_relaxed);
      directory_entry(*bigger, 2 * i + 1).store(v, std::memory_order_relaxed);
    }
    directory_.store(directory_word(*bigger, global + 1), std::memory_order_seq_cst);
    pages.retire(first, directory_pages(global));
  }
  // The two halves, by bit `local` from the top of hi, filled before anyone can see them.
  const std::uint64_t prefix = old.prefix().load();
  for (int side = 0; side < 2; ++side) {
    for (std::size_t i = 0; i < made[side].size(); ++i) {
      const bucket_ref b = page(made[side][i]);
      init_bucket(b, local + 1, (prefix << 1) | static_cast<std::uint64_t>(side));
      if (i + 1 < made[side].size()) b.overflow().store(made[side][i + 1]);
    }
  }
  for_page_chain(p, [&](std::uint64_t q) {
    const bucket_ref b = page(q);
    for (std::size_t k = 0; k < entries_per_page; ++k) {
      const entry_ref e = b.entry(k);
      if (!holds_something(e)) continue;  // an undone insert is left behind
      const std::uint64_t hi = e.hi().load();
      for (const std::uint64_t to : made[upper(hi) ? 1 : 0]) {
        if (place(page(to), hi, e.lo().load(), e.location().load(), e.seq().load())) break;
      }
    }
    return true;
  });
  for (const auto& side : made) {
    for (const std::uint64_t q : side)
      page(q).sum().store(count_sum(page(q)));
  }
  // The journal, before the first switch: a writer routed to a half by a switched entry
  // sees it, and so does whoever takes the old page after a splitter died.
  journal(1).store(low, std::memory_order_relaxed);
  journal(2).store(high, std::memory_order_relaxed);
  journal(0).store(p, std::memory_order_seq_cst);
  finish_split(pages);
  return {};
}

split_journal table::pending_split() const noexcept {
  split_journal j;
  j.old = journal(0).load(std::memory_order_acquire);
  if (j.old == 0) return {};
  j.low = journal(1).load(std::memory_order_relaxed);
  j.high = journal(2).load(std::memory_order_relaxed);
  return j;
}

void table::switch_entries(const bucket_ref& old, std::uint64_t low, std::uint64_t high) noexcept {
  // The directory entries of the old page: a run of 2^(global - local), whose first half
  // names the low page and second half the high one once switched. Each is one store; a
  // reader between them finds its key in the old page or in the new one, both complete.
  const std::uint64_t dir = directory_.load(std::memory_order_acquire);
  const unsigned global = static_cast<unsigned>(dir & 0xff);
  const std::uint64_t first = dir >> 8;
  const unsigned spread = global - old.local_depth().load();
  const std::uint64_t begin = old.prefix().load() << spread;
  const std::uint64_t half = std::uint64_t{1} << (spread - 1);
  for (std::uint64_t i = 0; i < 2 * half; ++i) {
    // seq_cst, like the readers' loads and the reuser's (store::impl::reuse_horizon): a
    // reader that publishes its snapshot after the reuser looked at the slots sees this.
    directory_entry(first, begin + i).store(i < half ? low : high, std::memory_order_seq_cst);
    if (split_hook != nullptr) split_hook();
  }
}

void table::finish_split(page_source& pages) noexcept {
  const split_journal j = pending_split();
  if (j.old == 0) return;
  switch_entries(page(j.old), j.low, j.high);
  // Cleared before the old page is retired: a finisher that dies between the two leaks one
  // page rather than retiring it twice.
  journal(0).store(0, std::memory_order_seq_cst);
  // The old page and its chain (their links are read before they are retired: a retired
  // page's free-list link is another word).
  std::vector<std::uint64_t> chain;
  try {
    for_page_chain(j.old, [&](std::uint64_t q) {
      chain.push_back(q);
      return true;
    });
  } catch (const std::bad_alloc&) {
    chain.assign(1, j.old);  // the rest leak, never reused twice
  }
  for (const std::uint64_t q : chain)
    pages.retire(q, 1);
}

}  // namespace keel::kv::index
