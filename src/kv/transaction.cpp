// A transaction's calls (include/keel/kv/store.hpp, class transaction): reads at its snapshot,
// writes kept in memory until commit (commit.cpp, commit_run.hpp), scans, abort.

#include <string>
#include <string_view>

#include "base/fork.hpp"
#include "kv/store_impl.hpp"
#include "kv/transaction_impl.hpp"

namespace keel::kv {

result<bool> transaction::impl::contains(std::string_view key) noexcept {
  if (auto k = check_key(key); !k) return std::unexpected(k.error());
  if (lease.generation != base::fork_generation()) return errc_error(std::errc::invalid_argument);
  const auto kb = as_bytes(key);
  const disk::key_hash h = s->hash_of(kb);
  if (const auto* w = writes.find(key, h)) return !w->erase;
  try {
    reads.emplace(key);
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  auto r = s->read_at_snapshot(kb, h, snapshot, false);
  if (!r) return std::unexpected(r.error());
  return r->has_value();
}

result<std::span<const std::byte>> transaction::impl::view(std::string_view key) noexcept {
  if (auto k = check_key(key); !k) return std::unexpected(k.error());
  // Begun before a fork: its snapshot is held by the parent's slot, not ours.
  if (lease.generation != base::fork_generation()) return errc_error(std::errc::invalid_argument);
  const auto kb = as_bytes(key);
  const disk::key_hash h = s->hash_of(kb);
  if (const auto* w = writes.find(key, h)) {
    if (w->erase) return keel_error(errc::not_found);
    return as_bytes(w->value);
  }
  try {
    reads.emplace(key);
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  auto r = s->read_at_snapshot(kb, h, snapshot, s->opts.verify_checksums);
  if (!r) return std::unexpected(r.error());
  if (!*r) return keel_error(errc::not_found);
  return s->value_of(**r, s->opts.verify_checksums);
}

transaction::transaction(transaction&&) noexcept = default;
transaction& transaction::operator=(transaction&&) noexcept = default;
transaction::~transaction() = default;

result<std::string> transaction::get(std::string_view key) noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  auto v = impl_->view(key);
  if (!v) return std::unexpected(v.error());
  try {
    return std::string(reinterpret_cast<const char*>(v->data()), v->size());
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
}

result<std::span<const std::byte>> transaction::get_view(std::string_view key) noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  return impl_->view(key);
}

result<std::size_t> transaction::get_into(std::string_view key, std::span<std::byte> out) noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  auto v = impl_->view(key);
  if (!v) return std::unexpected(v.error());
  std::memcpy(out.data(), v->data(), std::min(out.size(), v->size()));
  return v->size();
}

result<void> transaction::put(std::string_view key, std::string_view value) noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  if (auto k = check_key(key); !k) return k;
  if (value.size() > max_value_size) return keel_error(errc::too_large);
  if (impl_->s->opts.read_only) return keel_error(errc::read_only);
  if (impl_->scanned) return errc_error(std::errc::invalid_argument);
  try {
    impl_->writes.put(key, impl_->s->hash_of(as_bytes(key)), value);
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return {};
}

result<scan_page> transaction::scan(std::string_view cursor, std::size_t limit,
                                    bool keys_only) noexcept {
  if (!impl_ || !impl_->writes.empty()) return errc_error(std::errc::invalid_argument);
  if (impl_->lease.generation != base::fork_generation()) {
    return errc_error(std::errc::invalid_argument);
  }
  impl_->scanned = true;
  return impl_->s->scan_at(cursor, limit, keys_only, impl_->snapshot);
}

result<void> transaction::erase(std::string_view key) noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  if (auto k = check_key(key); !k) return k;
  if (impl_->s->opts.read_only) return keel_error(errc::read_only);
  if (impl_->scanned) return errc_error(std::errc::invalid_argument);
  try {
    impl_->writes.erase(key, impl_->s->hash_of(as_bytes(key)));
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  return {};
}

result<std::uint64_t> transaction::commit() noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  return commit(impl_->s->opts.durable);
}

result<std::uint64_t> transaction::commit(durability d) noexcept {
  if (!impl_) return errc_error(std::errc::invalid_argument);
  const call_scope call(*impl_->s);
  store::impl& s = *impl_->s;
  // A commit that only erases is tried again after a compaction makes room, as store::erase
  // is (one failed for room changed nothing of the transaction): else, once the deletes' room
  // was spent, every erase in a transaction failed with no_space, and nothing made room. Its
  // snapshot's slot is let go meanwhile (compaction waits for every open transaction, this
  // one too) and taken again after: the commit is judged from the same snapshot (a key
  // committed since by another is a conflict), and reads only what entries name now. One
  // that read keys returns conflict instead, once room is made: retried, it goes in.
  const bool only_erases = impl_->writes.only_erases();
  auto r = erase_with_room(
      s, [&] { return impl_->commit(d); },
      [&] {
        if (!only_erases || !impl_->lease.held()) return false;
        s.release_slot(impl_->lease);
        impl_->lease = {};
        return true;
      },
      [&]() -> result<void> {
        // One that read keys can no longer be judged from its snapshot: without its slot, the
        // compaction may have forgotten a key it read that was erased since (its entry
        // emptied: nothing left to conflict with), and its commit wrote a skew (two
        // transactions that each read two keys and erased one erased both). It is retried
        // from a new snapshot by its caller, in the room made.
        if (!impl_->reads.empty()) return keel_error(errc::conflict);
        auto lease = s.acquire_slot(slot_use::writing);
        if (!lease) return std::unexpected(lease.error());
        impl_->lease = *lease;
        auto snap = s.take_snapshot(impl_->lease, slot_use::writing);
        if (!snap) {
          impl_->lease = {};  // (given up already)
          return std::unexpected(snap.error());
        }
        return {};
      });
  impl_.reset();
  return r;
}

void transaction::abort() noexcept {
  impl_.reset();
}

std::uint64_t transaction::snapshot() const noexcept {
  return impl_ ? impl_->snapshot : 0;
}

}  // namespace keel::kv
