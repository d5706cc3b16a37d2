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

#include "keel/result.hpp"
#include "kv/format.hpp"

namespace keel::kv::ix {

constexpr std::size_t page_size = 4096;
constexpr std::size_t entries_per_page = 126;
constexpr std::uint32_t bucket_magic = 0x4b435542;  // "BUCK"
//! In an entry's seq: a writer marked it and has not published (the rest names its block).
constexpr std::uint64_t pending = std::uint64_t{1} << 63;
//! Deepest directory: 2^max_depth entries.
constexpr unsigned max_depth = 40;

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
  [[nodiscard]] entry_ref entry(std::size_t i) const noexcept {
    return {reinterpret_cast<std::uint64_t*>(base + 64 + i * 32)};
  }

 private:
  [[nodiscard]] std::atomic_ref<std::uint32_t> u32(std::size_t at) const noexcept {
    return std::atomic_ref(*reinterpret_cast<std::uint32_t*>(base + at));
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> u64(std::size_t at) const noexcept {
    return std::atomic_ref(*reinterpret_cast<std::uint64_t*>(base + at));
  }
};

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
  [[nodiscard]] std::uint64_t page_of(const fmt::key_hash& h) const noexcept;

  //! Readers: the entry of `h` whose record is the key (`same_key(location)` says so), in
  //! page `p`. None: the key has no entry (or only one still being inserted).
  template <class SameKey>
  [[nodiscard]] std::optional<entry_ref> lookup(std::uint64_t p, const fmt::key_hash& h,
                                                SameKey&& same_key) const noexcept {
    const bucket_ref b = page(p);
    const std::size_t start = h.lo % entries_per_page;
    for (std::size_t k = 0; k < entries_per_page; ++k) {
      const entry_ref e = b.entry((start + k) % entries_per_page);
      const std::uint64_t hi = e.hi().load(std::memory_order_acquire);
      if (hi == 0) return std::nullopt;  // the end of the probe: entries are never emptied
      if (hi != h.hi || e.lo().load(std::memory_order_acquire) != h.lo) continue;
      const std::uint64_t at = e.location().load(std::memory_order_acquire);
      if (at != 0 && same_key(at)) return e;
    }
    return std::nullopt;
  }

  //! Writers, holding page `p` exclusively: the entry for the key, taking an empty one (or
  //! one whose insert was undone) if it has none; nullopt when the page has no room (split
  //! it, then look again in the page the directory then names). An entry whose seq is
  //! pending is returned as it is, even one with no location yet: the caller resolves it
  //! (doc/kv-format.md, "Dead users") and asks again.
  template <class SameKey>
  [[nodiscard]] std::optional<entry_ref> entry_for(std::uint64_t p, const fmt::key_hash& h,
                                                   SameKey&& same_key) const noexcept {
    const bucket_ref b = page(p);
    const std::size_t start = h.lo % entries_per_page;
    std::optional<entry_ref> reusable;
    for (std::size_t k = 0; k < entries_per_page; ++k) {
      const entry_ref e = b.entry((start + k) % entries_per_page);
      const std::uint64_t hi = e.hi().load();
      if (hi == 0) {
        if (reusable) return reusable;
        e.lo().store(h.lo);
        b.used().fetch_add(1);  // first: killed in between, the page counts one too many
        e.hi().store(h.hi, std::memory_order_release);  // readers check hi first, then lo
        return e;
      }
      if (hi != h.hi || e.lo().load() != h.lo) continue;
      const std::uint64_t at = e.location().load();
      if (at == 0) {
        // Taken for this hash and never published. Pending: a dead writer's insert, maybe of
        // this key, that the caller must resolve before anything else (never a second entry
        // beside it). Otherwise undone: reusable, if the key has no entry further on.
        if ((e.seq().load() & pending) != 0) return e;
        if (!reusable) reusable = e;
        continue;
      }
      if (same_key(at)) return e;
    }
    return reusable;
  }

  //! Splits page `p` (held exclusively by the caller, with the directory lock) into two
  //! pages by the next bit of `hi`, doubling the directory first if it must. Entries that
  //! hold nothing (location 0, not pending) are left behind. The old page (and an old
  //! directory) go to `pages.retire`. Errors: the allocation's; when the
  //! page is at max_depth: file_too_large (2^40 directory entries). Nothing is changed on error.
  //! No split may be pending (finish_split first).
  //!
  //! The directory entries that named `p` are switched one 8-byte store at a time, so a
  //! splitter that dies leaves some naming `p` and some naming a half, with the journal
  //! saying so. Until finish_split, nobody may change `p` or either half: a key's newest
  //! version must stay in both the copy its entry names now and the one it will name.
  [[nodiscard]] result<void> split(std::uint64_t p, page_source& pages) noexcept;

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

}  // namespace keel::kv::ix
