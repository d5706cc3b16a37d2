// A commit's validation, under the locks of its keys' pages (doc/kv-format.md, "Committing",
// steps 2 to 4): the pages locked where the directory still routes the keys, each key looked
// up (through the index's own probe, find_locked) and checked against the snapshot, the pages
// too full for the new keys grown, and the block's records built. See commit_run.hpp.

#include <algorithm>
#include <map>

#include "kv/commit_run.hpp"

namespace keel::kv {

// 2-4. Lock the keys' pages, check the directory still names them, validate, make room.
result<void> commit_run::lock_and_validate() noexcept {
  for (;;) {
    auto locked = lock_pages();
    if (!locked) return std::unexpected(locked.error());
    if (*locked == round::again) continue;
    std::map<std::uint64_t, std::size_t> new_keys;  // per page
    if (auto found = look_up(new_keys); !found) return found;
    auto grown = grow_pages(new_keys);
    if (!grown) return std::unexpected(grown.error());
    if (*grown == round::done) return {};
  }
}

// The keys' pages locked (a page that moved meanwhile, or one of a split its splitter died
// in: again).
result<commit_run::round> commit_run::lock_pages() noexcept {
  std::vector<lock::entity> want;
  try {
    want.reserve(keys.size());
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  for (key_plan& k : keys) {
    k.page = s->table->page_of(k.h);
    // (A few keys' lines at once: a large commit's would only push each other out.)
    if (keys.size() <= 16) s->table->prefetch_for_write(k.page, k.h);
    want.emplace_back(k.page, k.w != nullptr);
  }
  auto g = s->locks->lock(want, io::deadline(cd.expiry()));
  if (!g) return std::unexpected(g.error());
  held = std::move(*g);
  bool moved = false;
  for (const key_plan& k : keys)
    moved |= s->table->page_of(k.h) != k.page;
  if (moved) {
    (void)held.unlock();
    return round::again;
  }
  // A split a splitter died in the middle of: nobody may change its pages before it is
  // finished (index.hpp, table::split).
  if (const index::split_journal j = s->table->pending_split(); j.old != 0) {
    const bool touched = std::ranges::any_of(keys, [&](const key_plan& k) {
      return k.page == j.old || k.page == j.low || k.page == j.high;
    });
    if (touched) {
      (void)held.unlock();
      if (auto r = s->settle_split(cd); !r) return std::unexpected(r.error());
      return round::again;
    }
  }
  return round::done;
}

// Each key's entry and previous version; a key committed past the snapshot is a conflict.
// Counts the new keys each page must take.
result<void> commit_run::look_up(std::map<std::uint64_t, std::size_t>& new_keys) noexcept {
  for (key_plan& k : keys) {
    k.entry.reset();
    k.prev = k.prev_seq = k.prev_size = 0;
    // Its entry (the dead writers' marks of its hash settled first: only theirs can be
    // pending while we hold the page), told from other keys of its hash by its bytes.
    auto found = s->find_locked(k.page, k.h, as_bytes(k.key));
    if (!found) return std::unexpected(found.error());
    if (*found) {
      const index::entry_ref e = **found;
      const std::uint64_t at = e.location().load(std::memory_order_acquire);
      // Its header alone: what it says is all a commit over it needs (a damaged value may
      // be overwritten or erased).
      // (Whose header is damaged too: its size is unknown, the counters miss it.)
      auto rec = s->record_head_at(at);
      if (!rec && rec.error() != errc::corrupt) return std::unexpected(rec.error());
      k.entry = e;
      k.prev = at;
      k.prev_seq = e.seq().load(std::memory_order_acquire);
      if (rec && rec->rec.head.op != static_cast<std::uint8_t>(disk::op::erase)) {
        k.prev_size = disk::stored_size(rec->rec);
      }
    }
    // Anything newer than the snapshot (visible or not yet) was committed by somebody else.
    // (Still pending: its block could not be read; never build on it.)
    if (k.entry && ((k.prev_seq & index::pending) != 0 || k.prev_seq > t.snapshot)) {
      // Not visible yet: wait until it is (settling it if its writer died), so that the
      // retry's snapshot sees it rather than conflicting with it again.
      // (Escapably: settling a dead writer's commit stores to the index.)
      if ((k.prev_seq & index::pending) == 0 &&
          !s->stored_escapably(cd, [&] { s->wait_visible(k.prev_seq, cd); })) {
        return std::unexpected(s->index_write_refusal());
      }
      return keel_error(errc::conflict);
    }
    if (!k.entry && k.w != nullptr) {
      try {
        ++new_keys[k.page];
      } catch (const std::bad_alloc&) {
        return errc_error(std::errc::not_enough_memory);
      }
    }
  }
  return {};
}

// A page's chain with fewer free entries (empty, or holding nothing: an undone insert,
// an erased key compaction forgot) than the commit's new keys in it must grow: every
// such page before the keys are locked and looked up again (one page a round made a
// transaction's cost grow with its square: 65 536 new keys took about a thousand rounds,
// 2 000 puts/s against 670 000 in transactions of 16). Done when none must.
result<commit_run::round> commit_run::grow_pages(
    const std::map<std::uint64_t, std::size_t>& new_keys) noexcept {
  struct growth {
    std::uint64_t page = 0;
    std::size_t wanted = 0;              // its new keys
    std::vector<disk::key_hash> coming;  // its keys the commit writes
  };
  std::vector<growth> grow;
  try {
    std::map<std::uint64_t, std::size_t> growing;  // page -> its place in `grow`
    for (const auto& [page, count] : new_keys) {
      if (s->table->has_room(page, count)) continue;
      growing.emplace(page, grow.size());
      grow.push_back({page, count, {}});
    }
    for (const key_plan& k : keys) {
      if (k.w == nullptr) continue;
      if (auto at = growing.find(k.page); at != growing.end()) {
        grow[at->second].coming.push_back(k.h);
      }
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  if (grow.empty()) return round::done;
  (void)held.unlock();
  charged.used = true;  // the split's pages are taken, whatever the commit does next
  for (const growth& one : grow) {
    // (A page split by an earlier one here, or by another writer, routes its keys elsewhere:
    // grow_page then does nothing, and the next round looks again.)
    if (auto r = s->grow_page(one.page, one.coming.front(), one.coming, one.wanted, cd); !r) {
      return std::unexpected(r.error());
    }
  }
  return round::again;
}

// The index pages the marks go into, writable now where the volume may refuse it (the
// pages of each written key's chain: a new key takes an entry anywhere along it).
result<void> commit_run::ready_index_pages() noexcept {
  if (!s->writes_refusable.load(std::memory_order_relaxed)) return {};
  for (const key_plan& k : keys) {
    if (k.w == nullptr) continue;
    result<void> ready;
    s->table->for_page_chain(k.page, [&](std::uint64_t q) {
      ready = s->index_write_ready(q);
      return static_cast<bool>(ready);
    });
    if (!ready) return ready;
  }
  return {};
}

// The block: its records (in the write set's order: nothing reads them by key order).
result<void> commit_run::build_records() noexcept {
  try {
    records.reserve(keys.size());
    for (const key_plan& k : keys) {
      if (k.w == nullptr) continue;
      disk::record_in r;
      r.key = as_bytes(k.key);
      r.prev = k.prev;
      r.prev_seq = k.prev_seq;
      if (k.w->erase) {
        r.what = disk::op::erase;
      } else if (k.blob.location != 0) {
        r.what = disk::op::put_blob;
        r.blob = k.blob;
        r.value_length = k.w->value.size();
      } else {
        r.what = disk::op::put;
        r.value = as_bytes(k.w->value);
      }
      records.push_back(r);
    }
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  length = disk::block_size(records);
  return {};
}

}  // namespace keel::kv
