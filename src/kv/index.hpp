#pragma once
// The index's hash table (doc/kv-format.md, "The index", "Growth"): bucket pages of 126
// entries under a directory, extendible hashing on the top bits of a key's hash. It works on
// the index's bytes alone (a base address and page numbers), so tests and fuzz/ can drive it
// over memory; the store maps the index file there and hands out pages.
//
// Concurrency: readers (lookup) take no lock and may run during any change. A writer changes a
// bucket page only while it holds that page's lock exclusively (the store's keel::lock entity
// of the page); a split also holds the `directory` lock. Entries are never emptied while a
// page is in use, so a reader's probe chain is never cut; a split copies into new pages and
// switches directory entries one 8-byte store at a time, so a reader that raced with it still
// finds the key in the old page, which is reused only once no snapshot can be reading it.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "keel/result.hpp"
#include "kv/format.hpp"

namespace keel::kv::index {

constexpr std::size_t page_size = 4096;
constexpr std::size_t entries_per_page = 126;
constexpr std::uint32_t bucket_magic = 0x4b435542;  // "BUCK"
//! In an entry's seq: a writer marked it and has not published (the rest names its block).
constexpr std::uint64_t pending = std::uint64_t{1} << 63;
//! Deepest directory: 2^max_depth entries.
constexpr unsigned max_depth = 40;
//! The most pages a chain may have (an index's pages).
constexpr std::uint64_t max_chain = std::uint64_t{1} << 24;

//! One entry: the key's hash, the location of its newest record (0: none yet, or undone) and
//! that record's seq (or pending | block location while a writer publishes).
struct entry_ref {
  std::uint64_t* w;
  [[nodiscard]] std::atomic_ref<std::uint64_t> hi() const noexcept { return std::atomic_ref(w[0]); }
  [[nodiscard]] std::atomic_ref<std::uint64_t> lo() const noexcept { return std::atomic_ref(w[1]); }
  [[nodiscard]] std::atomic_ref<std::uint64_t> location() const noexcept {
    return std::atomic_ref(w[2]);
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> seq() const noexcept {
    return std::atomic_ref(w[3]);
  }

  //! An entry's four words as one state.
  struct state {
    std::uint64_t hi = 0;
    std::uint64_t lo = 0;
    std::uint64_t location = 0;
    std::uint64_t seq = 0;
  };
  //! The entry as one state, for a reader holding no lock of its page: its words read between
  //! two reads of its seq that agree. A writer publishing stores the location before the seq,
  //! so a seq read before a publish with a location read after it would pair an older commit
  //! with a newer record. A key taking over an entry that held nothing changes its hash while
  //! its seq and location are 0, and names a record only after marking its seq: a state with
  //! a location has the hash of that record's key.
  [[nodiscard]] state read_whole() const noexcept {
    for (;;) {
      const std::uint64_t s = seq().load(std::memory_order_acquire);
      const state whole{hi().load(std::memory_order_acquire), lo().load(std::memory_order_acquire),
                        location().load(std::memory_order_acquire), s};
      if (seq().load(std::memory_order_acquire) == s) return whole;
    }
  }
};

//! A bucket page: 64 bytes of header, then its entries.
struct bucket_ref {
  std::byte* base;
  [[nodiscard]] std::atomic_ref<std::uint32_t> magic() const noexcept { return u32(0); }
  [[nodiscard]] std::atomic_ref<std::uint32_t> local_depth() const noexcept { return u32(4); }
  //! The top `local_depth` bits of `hi` every key of the page has.
  [[nodiscard]] std::atomic_ref<std::uint64_t> prefix() const noexcept { return u64(8); }
  [[nodiscard]] std::atomic_ref<std::uint64_t> used() const noexcept { return u64(16); }
  [[nodiscard]] std::atomic_ref<std::uint64_t> retired_at() const noexcept { return u64(24); }
  //! Once retired: the next page of the free list (0: none). Readers never look at it.
  [[nodiscard]] std::atomic_ref<std::uint64_t> next_free() const noexcept { return u64(32); }
  //! The sum (wrapping) of entry_sum over its entries: what lets an opener alone tell a
  //! damaged page from its data (see change_entry).
  [[nodiscard]] std::atomic_ref<std::uint64_t> sum() const noexcept { return u64(40); }
  //! 1 while a writer changes an entry and the sum: one left at 1 is a writer killed in the
  //! middle (its sum is counted again), not damage.
  [[nodiscard]] std::atomic_ref<std::uint64_t> changing() const noexcept { return u64(48); }
  //! The next page of its chain (0: none): where entries go when no split can separate them
  //! (keys of one hash; table::add_overflow), of the same depth and prefix, in no directory.
  [[nodiscard]] std::atomic_ref<std::uint64_t> overflow() const noexcept { return u64(56); }
  [[nodiscard]] entry_ref entry(std::size_t i) const noexcept {
    return {reinterpret_cast<std::uint64_t*>(base + 64 + i * 32)};
  }
  //! Each of its entries that holds a key, as one state (entry_ref::read_whole), with its
  //! place: f(k, entry, state) returns whether to go on. Every walk of a whole page's entries
  //! outside the table (scan, compaction, checkpoint, verify, recovery) reads it through here.
  //! Whether the walk went on to the end.
  template <class F>
  bool for_each_key(F&& f) const {
    for (std::size_t k = 0; k < entries_per_page; ++k) {
      const entry_ref e = entry(k);
      if (e.hi().load(std::memory_order_acquire) == 0) continue;
      const entry_ref::state whole = e.read_whole();
      if (whole.hi == 0) continue;
      if (!f(k, e, whole)) return false;
    }
    return true;
  }

 private:
  [[nodiscard]] std::atomic_ref<std::uint32_t> u32(std::size_t at) const noexcept {
    return std::atomic_ref(*reinterpret_cast<std::uint32_t*>(base + at));
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> u64(std::size_t at) const noexcept {
    return std::atomic_ref(*reinterpret_cast<std::uint64_t*>(base + at));
  }
};

//! What an entry adds to its page's sum: a bijective mix of its four words (so any one bit
//! changed changes it), 0 for an empty entry.
[[nodiscard]] std::uint64_t entry_sum(const entry_ref& e) noexcept;
//! A writer's change of entry `e` of page `b` (holding the page exclusively, or alone): runs
//! `change()`, which stores to the entry's words, keeping the page's sum right; the page
//! says it is changing meanwhile. Every change of an entry of a page in use goes through
//! here.
template <class Change>
void change_entry(const bucket_ref& b, const entry_ref& e, Change&& change) noexcept {
  b.changing().store(1, std::memory_order_relaxed);
  const std::uint64_t before = entry_sum(e);
  change();
  b.sum().store(b.sum().load(std::memory_order_relaxed) - before + entry_sum(e),
                std::memory_order_relaxed);
  b.changing().store(0, std::memory_order_release);
}
//! The sum of a page's entries, counted afresh.
[[nodiscard]] std::uint64_t count_sum(const bucket_ref& b) noexcept;

//! Pages of a directory of depth `depth`.
[[nodiscard]] std::size_t directory_pages(unsigned depth) noexcept;

//! The directory word of the index header: first page × 256 + global depth.
[[nodiscard]] constexpr std::uint64_t directory_word(std::uint64_t first_page,
                                                     unsigned depth) noexcept {
  return first_page << 8 | depth;
}

//! Where new pages come from, and where old ones go. The store grows the index file
//! (allocated before it is mapped) and reuses retired pages once no snapshot can read them.
class page_source {
 public:
  //! A run of `count` contiguous zeroed pages: the first page's number. Errors: the
  //! allocation's (no_space_on_device, ...).
  [[nodiscard]] virtual result<std::uint64_t> allocate(std::size_t count) noexcept = 0;
  //! Pages no longer reachable from the directory, to reuse when safe.
  virtual void retire(std::uint64_t first, std::size_t count) noexcept = 0;
  //! Pages `allocate` gave that were never made reachable: reusable at once.
  virtual void release(std::uint64_t first, std::size_t count) noexcept = 0;

 protected:
  ~page_source() = default;
};

//! A new index's depth: 64 bucket pages (256 KiB). A thousand writers putting new keys into
//! one page, splitting it under the directory lock, queued on so few locks that a holder
//! preempted among a thousand runnable processes held the rest past their 30 s timeout (ext4
//! blurt: up to 474 of 1000 tasks failed in the first round).
//! A variable for tests that split the one page of a new index on purpose (they set 0).
inline unsigned initial_depth = 6;

//! For tests: called after each directory entry a split switches (to kill a splitter there).
inline void (*split_hook)() noexcept = nullptr;
//! For tests: called by page_of between its loads of the directory word and of the entry it
//! names (to change the index file there).
inline void (*directory_hook)() noexcept = nullptr;

//! A split in progress: the page being split and its two halves. Written (old last) before
//! the first directory entry is switched, cleared once the last one is. old 0: none.
struct split_journal {
  std::uint64_t old = 0, low = 0, high = 0;
  friend bool operator==(const split_journal&, const split_journal&) = default;
};

//! The table over an index mapped at `base`, whose directory word lives at `directory` and
//! whose split journal is the three words at `journal` (old, low, high).
class table {
 public:
  table(std::byte* base, std::atomic_ref<std::uint64_t> directory, std::uint64_t* journal) noexcept
      : base_(base), directory_(directory), journal_(journal) {}

  //! Makes the first directory (depth 0) and its one bucket page. For an empty index.
  [[nodiscard]] result<void> create(page_source& pages) noexcept;

  [[nodiscard]] bucket_ref page(std::uint64_t n) const noexcept { return {base_ + n * page_size}; }
  //! The bucket page a key's hash belongs to, as the directory says now.
  [[nodiscard]] std::uint64_t page_of(const disk::key_hash& h) const noexcept;

  //! Calls `f(page number)` (returning false to stop) for page `p` and each page of its
  //! overflow chain, in order.
  template <class F>
  void for_page_chain(std::uint64_t p, F&& f) const noexcept {
    // Bounded by the index's size: a damaged link never loops for ever.
    for (std::uint64_t q = p, hops = 0; q != 0 && hops < max_chain;
         q = page(q).overflow().load(std::memory_order_acquire), ++hops) {
      if (!f(q)) return;
    }
  }

  //! Visits the bucket pages one directory word names, in directory order from the entry of
  //! hash prefix `from_hi` (0: the first), each run of entries naming one page once, each
  //! followed by the pages of its overflow chain (`chains`; else the caller walks a chain
  //! itself, for_page_chain); `visit(page)` returns result<bool> (false: stop there). The
  //! word is read once: pages a split retires meanwhile still hold their entries, as long as
  //! the caller holds a snapshot taken before (the store's snapshot_hold, or a
  //! transaction's), which keeps them from reuse.
  template <class Visit>
  result<void> for_each_page(std::uint64_t from_hi, Visit&& visit, bool chains = true) const {
    const std::uint64_t word = directory_.load(std::memory_order_seq_cst);
    const unsigned depth = static_cast<unsigned>(word & 0xff);
    const std::uint64_t n = std::uint64_t{1} << depth;
    std::uint64_t last = 0;
    for (std::uint64_t i = depth == 0 ? 0 : from_hi >> (64 - depth); i < n; ++i) {
      const std::uint64_t p = directory_entry(word >> 8, i).load(std::memory_order_seq_cst);
      if (p == last) continue;
      last = p;
      result<bool> go = true;
      for_page_chain(p, [&](std::uint64_t q) {
        go = visit(q);
        return go && *go && chains;
      });
      if (!go) return std::unexpected(go.error());
      if (!*go) return {};
    }
    return {};
  }

  //! The one walk of a probe chain: calls `visit(entry)` (returning false to stop) for each
  //! entry of hash `h` in page `p`, from the hash's home slot on, wrapping, up to the first
  //! empty entry (`hi` = 0), and on into the next page of the page's chain when a page has
  //! none (entries go there only once a page is full). Entries are never emptied while a
  //! page is in use, so the walk meets every entry an insert of `h` could have taken. Which
  //! entry is which key's is the store's to decide (kv/probe.cpp): two keys may share a hash.
  template <class Visit>
  void for_chain(std::uint64_t p, const disk::key_hash& h, Visit&& visit) const noexcept {
    const std::size_t start = h.lo % entries_per_page;
    bool go_on = true;
    for_page_chain(p, [&](std::uint64_t q) {
      const bucket_ref b = page(q);
      for (std::size_t k = 0; k < entries_per_page; ++k) {
        const entry_ref e = b.entry((start + k) % entries_per_page);
        const std::uint64_t hi = e.hi().load(std::memory_order_acquire);
        if (hi == 0) return false;  // the end of the probe
        if (hi != h.hi || e.lo().load(std::memory_order_acquire) != h.lo) continue;
        if (!visit(e)) return go_on = false;
      }
      return go_on;
    });
  }

  //! A hint, for a writer about to lock page `p` for a key of hash `h`: the page's header and
  //! the hash's home entry are fetched into the cache meanwhile, the two misses overlapping
  //! the lock's rather than following it one by one. Reads nothing.
  void prefetch_for_write(std::uint64_t p, const disk::key_hash& h) const noexcept {
    const bucket_ref b = page(p);
    __builtin_prefetch(b.base, 1);
    __builtin_prefetch(b.entry(h.lo % entries_per_page).w, 1);
  }

  //! A hint, for a reader about to take its snapshot and look up a key of hash `h`: the home
  //! entry of the page the directory names now is fetched into the cache meanwhile. Safe with
  //! no snapshot held: a directory page retired and reused meanwhile gives a wrong page
  //! number, whose address (computed unsigned, never dereferenced) a prefetch never faults on.
  //! Its caller keeps the file from being cut short meanwhile (page_of reads the directory).
  void prefetch_for_read(const disk::key_hash& h) const noexcept {
    const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(base_) + page_of(h) * page_size +
                              64 + (h.lo % entries_per_page) * 32;
    __builtin_prefetch(reinterpret_cast<const void*>(at));
  }

  //! The page that holds entry `e`.
  [[nodiscard]] bucket_ref page_holding(const entry_ref& e) const noexcept {
    const auto at = static_cast<std::size_t>(reinterpret_cast<const std::byte*>(e.w) - base_);
    return page(at / page_size);
  }
  //! Entries a page's chain can still take (empty, or holding nothing).
  [[nodiscard]] std::size_t room(std::uint64_t p) const noexcept;
  //! Whether room(p) >= wanted, mostly without counting entries.
  [[nodiscard]] bool has_room(std::uint64_t p, std::size_t wanted) const noexcept;
  //! Whether splitting page `p` separates anything: its chain's entries that hold something,
  //! and keys of `hashes` (about to be added), are not all on one side of the next bit. A
  //! split that does not would only double the directory (keys of one hash): the page gets
  //! an overflow page instead (add_overflow).
  [[nodiscard]] bool split_separates(std::uint64_t p,
                                     std::span<const disk::key_hash> hashes) const noexcept;
  //! Adds an empty page at the end of page `p`'s chain (the caller holds `p` exclusively and
  //! the directory lock). Errors: the allocation's.
  [[nodiscard]] result<void> add_overflow(std::uint64_t p, page_source& pages) noexcept;

  //! Writers, holding page `p` exclusively, for a key of hash `h` that has no entry there:
  //! the first entry of its probe order that is empty or holds nothing (location 0, seq 0:
  //! an undone insert, or an erased key compaction forgot), made the key's with `location`
  //! and `seq`. A reader of either hash never takes it for its own meanwhile: an empty
  //! entry gets its seq and location before its hash (counted in the page's *used* first:
  //! a writer killed in between leaves the page counted one too full, never one short); one
  //! that holds nothing gets the new hash while it still holds nothing, then its location,
  //! then its seq (release). nullopt: the page has no room (split it).
  [[nodiscard]] std::optional<entry_ref> claim(std::uint64_t p, const disk::key_hash& h,
                                               std::uint64_t location,
                                               std::uint64_t seq) const noexcept;

  //! Splits page `p` (held exclusively by the caller, with the directory lock) into two
  //! pages by the next bit of `hi`, doubling the directory first if it must, each half with
  //! an overflow chain when its entries need one. Entries that hold nothing (location 0, not
  //! pending) are left behind. The old page (and an old
  //! directory) go to `pages.retire`. Errors: the allocation's; when the
  //! page is at max_depth: file_too_large (2^40 directory entries). Nothing is changed on error.
  //! No split may be pending (finish_split first).
  //!
  //! The directory entries that named `p` are switched one 8-byte store at a time, so a
  //! splitter that dies leaves some naming `p` and some naming a half, with the journal
  //! saying so. Until finish_split, nobody may change `p` or either half: a key's newest
  //! version must stay in both the copy its entry names now and the one it will name.
  [[nodiscard]] result<void> split(std::uint64_t p, page_source& pages) noexcept;

  //! Whether the pages the directory names look like what writers left (an opener alone
  //! asks, before it uses an index it did not build): each a bucket page among the first
  //! `pages_used`, of a depth and prefix that fit where the directory names it, and whose
  //! entries add up to its sum (a page a writer was killed changing is counted again).
  //! False: damage, the index must be rebuilt.
  [[nodiscard]] bool pages_sound(std::uint64_t first_page, std::uint64_t pages_used) noexcept;

  //! The pages splits may add while `keys` new keys of uniform hashes come in: for each page
  //! the directory names, the entries it holds (an emptied one is free) and the keys its
  //! share of the hashes brings (about
  //! Poisson): a page sure to pass a page's entries is halved until each half fits one, the
  //! others add the chance they split, and the sum three standard deviations and two. An estimate,
  //! read racily (pages writers change meanwhile are read as they are); keys of one hash, or
  //! a page's overflow chain, are not foreseen. Pages at or past `pages_used` (loaded after
  //! the directory word, so that a directory just doubled is within it) are not read (a
  //! directory that reaches there: `keys`, a page a key).
  [[nodiscard]] std::uint64_t pages_for_keys(
      std::uint64_t keys, std::atomic_ref<const std::uint64_t> pages_used) const noexcept;

  //! The split in progress, if any (old 0: none).
  [[nodiscard]] split_journal pending_split() const noexcept;
  //! Finishes the pending split a dead splitter left, if any: switches the directory
  //! entries that still name the old page, clears the journal, retires the old page. The
  //! caller holds the directory lock and the old page and both halves exclusively (or is
  //! alone). Idempotent: a finisher that dies is replaced by the next.
  void finish_split(page_source& pages) noexcept;

  [[nodiscard]] unsigned depth() const noexcept {
    return static_cast<unsigned>(directory_.load(std::memory_order_acquire) & 0xff);
  }

 private:
  [[nodiscard]] std::atomic_ref<std::uint64_t> directory_entry(std::uint64_t first,
                                                               std::uint64_t i) const noexcept;

  [[nodiscard]] std::atomic_ref<std::uint64_t> journal(std::size_t i) const noexcept {
    return std::atomic_ref(journal_[i]);
  }
  // Points the directory entries of the page `old` describes, still naming it, at its halves.
  void switch_entries(const bucket_ref& old, std::uint64_t low, std::uint64_t high) noexcept;

  std::byte* base_;
  std::atomic_ref<std::uint64_t> directory_;
  std::uint64_t* journal_;
};

}  // namespace keel::kv::index
