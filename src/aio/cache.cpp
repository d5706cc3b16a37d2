// The write-back cache (see cache.hpp for the design).

#include "cache.hpp"

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <limits>
#include <new>
#include <span>
#include <vector>

#include "base/planted.hpp"
#include "detail.hpp"

namespace keel::aio::detail {
namespace {

// ---- a file's list of pages by last write (under its mutex) ----

void unlink_page(file_cache& fc, cache_page& p) noexcept KEEL_REQUIRES(fc.mutex) {
  (p.older != nullptr ? p.older->newer : fc.oldest) = p.newer;
  (p.newer != nullptr ? p.newer->older : fc.newest) = p.older;
  p.older = p.newer = nullptr;
}

void link_newest(file_cache& fc, cache_page& p) noexcept KEEL_REQUIRES(fc.mutex) {
  p.older = fc.newest;
  p.newer = nullptr;
  (fc.newest != nullptr ? fc.newest->newer : fc.oldest) = &p;
  fc.newest = &p;
}

// The list of dirty pages (so that write-outs never walk clean ones).
void mark_dirty(file_cache& fc, cache_page& p) noexcept KEEL_REQUIRES(fc.mutex) {
  p.prev_dirty = nullptr;
  p.next_dirty = fc.dirty;
  if (fc.dirty != nullptr) fc.dirty->prev_dirty = &p;
  fc.dirty = &p;
  ++fc.dirty_pages;
}

void mark_clean(file_cache& fc, cache_page& p) noexcept KEEL_REQUIRES(fc.mutex) {
  (p.prev_dirty != nullptr ? p.prev_dirty->next_dirty : fc.dirty) = p.next_dirty;
  if (p.next_dirty != nullptr) p.next_dirty->prev_dirty = p.prev_dirty;
  p.next_dirty = p.prev_dirty = nullptr;
  p.dirty.clear();
  --fc.dirty_pages;
}

bool by_offset(const cache_page* x, const cache_page* y) noexcept {
  return x->offset < y->offset;
}

// Puts `neu` where `old` is in the file's lists.
void take_place(file_cache& fc, cache_page& old, cache_page& neu) noexcept {
  neu.older = old.older;
  neu.newer = old.newer;
  (old.older != nullptr ? old.older->newer : fc.oldest) = &neu;
  (old.newer != nullptr ? old.newer->older : fc.newest) = &neu;
  if (old.dirty.any()) {
    neu.prev_dirty = old.prev_dirty;
    neu.next_dirty = old.next_dirty;
    (old.prev_dirty != nullptr ? old.prev_dirty->next_dirty : fc.dirty) = &neu;
    if (old.next_dirty != nullptr) old.next_dirty->prev_dirty = &neu;
  }
  old.older = old.newer = old.prev_dirty = old.next_dirty = nullptr;
}

void wake_flusher(cache_control& cc) noexcept {
  cc.signal.fetch_add(1);
  base::futex_wake(cc.signal, 1);
}

// The part of page `p` that [offset, end) covers, as page-relative [lo, hi).
struct page_part {
  std::size_t lo;
  std::size_t hi;
};
page_part part_of(std::uint64_t p, std::uint64_t offset, std::uint64_t end) noexcept {
  return {static_cast<std::size_t>(std::max(offset, p) - p),
          static_cast<std::size_t>(std::min(end, p + page_size) - p)};
}

// ---- writing out ----

// Drops a clean page that no write-out holds (it no longer counts in cc.bytes): into the file's
// spare pool while the pools of all files hold fewer than cc.spare_cap pages (or, with
// `past_cap`, while the vector has room), else freed.
void drop_page(cache_control& cc, file_cache& fc, cache_page& p, bool past_cap = false) noexcept
    KEEL_REQUIRES(fc.mutex) {
  unlink_page(fc, p);
  cc.bytes.fetch_sub(page_size);
  std::unique_ptr<cache_page> gone = fc.pages.take(p.offset);
  if (fc.spare.size() >= fc.spare.capacity()) return;  // (a push must not allocate)
  if (cc.spare_pages.fetch_add(1, std::memory_order_relaxed) >= cc.spare_cap && !past_cap) {
    cc.spare_pages.fetch_sub(1, std::memory_order_relaxed);
    return;
  }
  fc.spare.push_back(std::move(gone));
}

// Whether a write-out of `f` drops the pages it wrote: a buffered file's (the kernel's page
// cache holds their bytes), unless a read at the engine may need them laid over.
bool drops_written(const file_state& f, const file_cache& fc) noexcept KEEL_REQUIRES(fc.mutex) {
  return !f.direct && fc.reads_from_file == 0;
}

// Over the soft limit, a write's new pages come from the file's least recently written clean
// pages outside [lo, hi) (looking at no more than 64 of them): their memory is reused at once,
// where the flusher would free them while the writer allocates and faults in fresh memory. Into
// the spare pool until it holds `want` (past spare_cap, for as long as the write, under the
// same mutex, takes them back out).
void reclaim_clean(cache_control& cc, file_cache& fc, std::size_t want, std::uint64_t lo,
                   std::uint64_t hi) noexcept KEEL_REQUIRES(fc.mutex) {
  if (fc.reads_from_file != 0) return;  // a read at the engine may need them laid over
  std::size_t looked = 0;
  for (cache_page* p = fc.oldest; p != nullptr && looked < 64 && fc.spare.size() < want &&
                                  fc.spare.size() < fc.spare.capacity();
       ++looked) {
    cache_page* next = p->newer;
    if (!p->flushing && !p->dirty.any() && (p->offset + page_size <= lo || p->offset >= hi)) {
      drop_page(cc, fc, *p, true);
    }
    p = next;
  }
}

// Frees the pages of the file's spare pool.
void free_spare(cache_control& cc, file_cache& fc) noexcept KEEL_REQUIRES(fc.mutex) {
  cc.spare_pages.fetch_sub(fc.spare.size(), std::memory_order_relaxed);
  fc.spare.clear();
}

// The dirty bytes of some pages, to be written out without the file's mutex straight from
// the pages: while a page is `flushing` nobody writes into it (a write into it copies it
// first, see cache_write), and nobody drops it.
class write_out_batch {
 public:
  //! Adds a dirty page; pages must come in offset order (runs that meet are merged). On
  //! bad_alloc the batch is as it was.
  void add(cache_page& p) {
    const std::size_t n_runs = runs_.size();
    const std::size_t n_iov = iov_.size();
    const std::size_t last_count = runs_.empty() ? 0 : runs_.back().count;
    pages_.push_back({&p, p.generation});
    try {
      p.dirty.runs(0, page_size, [&](std::size_t lo, std::size_t hi) {
        const std::uint64_t at = p.offset + lo;
        if (!runs_.empty() && runs_.back().end == at && runs_.back().count < IOV_MAX) {
          runs_.back().end += hi - lo;
          ++runs_.back().count;
        } else {
          runs_.push_back({at, at + (hi - lo), iov_.size(), 1});
        }
        iov_.push_back({p.data() + lo, hi - lo});
      });
    } catch (const std::bad_alloc&) {
      runs_.resize(n_runs);
      if (n_runs != 0) runs_.back().count = last_count;
      iov_.resize(n_iov);
      pages_.pop_back();
      throw;
    }
    p.flushing = true;
  }
  [[nodiscard]] bool empty() const noexcept { return pages_.empty(); }

  //! Writes the runs through the engine (without the file's mutex); stops at the first
  //! failure.
  result<void> write_through(engine& e, file_state& f) noexcept {
    for (const run& r : runs_) {
      const auto iov = std::span<const iovec>(iov_).subspan(r.first, r.count);
      if (auto w = e.write_out(f, r.offset, iov); !w) return w;
      bytes_ += r.end - r.offset;
    }
    return {};
  }

  //! Under the file's mutex again: pages not written since they were added are clean now;
  //! a failure is kept for the next fsync or close. Pages a write copied meanwhile go (freed
  //! here). With `drop`, the batch's pages that are clean now go too (into the spare pool,
  //! up to its size), before the copied ones are freed.
  void settle(cache_control& cc, file_cache& fc, const result<void>& written,
              bool drop = false) noexcept KEEL_REQUIRES(fc.mutex) {
    const bool forget = base::is_planted(base::planted_bug::cache_forgets_failed_write_out);
    for (const entry& e : pages_) {
      e.page->flushing = false;
      if (!e.page->detached && (written || forget) && e.page->generation == e.generation) {
        mark_clean(fc, *e.page);
        cc.dirty_pages.fetch_sub(1, std::memory_order_relaxed);
      }
    }
    for (const entry& e : pages_) {
      if (drop && !e.page->detached && !e.page->dirty.any()) drop_page(cc, fc, *e.page);
    }
    pages_.clear();
    fc.detached.clear();  // one write-out at a time: all of them were this batch's
    cc.written_out.fetch_add(bytes_, std::memory_order_relaxed);
    if (!written && !fc.flush_error && !forget) fc.flush_error = written.error();
  }

  //! Under the file's mutex, nothing written (an allocation failed while the batch was
  //! made, under that mutex throughout): its pages are as they were, dirty.
  void release(file_cache& fc) noexcept KEEL_REQUIRES(fc.mutex) {
    (void)fc;  // named for the lock analysis: the flags are read under its mutex
    for (const entry& e : pages_)
      e.page->flushing = false;
    pages_.clear();
  }

 private:
  struct entry {
    cache_page* page;
    std::uint64_t generation;
  };
  struct run {
    std::uint64_t offset;
    std::uint64_t end;
    std::size_t first;  // in iov_
    std::size_t count;
  };
  std::vector<entry> pages_;
  std::vector<run> runs_;
  std::vector<iovec> iov_;
  std::size_t bytes_ = 0;  // written
};

// Writes out every page of `f` dirty now, in offset order, 1 MiB at a time (the flush
// mutex held: no page is dropped meanwhile). Pages dirtied later are left for later: an
// fsync covers the writes that finished before it, and a sweep that chased newer writes
// might never end. After a failure the rest is still tried; the first error is returned.
result<void> write_out_all(cache_control& cc, file_state& f) noexcept {
  file_cache& fc = *f.cache;
  std::vector<cache_page*> dirty;
  try {
    const base::lock_guard lock(fc.mutex);
    dirty.reserve(fc.dirty_pages);
    for (cache_page* p = fc.dirty; p != nullptr; p = p->next_dirty)
      dirty.push_back(p);
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  std::sort(dirty.begin(), dirty.end(), by_offset);
  result<void> outcome;
  for (std::size_t at = 0; at < dirty.size();) {
    write_out_batch b;
    try {
      const base::lock_guard lock(fc.mutex);
      for (const std::size_t end = std::min(dirty.size(), at + 256); at < end; ++at) {
        if (dirty[at]->dirty.any()) b.add(*dirty[at]);
      }
    } catch (const std::bad_alloc&) {
      // What was copied so far still goes out (and is settled).
      if (b.empty()) return errc_error(std::errc::not_enough_memory);
    }
    if (b.empty()) continue;
    const result<void> written = b.write_through(*cc.write_engine, f);
    {
      const base::lock_guard lock(fc.mutex);
      b.settle(cc, fc, written, drops_written(f, fc));
    }
    if (!written && outcome &&
        !base::is_planted(base::planted_bug::cache_forgets_failed_write_out)) {
      outcome = written;
    }
  }
  return outcome;
}

// Takes the error a write-out left for the next fsync or close (once).
result<void> take_flush_error(file_cache& fc, result<void> r) noexcept {
  const base::lock_guard lock(fc.mutex);
  if (fc.flush_error) {
    if (r) r = std::unexpected(fc.flush_error);
    fc.flush_error = {};
  }
  return r;
}

// ---- the flusher ----

// Adds the pages `pick` chooses (under the file's mutex) to `b`, in offset order. On
// bad_alloc nothing is written this round (false): the pages stay dirty, and no error is
// kept for the file (nothing was lost).
template <class Pick>
bool batch_pages(file_cache& fc, write_out_batch& b, Pick&& pick) noexcept {
  try {
    const base::lock_guard lock(fc.mutex);
    std::vector<cache_page*> chosen = pick();
    std::sort(chosen.begin(), chosen.end(), by_offset);
    for (cache_page* p : chosen)
      b.add(*p);
    return true;
  } catch (const std::bad_alloc&) {
    const base::lock_guard lock(fc.mutex);
    b.release(fc);  // nothing lost: the pages stay dirty for a later write-out
    return false;
  }
}

// Writes out the dirty ones among the `max_pages` least recently written pages of `f` and
// drops those of them that are clean. Whether anything was written or dropped.
bool shrink_file(cache_control& cc, file_state& f, std::size_t max_pages) noexcept {
  file_cache& fc = *f.cache;
  const base::lock_guard flush_lock(fc.flush_mutex);
  if (fc.closed) return false;
  write_out_batch b;
  const bool taken = batch_pages(fc, b, [&]() KEEL_NO_THREAD_SAFETY_ANALYSIS {
    std::vector<cache_page*> chosen;
    std::size_t n = 0;
    for (cache_page* p = fc.oldest; p != nullptr && n < max_pages; p = p->newer, ++n) {
      if (p->dirty.any()) chosen.push_back(p);
    }
    return chosen;
  });
  if (!taken) return false;
  const result<void> written = b.empty() ? result<void>() : b.write_through(*cc.write_engine, f);
  std::size_t dropped = 0;
  {
    const base::lock_guard lock(fc.mutex);
    b.settle(cc, fc, written);
    if (fc.reads_from_file == 0) {
      std::size_t n = 0;
      for (cache_page* p = fc.oldest; p != nullptr && n < max_pages; ++n) {
        cache_page* next = p->newer;
        if (!p->flushing && !p->dirty.any()) {
          drop_page(cc, fc, *p);
          ++dropped;
        }
        p = next;
      }
    }
  }
  return dropped != 0 || (written && !b.empty());
}

// Write-behind: writes out the dirty pages of `f` but the `keep` first dirtied most recently
// (an overwrite may still merge into those). A buffered file's pages written out then go (the
// kernel's page cache holds them); an O_DIRECT file's stay, clean, for reads.
void write_behind_file(cache_control& cc, file_state& f, std::size_t keep) noexcept {
  file_cache& fc = *f.cache;
  const base::lock_guard flush_lock(fc.flush_mutex);
  if (fc.closed) return;
  write_out_batch b;
  const bool taken = batch_pages(fc, b, [&]() KEEL_NO_THREAD_SAFETY_ANALYSIS {
    std::vector<cache_page*> chosen;
    std::size_t n = 0;
    for (cache_page* p = fc.dirty; p != nullptr; p = p->next_dirty) {
      if (n++ >= keep) chosen.push_back(p);  // the list starts with the latest dirtied
    }
    return chosen;
  });
  if (!taken || b.empty()) return;
  const result<void> written = b.write_through(*cc.write_engine, f);
  const base::lock_guard lock(fc.mutex);
  b.settle(cc, fc, written, drops_written(f, fc));
}

std::vector<std::shared_ptr<file_state>> cached_files(cache_control& cc) {
  std::vector<std::shared_ptr<file_state>> out;
  const base::lock_guard lock(cc.files_mutex);
  std::erase_if(cc.files, [&](const std::weak_ptr<file_state>& w) {
    auto f = w.lock();
    if (!f) return true;
    out.push_back(std::move(f));
    return false;
  });
  return out;
}

// Writes out and drops the least recently written pages, file by file, until the cache
// holds at most `target` bytes or nothing more can go (pages a read pins, failing writes).
void shrink_to(cache_control& cc, std::size_t target) noexcept {
  std::vector<std::shared_ptr<file_state>> files;
  try {
    files = cached_files(cc);
  } catch (const std::bad_alloc&) {
    return;
  }
  while (cc.bytes.load() > target && !files.empty()) {
    // The file whose least recently written page is oldest.
    std::size_t pick = 0;
    std::uint64_t oldest = std::numeric_limits<std::uint64_t>::max();
    for (std::size_t i = 0; i < files.size(); ++i) {
      file_cache& fc = *files[i]->cache;
      const base::lock_guard lock(fc.mutex);
      if (fc.oldest != nullptr && fc.oldest->stamp < oldest) {
        oldest = fc.oldest->stamp;
        pick = i;
      }
    }
    if (oldest == std::numeric_limits<std::uint64_t>::max()) return;  // all empty
    // No more pages than it takes (an idle round halves, not more), at most 256 KiB a turn.
    const std::size_t over = cc.bytes.load() - std::min(target, cc.bytes.load());
    const std::size_t pages = std::clamp<std::size_t>((over + page_size - 1) / page_size, 1, 64);
    if (!shrink_file(cc, *files[pick], pages)) {
      files.erase(files.begin() + static_cast<std::ptrdiff_t>(pick));  // next round
    }
  }
}

// Frees the spare pools of every file.
void free_spares(cache_control& cc) noexcept {
  std::vector<std::shared_ptr<file_state>> files;
  try {
    files = cached_files(cc);
  } catch (const std::bad_alloc&) {
    return;  // the next idle round
  }
  for (const auto& f : files) {
    const base::lock_guard lock(f->cache->mutex);
    free_spare(cc, *f->cache);
  }
}

void flusher_main(cache_control& cc) noexcept {
  std::uint64_t seen_writes = cc.writes.load();
  auto last_write_seen = std::chrono::steady_clock::now();
  for (;;) {
    // With nothing cached it sleeps until the first page comes (cache_write wakes it).
    const std::uint32_t s = cc.signal.load();
    if (!cc.quit.load() && !cc.wanted.load() && !cc.behind.load()) {
      const bool holding = cc.bytes.load() != 0 || cc.spare_pages.load() != 0;
      const io::countdown cd = (holding ? io::deadline(cc.idle) : io::deadline::never()).start();
      base::futex_wait(cc.signal, s, &cd);
    }
    if (cc.quit.load()) {
      std::vector<std::shared_ptr<file_state>> files;
      try {
        files = cached_files(cc);
      } catch (const std::bad_alloc&) {
        return;  // each file writes its pages out when it closes
      }
      for (const auto& f : files) {
        const base::lock_guard flush_lock(f->cache->flush_mutex);
        if (!f->cache->closed) (void)write_out_all(cc, *f);  // errors wait in the file
      }
      return;
    }
    cc.wanted.store(false);
    if (cc.behind.exchange(false)) {
      try {
        for (const auto& f : cached_files(cc))
          write_behind_file(cc, *f, cc.behind_pages);
      } catch (const std::bad_alloc&) {
        // The next write past the mark asks again.
      }
    }
    const std::size_t bytes = cc.bytes.load();
    const std::uint64_t writes = cc.writes.load();
    const auto now = std::chrono::steady_clock::now();
    if (writes != seen_writes) last_write_seen = now;
    if (bytes > cc.soft) {
      shrink_to(cc, cc.soft - cc.soft / 8);  // oldest first, a little below the soft limit
    } else if (writes == seen_writes && now - last_write_seen >= cc.idle &&
               (bytes != 0 || cc.spare_pages.load() != 0)) {
      // Idle for a round (not merely woken again without a write, as write-behind may):
      // halve what is cached, and free the pages kept for reuse.
      shrink_to(cc, bytes / 2);
      free_spares(cc);
      last_write_seen = now;
    }
    seen_writes = writes;
  }
}

// ---- requests ----

// Whether a write that touches no cached page goes straight to the engine because the cache
// does not pay on this file: of its last 32 writes, fewer than one in 8 came back to bytes
// written shortly before (a cached page, or one of the last 8 writes that went past the
// cache). A file written once, front to back, has nothing to merge, and the copy would only
// cost; writes that come back bring the cache back within 32 writes.
bool steps_aside(file_cache& fc, const op& o, bool touches_cache) noexcept KEEL_REQUIRES(fc.mutex) {
  const std::uint64_t end = o.offset + o.length;
  const bool aside = !touches_cache && fc.stepping_aside;
  bool back = touches_cache;
  for (const auto& r : fc.passed)
    back = back || (r.offset < end && o.offset < r.end);
  ++fc.window_writes;
  if (back) ++fc.window_hits;
  if (fc.window_writes == 32) {  // the verdict, for the next writes
    fc.stepping_aside = fc.window_hits * 8 < fc.window_writes;
    fc.window_writes = fc.window_hits = 0;
  }
  if (aside) fc.passed[fc.next_passed++ % fc.passed.size()] = {o.offset, end};
  return aside;
}

std::optional<result<std::size_t>> cache_write(cache_control& cc, file_cache& fc, op& o) noexcept {
  o.cache_checked = true;
  if (o.length == 0) return result<std::size_t>(0);
  const std::uint64_t end = o.offset + o.length;
  const std::uint64_t first = o.offset & ~std::uint64_t{page_size - 1};
  base::unique_lock lock(fc.mutex);
  std::size_t missing = 0;
  std::size_t being_written = 0;  // pages a write-out is writing from: copied first
  bool touches_cache = false;
  for (std::uint64_t p = first; p < end; p += page_size) {
    if (const cache_page* pg = fc.pages.find(p); pg != nullptr) {
      touches_cache = true;
      if (pg->flushing) ++being_written;
    } else {
      ++missing;
    }
  }
  // At the hard limit a write that needs a page the cache lacks goes to the file, also one
  // that touches cached pages (an append that begins in the page the last one ended in would
  // otherwise grow the cache without bound): its bytes go into those pages first, dirty, so
  // that a write-out of them, before or after the write lands, writes its bytes and never
  // older ones. Pages made meanwhile by other threads are seen to when it ends
  // (passed_write_finished). Where a write-out is writing from one of the pages, the write is
  // cached whole instead (the limit is then passed by at most this request).
  if (missing != 0 && being_written == 0 &&
      cc.bytes.load(std::memory_order_relaxed) + missing * page_size > cc.hard) {
    std::size_t now_dirty = 0;
    for (std::uint64_t p = first; p < end && touches_cache; p += page_size) {
      cache_page* pg = fc.pages.find(p);
      if (pg == nullptr) continue;
      const page_part part = part_of(p, o.offset, end);
      std::memcpy(pg->data() + part.lo, o.buffer + (p + part.lo - o.offset), part.hi - part.lo);
      pg->valid.set(part.lo, part.hi);
      if (!pg->dirty.any()) {
        mark_dirty(fc, *pg);
        ++now_dirty;
      }
      pg->dirty.set(part.lo, part.hi);
      ++pg->generation;
    }
    cc.dirty_pages.fetch_add(now_dirty, std::memory_order_relaxed);
    lock.unlock();
    cc.bypassed.fetch_add(1, std::memory_order_relaxed);
    if (!cc.wanted.exchange(true)) wake_flusher(cc);
    o.passed_cache = true;
    return std::nullopt;
  }
  // Where the cache does not pay, it steps aside (only for a write that touches no cached
  // page; a page made meanwhile by another thread's write is seen to when it ends).
  if (steps_aside(fc, o, touches_cache)) {
    lock.unlock();
    cc.bypassed.fetch_add(1, std::memory_order_relaxed);
    o.passed_cache = true;
    return std::nullopt;
  }
  if (const std::size_t need = missing + being_written;
      need > fc.spare.size() &&
      cc.bytes.load(std::memory_order_relaxed) + missing * page_size > cc.soft) {
    reclaim_clean(cc, fc, need, first, end);
  }
  // First every page, and the copies of pages being written out (an allocation may fail:
  // then nothing is written into them, and the empty pages made so far are dropped like
  // clean ones).
  // (Called under fc.mutex, which the analysis cannot follow into a lambda.)
  const auto new_page = [&cc, &fc]() KEEL_NO_THREAD_SAFETY_ANALYSIS {
    std::unique_ptr<cache_page> n;
    if (fc.spare.empty()) {
      n.reset(new cache_page);  // data left uninitialised
      if (fc.spare.capacity() == 0) fc.spare.reserve(file_cache::max_spare);
    } else {
      n = std::move(fc.spare.back());
      fc.spare.pop_back();
      cc.spare_pages.fetch_sub(1, std::memory_order_relaxed);
      n->reset();
    }
    return n;
  };
  std::size_t made = 0;
  std::vector<std::unique_ptr<cache_page>> copies;
  std::vector<cache_page*> pages;  // those of the write, in order
  try {
    pages.reserve(static_cast<std::size_t>((end - first + page_size - 1) / page_size));
    for (std::uint64_t p = first; p < end; p += page_size) {
      // get_or_make calls it at once, under fc.mutex still (which the analysis cannot follow
      // into the tree's template).
      pages.push_back(&fc.pages.get_or_make(p, [&]() KEEL_NO_THREAD_SAFETY_ANALYSIS {
        std::unique_ptr<cache_page> n = new_page();
        n->offset = p;
        link_newest(fc, *n);
        ++made;
        return n;
      }));
    }
    if (being_written != 0) {
      fc.detached.reserve(fc.detached.size() + being_written);
      for (std::size_t k = 0; k < being_written; ++k)
        copies.push_back(new_page());
    }
  } catch (const std::bad_alloc&) {
    cc.bytes.fetch_add(made * page_size);  // under the mutex: see below
    lock.unlock();
    if (touches_cache) return result<std::size_t>(errc_error(std::errc::not_enough_memory));
    cc.bypassed.fetch_add(1, std::memory_order_relaxed);
    o.passed_cache = true;
    return std::nullopt;
  }
  // The file's size once the cached writes are out: only a write the cache took counts (a
  // write that went to the file and failed must not move the end reads see).
  fc.logical_size = std::max(fc.logical_size, end);
  const std::uint64_t stamp = cc.writes.fetch_add(1, std::memory_order_relaxed) + 1;
  std::size_t now_dirty = 0;
  for (std::size_t k = 0; k < pages.size(); ++k) {
    const std::uint64_t p = first + k * page_size;
    cache_page* found = pages[k];
    if (found->flushing) {
      // A write-out is writing from this page: the write goes into a copy that takes its
      // place; the write-out drops the original when it is done.
      std::unique_ptr<cache_page> copy = std::move(copies.back());
      copies.pop_back();
      copy->take_over(*found);
      take_place(fc, *found, *copy);
      cache_page* fresh = copy.get();
      std::unique_ptr<cache_page> old = fc.pages.exchange(p, std::move(copy));
      old->detached = true;
      fc.detached.push_back(std::move(old));
      found = fresh;
    }
    cache_page& pg = *found;
    const page_part part = part_of(p, o.offset, end);
    std::memcpy(pg.data() + part.lo, o.buffer + (p + part.lo - o.offset), part.hi - part.lo);
    pg.valid.set(part.lo, part.hi);
    if (!pg.dirty.any()) {
      mark_dirty(fc, pg);
      ++now_dirty;
    }
    pg.dirty.set(part.lo, part.hi);
    ++pg.generation;
    pg.stamp = stamp;
    unlink_page(fc, pg);
    link_newest(fc, pg);
  }
  const bool write_behind = cc.behind_pages != 0 && fc.dirty_pages >= 2 * cc.behind_pages;
  // Counted before the mutex goes: a write-out of another thread (an fsync's) may write and
  // drop these pages as soon as it has the mutex, and takes them off the counts then.
  cc.dirty_pages.fetch_add(now_dirty, std::memory_order_relaxed);
  const std::size_t before = cc.bytes.fetch_add(made * page_size);
  lock.unlock();
  if (write_behind && !cc.behind.exchange(true)) wake_flusher(cc);
  if (before == 0 && made != 0) {
    wake_flusher(cc);  // it slept without a timer: idle rounds start now
  } else if (before + made * page_size > cc.soft && !cc.wanted.exchange(true)) {
    wake_flusher(cc);
  }
  return result<std::size_t>(o.length);
}

std::optional<result<std::size_t>> cache_read(cache_control& cc, file_cache& fc, op& o) noexcept {
  o.cache_checked = true;
  if (o.length == 0) return result<std::size_t>(0);
  const base::lock_guard lock(fc.mutex);
  // Only a read wholly in the pages: where a read passes them, the file (which may be
  // longer than this controller knows) says where it ends.
  const std::uint64_t end = o.offset + o.length;
  {
    const std::uint64_t first = o.offset & ~std::uint64_t{page_size - 1};
    bool all = true;
    for (std::uint64_t p = first; p < end && all; p += page_size) {
      const cache_page* pg = fc.pages.find(p);
      const page_part part = part_of(p, o.offset, end);
      all = pg != nullptr && pg->valid.all(part.lo, part.hi);
    }
    if (all) {
      for (std::uint64_t p = first; p < end; p += page_size) {
        const cache_page* pg = fc.pages.find(p);  // found above, under the same lock
        if (pg == nullptr) break;
        const page_part part = part_of(p, o.offset, end);
        std::memcpy(o.buffer + (p + part.lo - o.offset), pg->data() + part.lo, part.hi - part.lo);
      }
      cc.read_hits.fetch_add(1, std::memory_order_relaxed);
      return result<std::size_t>(static_cast<std::size_t>(end - o.offset));
    }
  }
  // To the engine; no page is dropped until it is back (cache_read_finished), so every
  // byte a write-out moved from a page to the file after the engine read it is laid over.
  ++fc.reads_from_file;
  o.reads_file = true;
  return std::nullopt;
}

// Writes out every dirty page of `f`; the error of a failed write-out, also an earlier one
// not yet reported (which is reported once).
result<void> write_out_file(cache_control& cc, file_state& f) noexcept {
  file_cache& fc = *f.cache;
  result<void> r;
  {
    const base::lock_guard flush_lock(fc.flush_mutex);
    if (fc.closed) return {};
    r = write_out_all(cc, f);
  }
  return take_flush_error(fc, r);
}

}  // namespace

result<std::unique_ptr<write_back_cache>> write_back_cache::start(controller::impl& c) noexcept {
  std::unique_ptr<write_back_cache> wb(new (std::nothrow) write_back_cache);
  if (!wb) return errc_error(std::errc::not_enough_memory);
  cache_control& cc = wb->cc_;
  cc.write_engine = c.engine.get();
  cc.soft = c.opts.cache_soft_limit;
  cc.hard = c.opts.cache_hard_limit;
  cc.idle = std::max(c.opts.cache_idle_round, std::chrono::milliseconds(1));
  cc.behind_pages = (c.opts.cache_write_behind + page_size - 1) / page_size;
  cc.spare_cap = std::max<std::size_t>(64, cc.soft / 8 / page_size);
  try {
    cc.flusher = std::thread([&cc] { flusher_main(cc); });
  } catch (const std::system_error& e) {
    return std::unexpected(e.code());
  }
  return wb;
}

write_back_cache::~write_back_cache() {
  stop();
}

result<void> write_back_cache::attach(const std::shared_ptr<file_state>& f,
                                      std::uint64_t size) noexcept {
  try {
    f->cache = std::make_unique<file_cache>();
    {
      const base::lock_guard size_lock(f->cache->mutex);  // not shared yet: for the analysis
      f->cache->logical_size = size;
    }
    const base::lock_guard lock(cc_.files_mutex);
    cc_.files.push_back(f);
  } catch (const std::bad_alloc&) {
    f->cache.reset();
    return errc_error(std::errc::not_enough_memory);
  }
  return {};
}

std::optional<result<std::size_t>> write_back_cache::on_submit(op& o) noexcept {
  switch (o.kind) {
    case op_kind::write:
      return cache_write(cc_, *o.file->cache, o);
    case op_kind::read:
      return cache_read(cc_, *o.file->cache, o);
    default:
      return std::nullopt;  // blocks: on the worker
  }
}

std::optional<result<std::size_t>> write_back_cache::on_worker(op& o) noexcept {
  file_state& f = *o.file;
  switch (o.kind) {
    case op_kind::write:
      if (o.cache_checked) return std::nullopt;
      return cache_write(cc_, *f.cache, o);
    case op_kind::read:
      if (o.cache_checked) return std::nullopt;
      return cache_read(cc_, *f.cache, o);
    case op_kind::fsync:
    case op_kind::fdatasync:
      if (base::is_planted(base::planted_bug::cache_skips_fsync)) return result<std::size_t>(0);
      [[fallthrough]];
    case op_kind::task:
      // The file as the earlier requests left it: their cached bytes written out first.
      if (auto w = write_out_file(cc_, f); !w) {
        return result<std::size_t>(std::unexpected(w.error()));
      }
      return std::nullopt;
  }
  return std::nullopt;
}

void write_back_cache::read_finished(op& o, result<std::size_t>& outcome) noexcept {
  file_cache& fc = *o.file->cache;
  const base::lock_guard lock(fc.mutex);
  --fc.reads_from_file;
  o.reads_file = false;
  if (!outcome) return;
  // The file may end before the cached writes do: up to the logical size, bytes the file
  // lacks read as zeros (a hole) unless a page holds them.
  std::size_t n = *outcome;
  if (fc.logical_size > o.offset) {
    const auto want =
        static_cast<std::size_t>(std::min<std::uint64_t>(o.length, fc.logical_size - o.offset));
    if (want > n) {
      std::memset(o.buffer + n, 0, want - n);
      n = want;
    }
  }
  const std::uint64_t end = o.offset + n;
  for (std::uint64_t p = o.offset & ~std::uint64_t{page_size - 1}; p < end; p += page_size) {
    const cache_page* pg = fc.pages.find(p);
    if (pg == nullptr) continue;
    const page_part part = part_of(p, o.offset, end);
    pg->valid.runs(part.lo, part.hi, [&](std::size_t lo, std::size_t hi) {
      std::memcpy(o.buffer + (p + lo - o.offset), pg->data() + lo, hi - lo);
    });
  }
  outcome = n;
}

void write_back_cache::passed_write_finished(op& o, const result<std::size_t>& outcome) noexcept {
  o.passed_cache = false;
  file_cache& fc = *o.file->cache;
  const std::uint64_t end = o.offset + o.length;
  const std::uint64_t first = o.offset & ~std::uint64_t{page_size - 1};
  const auto touches = [&]() KEEL_REQUIRES(fc.mutex) {
    for (std::uint64_t p = first; p < end; p += page_size) {
      if (fc.pages.find(p) != nullptr) return true;
    }
    return false;
  };
  {
    const base::lock_guard lock(fc.mutex);
    if (outcome) fc.logical_size = std::max(fc.logical_size, end);
    if (!touches()) return;  // the common case: nothing cached to keep in step
  }
  // Pages that hold some of these bytes: cached when the write went past (the hard limit),
  // or made since by another thread's write. A write-out may have written their bytes over
  // this write's since it ended, so with the write-outs held off (the flush mutex: no page
  // is being written from), this write's bytes go into them, dirty: the next write-out
  // puts the file and the pages in step. A failed write left the file's bytes unknown:
  // the pages' go out again instead.
  const base::lock_guard flush_lock(fc.flush_mutex);
  const base::lock_guard lock(fc.mutex);
  if (fc.closed) return;
  std::size_t now_dirty = 0;
  for (std::uint64_t p = first; p < end; p += page_size) {
    cache_page* pg = fc.pages.find(p);
    if (pg == nullptr) continue;
    const page_part part = part_of(p, o.offset, end);
    const bool was_dirty = pg->dirty.any();
    if (outcome) {
      std::memcpy(pg->data() + part.lo, o.buffer + (p + part.lo - o.offset), part.hi - part.lo);
      pg->valid.set(part.lo, part.hi);
      pg->dirty.set(part.lo, part.hi);
    } else {
      pg->valid.runs(part.lo, part.hi,
                     [&](std::size_t lo, std::size_t hi) { pg->dirty.set(lo, hi); });
    }
    ++pg->generation;
    if (!was_dirty && pg->dirty.any()) {
      mark_dirty(fc, *pg);
      ++now_dirty;
    }
  }
  cc_.dirty_pages.fetch_add(now_dirty, std::memory_order_relaxed);
}

result<void> write_back_cache::detach(file_state& f) noexcept {
  file_cache& fc = *f.cache;
  result<void> r;
  {
    const base::lock_guard flush_lock(fc.flush_mutex);
    if (fc.closed) return {};
    r = write_out_all(cc_, f);
    fc.closed = true;
  }
  r = take_flush_error(fc, r);
  // The pages no longer count, and their memory goes now (the closed file's state lives on
  // with its `file` object). A write-out writing from one (none: it would hold the flush
  // mutex) would keep it until the state goes.
  const base::lock_guard lock(fc.mutex);
  free_spare(cc_, fc);
  cc_.bytes.fetch_sub(fc.pages.size() * page_size);
  cc_.dirty_pages.fetch_sub(fc.dirty_pages);
  for (cache_page* p = fc.oldest; p != nullptr;) {
    cache_page* const next = p->newer;
    if (!p->flushing) {
      unlink_page(fc, *p);
      (void)fc.pages.take(p->offset);
    }
    p = next;
  }
  fc.dirty = nullptr;
  fc.dirty_pages = 0;
  return r;
}

void write_back_cache::stop() noexcept {
  if (!cc_.flusher.joinable()) return;
  cc_.quit.store(true);
  wake_flusher(cc_);
  cc_.flusher.join();
}

cache_stats write_back_cache::stats() const noexcept {
  cache_stats s;
  s.cached_bytes = cc_.bytes.load();
  s.dirty_bytes = cc_.dirty_pages.load() * page_size;
  s.writes_cached = cc_.writes.load();
  s.writes_bypassed = cc_.bypassed.load();
  s.reads_served = cc_.read_hits.load();
  s.bytes_written_out = cc_.written_out.load();
  return s;
}

}  // namespace keel::aio::detail
