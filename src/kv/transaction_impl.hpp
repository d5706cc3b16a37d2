#pragma once
// A transaction's insides (doc/kv-format.md, "Committing"): its snapshot's slot, the keys it
// wrote and read, shared by transaction.cpp (its calls), commit.cpp and commit_run.hpp (the commit
// protocol) and store.cpp (the one-key calls, each a transaction of one key).

#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>

#include "kv/store_impl.hpp"
#include "kv/write_set.hpp"

namespace keel::kv {

struct transaction::impl {
  store::impl* s = nullptr;
  slot_lease lease;
  std::uint64_t snapshot = 0;
  // Hashed, not ordered: nothing needs the keys in order, and a tree of 65 536 random keys
  // cost a cache miss per level at every put (a transaction of 65 536 puts ran at half the
  // rate per put of a single put).
  write_set writes;
  struct key_hasher {
    using is_transparent = void;
    std::size_t operator()(std::string_view k) const noexcept {
      return std::hash<std::string_view>{}(k);
    }
  };
  std::unordered_set<std::string, key_hasher, std::equal_to<>> reads;
  // It scanned: its reads are a whole snapshot, which commit does not track key by key, so it
  // may no longer write (and a transaction that wrote may not scan).
  bool scanned = false;

  ~impl() { s->release_slot(lease); }

  result<std::span<const std::byte>> view(std::string_view key) noexcept;
  //! Whether `key` is there at the snapshot (or written by this transaction), from its
  //! record's header alone: a key whose value is damaged is there. Counts as a read.
  result<bool> contains(std::string_view key) noexcept;
  result<std::uint64_t> commit(durability d) noexcept;
};

// Runs `attempt` (a commit that only erases) again after each compaction that made room, until
// it goes in, fails for another reason, or the call's deadline passes: deletes work on a full
// store, also while other users take the room each compaction frees (with four compactions a
// call at most, three threads erasing a full 16 MiB store in random order saw a dozen erases
// fail with no_space that went in when tried again alone). `leave` runs before each
// compaction (false: not tried again, the attempt's error stands), `back` after it.
template <class F, class L, class B>
auto erase_with_room(store::impl& s, F&& attempt, L&& leave, B&& back) noexcept
    -> decltype(attempt()) {
  // The call's deadline and the count of compactions that removed segments, each read once,
  // at the first failure for room (a commit that finds room reads neither: a clock read and a
  // header word on every put). Read once: outside a call_scope (a volume that never refuses
  // writes) each reading of the deadline is lock_timeout from then, which never comes.
  std::optional<io::countdown::clock::time_point> end;
  std::uint64_t removed = 0;
  bool hoped = false;
  for (;;) {
    const std::uint64_t seen = s.compaction_runs_now();
    auto r = attempt();
    if (r || !out_of_room(r.error())) return r;
    if (!end) {
      end = s.call_expiry();
      removed = s.h64(header::compactions).load(std::memory_order_seq_cst);
    }
    if (io::countdown::clock::now() >= *end || !leave()) return r;
    auto room = s.make_room(seen);
    if (!room) return std::unexpected(room.error());  // why no room could be made
    if (!*room) return r;
    // A compaction (ours or another user's) that removed segments made room. One that removed
    // none leaves only the volume's word that it has room (statfs: another program freed
    // some, or a quota, or a fault, it does not show): worth one retry, not one after another
    // (a writer whose every new file in seg/ failed with EDQUOT compacted for ever).
    const std::uint64_t removed_now = s.h64(header::compactions).load(std::memory_order_seq_cst);
    if (removed_now == removed) {
      if (hoped) return r;
      hoped = true;
    } else {
      hoped = false;
      removed = removed_now;
    }
    if (auto b = back(); !b) return std::unexpected(b.error());
  }
}

}  // namespace keel::kv
