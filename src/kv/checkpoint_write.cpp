// Writing a checkpoint (doc/kv-format.md, "Checkpoints and recovery"): store::impl::
// checkpoint_locked drives the steps of that section in order, each a function of
// checkpoint_run below: where replay must start, the seq S held with the counters as of it,
// the directory read, every page it names copied with each entry as a reader at S sees it,
// the log synced, the copy sealed, charged under a budget, and put in place of the one
// before. The caller holds the maintenance byte.

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "kv/checkpoint_file.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {

using namespace checkpoint_file;

namespace {

// One checkpoint being written: what each step found, for the next. The writing thread's
// alone.
struct checkpoint_run {
  checkpoint_run(store::impl& store, const io::countdown& deadline, slot_lease& held) noexcept
      : s(store), cd(deadline), lease(held) {}

  store::impl& s;
  const io::countdown& cd;
  slot_lease& lease;  // the slot S is held in

  // ---- step 1 ----
  std::uint64_t from = 0;  // where replay must start
  // ---- step 2 ----
  std::uint64_t S = 0;
  std::uint64_t records = 0;
  std::uint64_t live_bytes = 0;
  std::uint64_t dead_bytes = 0;
  // ---- step 3 ----
  std::uint64_t word = 0;  // the directory word as read
  unsigned depth = 0;
  std::uint64_t first = 0;           // the directory's first page
  std::uint64_t entries = 0;         // its entries
  std::uint64_t used = 0;            // pages used, read after the directory
  std::vector<std::uint64_t> named;  // each entry's page, each range its shallowest's
  std::vector<std::uint64_t> segments;
  std::uint64_t list_pages = 0;  // of segment numbers
  std::size_t index_end = 0;     // the copy's bytes up to the list
  std::unique_ptr<std::byte[]> out;
  std::size_t out_size = 0;
  std::vector<bool> copied_page;

  void find_replay_start() noexcept;
  [[nodiscard]] result<void> hold_snapshot() noexcept;
  [[nodiscard]] result<void> read_directory() noexcept;
  [[nodiscard]] result<void> copy_index() noexcept;
  void seal() noexcept;
  [[nodiscard]] result<void> charge_budget() noexcept;
  [[nodiscard]] result<void> put_in_place() noexcept;

 private:
  [[nodiscard]] bool in_use(std::uint64_t p) const noexcept {
    return p >= first_free_page && p < used;
  }
  [[nodiscard]] unsigned depth_of(std::uint64_t p) const noexcept {
    return s.table->page(p).local_depth().load(std::memory_order_acquire);
  }
  [[nodiscard]] std::byte* page_out(std::uint64_t p) noexcept;
  [[nodiscard]] result<void> copy_chain(std::uint64_t named_page) noexcept;
  [[nodiscard]] result<void> copy_page(std::uint64_t named_page, std::uint64_t p,
                                       std::uint64_t next) noexcept;
  [[nodiscard]] result<std::pair<std::uint64_t, std::uint64_t>> seen_at_s(
      std::uint64_t named_page, const disk::key_hash& h, const index::entry_ref& e,
      const index::entry_ref::state& whole) noexcept;
  [[nodiscard]] std::span<const std::byte> all() const noexcept { return {out.get(), out_size}; }
};

// 1. Where replay must start: the tail, then below it every commit in flight (a slot says
// *reserved* with a lower bound of its location before it takes any space). Read in that
// order, before S: a commit above S either had its slot in flight when it was read, or
// took its space after the tail was read.
void checkpoint_run::find_replay_start() noexcept {
  from = s.h64(header::tail).load(std::memory_order_seq_cst);
  for (std::uint32_t u = 0; u < max_slots; ++u) {
    const slot_ref sl = s.slot(u);
    const std::uint64_t state = sl.state().load(std::memory_order_seq_cst);
    if (state < static_cast<std::uint64_t>(commit_state::reserved) ||
        state > static_cast<std::uint64_t>(commit_state::writing)) {
      continue;
    }
    // A dead writer's slot that nothing needs any more (no seq taken, or its seq already
    // visible, so at or below S) would hold the replay start back for good: freed instead.
    if (s.slot_owner_dead(u) && s.slot_reclaimable(sl)) {
      s.free_dead_slot(u);
      continue;
    }
    from = std::min(from, sl.block().load(std::memory_order_seq_cst));
  }
}

// 2. S, held as this slot's snapshot, and the counters exactly as of S (commits add theirs
// in the ordered step that makes them visible, marked by *counting*).
result<void> checkpoint_run::hold_snapshot() noexcept {
  for (;;) {
    auto snap = s.take_snapshot(lease, slot_use::writing);
    if (!snap) return std::unexpected(snap.error());
    S = *snap;
    records = s.h64(header::live_records).load(std::memory_order_seq_cst);
    live_bytes = s.h64(header::live_bytes).load(std::memory_order_seq_cst);
    dead_bytes = s.h64(header::dead_bytes).load(std::memory_order_seq_cst);
    const std::uint64_t mark = s.h64(header::counting).load(std::memory_order_seq_cst);
    const std::uint64_t again = s.h64(header::visible).load(std::memory_order_seq_cst);
    if (again == S && mark <= S) return {};
    if (cd.expired()) return errc_error(std::errc::timed_out);
    // Commit S + 1 is adding its counters. (Its settling stores escape a page the volume
    // refuses past the deadline, as a commit's do: store_impl.hpp, wait_visible.)
    if (again == S && !s.stored_escapably(cd, [&] { s.wait_visible(S + 1, cd); })) {
      return std::unexpected(s.index_write_refusal());
    }
  }
}

// 3a. The directory. Splits go on meanwhile (holding the directory lock for the whole copy
// would stall every writer that needs one): a page split after the copy began is retired,
// not reused while S is held, and keeps every version up to the split, so it holds each of
// its keys' versions at S. Only the directory may be caught half switched (some entries of a
// split page's range naming it, some its halves): each range goes to the shallowest page
// named in it.
result<void> checkpoint_run::read_directory() noexcept {
  word = s.h64(header::directory).load(std::memory_order_seq_cst);
  depth = static_cast<unsigned>(word & 0xff);
  first = word >> 8;
  if (depth > index::max_depth) return keel_error(errc::corrupt);
  entries = std::uint64_t{1} << depth;
  try {
    named.resize(entries);
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  for (std::uint64_t i = 0; i < entries; ++i) {
    named[i] = std::atomic_ref(
                   *reinterpret_cast<std::uint64_t*>(s.base() + first * disk::page_size + i * 8))
                   .load(std::memory_order_seq_cst);
  }
  // Read after the directory: every page it names lies below.
  used = s.h64(header::pages_used).load(std::memory_order_acquire);
  if (!in_use(first) || first + (entries * 8 + disk::page_size - 1) / disk::page_size > used) {
    return keel_error(errc::corrupt);
  }
  for (std::uint64_t i = 0; i < entries;) {
    const std::uint64_t p = named[i];
    if (!in_use(p) || depth_of(p) > depth) return keel_error(errc::corrupt);
    const std::uint64_t span = std::uint64_t{1} << (depth - depth_of(p));
    const std::uint64_t from_i = i & ~(span - 1);
    for (std::uint64_t j = from_i; j < from_i + span; ++j) {
      if (named[j] != p && in_use(named[j]) && depth_of(named[j]) > depth_of(p)) named[j] = p;
    }
    do {
      ++i;
    } while (i < entries && named[i] == p);
  }
  return {};
}

// The copy of index page `p` (zeroed the first time it is asked for).
std::byte* checkpoint_run::page_out(std::uint64_t p) noexcept {
  std::byte* const at = out.get() + (1 + p - first_free_page) * disk::page_size;
  if (!copied_page[p - first_free_page]) {
    copied_page[p - first_free_page] = true;
    std::memset(at, 0, disk::page_size);
  }
  return at;
}

// 3b. The copy: the directory, every bucket page it names, and the segments there are (none
// goes while the byte is held: compaction takes it too; a checkpoint is trusted only while
// they all are: it may name a record in any of them).
result<void> checkpoint_run::copy_index() noexcept {
  auto listed = s.segment_numbers(false);
  if (!listed) return std::unexpected(listed.error());
  segments = std::move(*listed);
  list_pages = (segments.size() * 8 + disk::page_size - 1) / disk::page_size;
  // Not zeroed as a whole: every page is either copied or zeroed.
  index_end = (1 + used - first_free_page) * disk::page_size;
  out_size = index_end + list_pages * disk::page_size + 8;
  out.reset(new (std::nothrow) std::byte[out_size]);
  try {
    copied_page.assign(used - first_free_page, false);
  } catch (const std::bad_alloc&) {
    out.reset();
  }
  if (!out) return errc_error(std::errc::not_enough_memory);
  std::memset(out.get(), 0, disk::page_size);
  for (std::uint64_t i = 0; i < entries; ++i) {
    put64(page_out(first + i * 8 / disk::page_size) + i * 8 % disk::page_size, named[i]);
  }
  for (std::uint64_t i = 0; i < entries; ++i) {
    if (i > 0 && named[i] == named[i - 1]) continue;
    if (auto c = copy_chain(named[i]); !c) return c;
  }
  for (std::uint64_t i = 0; i < copied_page.size(); ++i) {
    if (!copied_page[i]) std::memset(out.get() + (1 + i) * disk::page_size, 0, disk::page_size);
  }
  std::memset(out.get() + index_end, 0, list_pages * disk::page_size);
  for (std::size_t i = 0; i < segments.size(); ++i)
    put64(out.get() + index_end + i * 8, segments[i]);
  return {};
}

// The page a directory entry names and its overflow chain, each page copied with its link. A
// chain page allocated after `used` was read holds only keys inserted after S: the copy's
// chain ends before it.
result<void> checkpoint_run::copy_chain(std::uint64_t named_page) noexcept {
  std::vector<std::uint64_t> pages;
  try {
    s.table->for_page_chain(named_page, [&](std::uint64_t q) {
      if (!in_use(q)) return false;
      pages.push_back(q);
      return true;
    });
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  for (std::size_t c = 0; c < pages.size(); ++c) {
    if (auto r = copy_page(named_page, pages[c], c + 1 < pages.size() ? pages[c + 1] : 0); !r) {
      return r;
    }
  }
  return {};
}

// What entry `e` of hash `h` (in the chain of `named_page`, read as `whole`) names for a
// reader at S: the location and seq of its record then (location 0: none).
result<std::pair<std::uint64_t, std::uint64_t>> checkpoint_run::seen_at_s(
    std::uint64_t named_page, const disk::key_hash& h, const index::entry_ref& e,
    const index::entry_ref::state& whole) noexcept {
  std::uint64_t seq = whole.seq;
  std::uint64_t at = whole.location;
  if ((seq & index::pending) == 0 && seq <= S) return std::pair{at, seq};
  auto resolved = s.named_by(named_page, h, e, seq, at, S);
  if (!resolved) return std::unexpected(resolved.error());
  at = *resolved;
  seq = 0;
  if (at != 0) {
    auto rec = s.record_at(at, false);
    if (!rec) return std::unexpected(rec.error());
    auto seen = s.back_to(*rec, S, false);
    if (!seen) return std::unexpected(seen.error());
    at = *seen ? (*seen)->location : 0;
    seq = *seen ? (*seen)->rec.head.seq : 0;
  }
  return std::pair{at, seq};
}

// Page `p` of the chain of `named_page`, linked to `next`: each entry as a reader at S sees
// it (none: location 0).
result<void> checkpoint_run::copy_page(std::uint64_t named_page, std::uint64_t p,
                                       std::uint64_t next) noexcept {
  const index::bucket_ref b = s.table->page(p);
  if (copied_page[p - first_free_page]) return keel_error(errc::corrupt);  // a looped chain
  const index::bucket_ref copy{page_out(p)};
  copy.overflow().store(next);
  copy.magic().store(b.magic().load(std::memory_order_acquire));
  copy.local_depth().store(b.local_depth().load(std::memory_order_acquire));
  copy.prefix().store(b.prefix().load(std::memory_order_acquire));
  std::uint64_t n = 0;
  result<void> copied;
  b.for_each_key(
      [&](std::size_t k, const index::entry_ref& e, const index::entry_ref::state& whole) {
        const disk::key_hash h{whole.hi, whole.lo};
        auto seen = seen_at_s(named_page, h, e, whole);
        if (!seen) {
          copied = std::unexpected(seen.error());
          return false;
        }
        const auto [at, seq] = *seen;
        const index::entry_ref to = copy.entry(k);
        to.hi().store(h.hi);
        to.lo().store(h.lo);
        to.location().store(at);
        to.seq().store(at == 0 ? 0 : seq);
        ++n;
        return true;
      });
  if (!copied) return copied;
  copy.used().store(n);
  copy.sum().store(index::count_sum(copy));
  return {};
}

// 5. The first page and the checksum.
void checkpoint_run::seal() noexcept {
  std::byte* const head = out.get();
  const auto fh = checkpoint_format.header();
  std::memcpy(head, &fh, sizeof fh);
  std::memcpy(head + cp::store_id, s.dir.params.id.data(), 16);
  put64(head + cp::seq, S);
  put64(head + cp::from, from);
  put64(head + cp::directory, word);
  put64(head + cp::pages_used, used);
  put64(head + cp::live_records, records);
  put64(head + cp::live_bytes, live_bytes);
  put64(head + cp::dead_bytes, dead_bytes);
  put64(head + cp::retired_pages, s.h64(header::retired_pages).load());
  put64(head + cp::segments, segments.size());
  std::uint64_t sum = 0;
  const std::uint64_t pages = 1 + used - first_free_page + list_pages;
  for (std::uint64_t i = 0; i < pages; ++i) {
    sum = chain(sum, i, all().subspan(i * disk::page_size, disk::page_size), s.salt);
  }
  put64(out.get() + pages * disk::page_size, sum);
}

// 6. Under a budget, charged before it is written (the one there stays counted until this
// one replaces it), with the check, under the `segment` lock every maker of a segment or a
// room holds for its own check: checked alone, its room was taken meanwhile by another
// process's puts, which did not count it, and the files passed the budget by the copy's
// size for good (164 KB at a 4.8 MB budget).
// The word, which may count a copy a killed checkpointer left (removed before this), is set
// back from the file first.
result<void> checkpoint_run::charge_budget() noexcept {
  if (s.opts.max_bytes == 0) return {};
  auto g = s.locks->lock({lock::entity(entity_segment)}, io::deadline(cd.expiry()));
  if (!g) return std::unexpected(g.error());
  const std::uint64_t there = s.checkpoint_file_bytes();
  if (!s.stored_escapably(cd, [&] { s.h64(header::checkpoint_bytes).store(there); })) {
    return std::unexpected(s.index_write_refusal());
  }
  if (s.budget_used(room_for::compaction) + out_size > s.opts.max_bytes) {
    return keel_error(errc::budget_reached);
  }
  if (!s.stored_escapably(cd, [&] { s.h64(header::checkpoint_bytes).fetch_add(out_size); })) {
    return std::unexpected(s.index_write_refusal());
  }
  return {};
}

// 7. The file, replaced whole, then named in the header.
result<void> checkpoint_run::put_in_place() noexcept {
  io::replace_options ro;
  ro.fs = s.fs;
  ro.hook = checkpoint_replace_hook;
  const std::string file = s.path + "/" + checkpoint_name;
  if (auto r = io::atomic_replace(file.c_str(), all(), ro); !r) {
    // The charge back to what the volume holds: the one before, or this one where the
    // replace failed after its rename.
    const std::uint64_t there = s.checkpoint_file_bytes();
    (void)s.stored_escapably(cd, [&] { s.h64(header::checkpoint_bytes).store(there); });
    return std::unexpected(r.error().about(file));
  }
  if (checkpoint_written_hook != nullptr) checkpoint_written_hook();
  // (Refused past the deadline, the words name the checkpoint before, as when a checkpointer
  // is killed here: the file alone says what it holds.)
  if (!s.stored_escapably(cd, [&] {
        s.h64(header::checkpoint_seq).store(S);
        s.h64(header::checkpoint_from).store(from, std::memory_order_release);
        s.h64(header::checkpoint_error).store(0);
        s.h64(header::checkpoint_bytes).store(out_size);
      })) {
    return std::unexpected(s.index_write_refusal());
  }
  return {};
}

}  // namespace

result<void> store::impl::checkpoint_locked(const io::countdown& cd) noexcept {
  if (auto w = writable(); !w) return std::unexpected(w.error());
  auto lease = acquire_slot();
  if (!lease) return std::unexpected(lease.error());
  struct release {
    impl* s;
    slot_lease l;
    ~release() { s->release_slot(l); }
  } held_slot{this, *lease};
  checkpoint_run run(*this, cd, held_slot.l);
  run.find_replay_start();
  if (auto r = run.hold_snapshot(); !r) return r;
  if (auto r = run.read_directory(); !r) return r;
  if (auto r = run.copy_index(); !r) return r;
  // 4. Everything the copy names on disk: every commit up to S is written (it is visible),
  // so a group sync that starts now covers it, blobs included.
  if (auto r = group_sync(true); !r) return r;
  run.seal();
  // A checkpointer killed between naming its copy and the rename left the copy, which no
  // word counts: removed (no other checkpointer writes one while this one holds the byte).
  remove_checkpoint_temps();
  if (auto r = run.charge_budget(); !r) return r;
  return run.put_in_place();
}

}  // namespace keel::kv
