// The store's public calls (include/keel/kv/store.hpp) that are not one part's own: the
// object itself, the check every key passes, and the one-key calls (get, and put and erase,
// each a transaction of one key that makes room when the store is full). Each other public
// call lives with the part it drives: opening in open.cpp, transactions in commit.cpp
// (commit_run.hpp), reading in read.cpp, compaction, checkpoints, backup, salvage and verify in
// theirs.

#include "kv/store_impl.hpp"
#include "kv/transaction_impl.hpp"

namespace keel::kv {

result<void> check_key(std::string_view key) noexcept {
  if (key.empty()) return errc_error(std::errc::invalid_argument);
  if (key.size() > max_key_size) return keel_error(errc::too_large);
  return {};
}

store::store(std::unique_ptr<impl> p) noexcept : impl_(std::move(p)) {}
store::~store() = default;

const std::string& store::path() const noexcept {
  return impl_->path;
}

// ---- store's one-key calls ----

result<transaction> store::begin() noexcept {
  const call_scope call(*impl_);
  if (auto held = impl_->hold_open_byte(); !held) return std::unexpected(held.error());
  // (A read-only store's transactions only read.)
  const slot_use use = impl_->opts.read_only ? slot_use::reading : slot_use::writing;
  auto lease = impl_->acquire_slot(use);
  if (!lease) return std::unexpected(lease.error());
  std::unique_ptr<transaction::impl> t;
  try {
    t = std::make_unique<transaction::impl>();
  } catch (const std::bad_alloc&) {
    impl_->release_slot(*lease);
    return errc_error(std::errc::not_enough_memory);
  }
  t->s = impl_.get();
  t->lease = *lease;
  auto snap = impl_->take_snapshot(t->lease, use);
  if (!snap) return std::unexpected(snap.error());  // (the lease given up: nothing to release)
  t->snapshot = *snap;
  return transaction(std::move(t));
}

namespace {

// One read at a snapshot of its own (no transaction to build, nothing to remember): `take`
// copies the value out while the snapshot still holds it.
template <class Take>
auto read_one(store::impl& s, std::string_view key, Take&& take) noexcept
    -> decltype(take(std::span<const std::byte>{})) {
  if (auto k = check_key(key); !k) return std::unexpected(k.error());
  // The key's hash and the ask for its index entry's line first: the walk to the directory
  // and that miss overlap the lease and the snapshot below, whose seq_cst store every later
  // load would otherwise wait behind (10-30 % more gets a second at 2 M keys). Once this
  // process holds the open byte (hold_open_byte), which keeps the index whole.
  const auto kb = as_bytes(key);
  const disk::key_hash h = s.hash_of(kb);
  if (auto held = s.hold_open_byte(); !held) return std::unexpected(held.error());
  s.table->prefetch_for_read(h);
  auto lease = s.acquire_slot(slot_use::reading);
  if (!lease) return std::unexpected(lease.error());
  struct release {
    store::impl* s;
    slot_lease l;
    ~release() { s->release_slot(l); }
  } hold{&s, *lease};
  auto snap = s.take_snapshot(hold.l, slot_use::reading);
  if (!snap) return std::unexpected(snap.error());
  auto r = s.read_at_snapshot(kb, h, *snap, s.opts.verify_checksums);
  if (!r) return std::unexpected(r.error());
  if (!*r) return keel_error(errc::not_found);
  auto v = s.value_of(**r, s.opts.verify_checksums);
  if (!v) return std::unexpected(v.error());
  return take(*v);
}

}  // namespace

result<std::string> store::get(std::string_view key) noexcept {
  const call_scope call(*impl_);
  return read_one(*impl_, key, [](std::span<const std::byte> v) -> result<std::string> {
    try {
      return std::string(reinterpret_cast<const char*>(v.data()), v.size());
    } catch (const std::bad_alloc&) {
      return errc_error(std::errc::not_enough_memory);
    }
  });
}

result<void> store::get(std::string_view key, std::string& value) noexcept {
  const call_scope call(*impl_);
  return read_one(*impl_, key, [&](std::span<const std::byte> v) -> result<void> {
    try {
      value.assign(reinterpret_cast<const char*>(v.data()), v.size());
    } catch (const std::bad_alloc&) {
      return errc_error(std::errc::not_enough_memory);
    }
    return {};
  });
}

namespace {

// How many compactions one put runs on a full store before it gives up (each frees at least
// a segment). (Erases go on while compactions make room: erase_with_room.)
constexpr int max_compactions_per_call = 4;

}  // namespace

result<void> store::put(std::string_view key, std::string_view value) noexcept {
  const call_scope call(*impl_);
  if (auto held = impl_->hold_open_byte(); !held) return std::unexpected(held.error());
  // A put that finds no room while the log holds at least a segment of dead versions has the
  // store make room from them (a compaction) and tries again: the store says full when its
  // live data fills the volume, not its log.
  for (int compactions = 0;;) {
    const std::uint64_t seen = impl_->compaction_runs_now();
    const std::uint64_t checkpoint_seen = impl_->h64(header::checkpoint_seq).load();
    auto t = begin();
    if (!t) return std::unexpected(t.error());
    if (auto r = t->put(key, value); !r) return r;
    // A blind write: it conflicts only with a commit of the same key since its snapshot,
    // which it then simply follows.
    auto r = t->commit();
    if (r) return {};
    if (r.error() == errc::conflict) continue;
    if (!out_of_room(r.error()) || compactions++ == max_compactions_per_call) {
      return std::unexpected(r.error());
    }
    // Unless a compaction began since the commit did (make_room then waits for it to end and
    // retries: it may have made the room, and taken the dead count down), one is worth running
    // only if the log holds a segment's worth of dead versions. (Not more often: a put on a
    // store full of live data must fail fast.)
    const std::uint64_t seg_size = impl_->next_segment_size();
    // Nothing dead to compact, or a compaction made no room: the checkpoint, a copy of the
    // index that only makes an open after a crash faster, gives its room on the volume, or
    // under the budget, to the store's data (with none there, the put fails at once).
    const auto without_checkpoint = [&]() -> result<void> {
      const bool volume_full = r.error() == std::errc::no_space_on_device ||
                               r.error() == std::error_code(EDQUOT, std::system_category()) ||
                               r.error() == errc::budget_reached;
      if (!volume_full || checkpoint_seen == 0) return std::unexpected(r.error());
      auto dropped = impl_->drop_checkpoint_for_room(checkpoint_seen);
      if (!dropped) return std::unexpected(dropped.error());
      if (!*dropped) return std::unexpected(r.error());
      return {};
    };
    // Nor when the last compaction found nothing to take and not enough has died since.
    if (impl_->compaction_runs_now() == seen &&
        ((impl_->h64(header::dead_bytes).load() < seg_size && impl_->log_not_live() < seg_size) ||
         impl_->compaction_would_take_nothing())) {
      if (auto w = without_checkpoint(); !w) return std::unexpected(w.error());
      continue;
    }
    auto room = impl_->make_room(seen);
    if (!room) return std::unexpected(room.error());  // why no room could be made
    if (!*room) {
      // (A store whose dead bytes are spread too thin for any victim: its first put to find
      // the volume full failed here with the checkpoint still taking room, and the next put,
      // which the fruitless mark sends the way above, went through.)
      if (auto w = without_checkpoint(); !w) return std::unexpected(w.error());
    }
  }
}

result<void> store::erase(std::string_view key) noexcept {
  const call_scope call(*impl_);
  if (auto held = impl_->hold_open_byte(); !held) return std::unexpected(held.error());
  // Deletes work on a full store: when even the room puts leave for them is used up, a
  // compaction (whose spare always holds a victim's copies) frees some, and the erase is
  // tried again, for as long as compactions free something.
  return erase_with_room(
      *impl_,
      [&]() -> result<void> {
        for (;;) {
          auto t = begin();
          if (!t) return std::unexpected(t.error());
          // Whether it is there, from its record's header: a damaged value is erased like any.
          auto there = t->impl_->contains(key);
          if (!there) return std::unexpected(there.error());
          if (!*there) return keel_error(errc::not_found);
          if (auto e = t->erase(key); !e) return e;
          auto r = t->impl_->commit(impl_->opts.durable);
          if (r) return {};
          if (r.error() != errc::conflict) return std::unexpected(r.error());
        }
      },
      [] { return true; }, [] { return result<void>{}; });
}

}  // namespace keel::kv
