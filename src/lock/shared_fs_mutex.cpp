#include "keel/lock/shared_fs_mutex.hpp"

#include <xxhash.h>

#include "base/per_thread.hpp"

#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>
#include <vector>

namespace keel::lock {
namespace {

// The entities this thread holds, by lock path: what makes a relock a deadlock. A guard is
// unlocked on the thread that locked it (documented), so no synchronisation is needed.
// The fork generation check costs a relaxed load.
struct held_entry {
  std::uint64_t dev;
  std::uint64_t ino;
  std::uint64_t value;
};
struct held_set {
  std::vector<held_entry> entries;
  std::uint64_t generation = 0;
};
thread_local held_set held_by_this_thread_storage;

// A forked child holds none of its parent's locks: its copy of the set is dropped.
std::vector<held_entry>& held_by_this_thread_now() noexcept {
  auto& s = held_by_this_thread_storage;
  const std::uint64_t gen = base::fork_generation();
  if (s.generation != gen) {
    s.entries.clear();
    s.generation = gen;
  }
  return s.entries;
}

bool held(const std::vector<held_entry>& v, std::uint64_t dev, std::uint64_t ino,
          std::uint64_t value) noexcept {
  for (const auto& h : v) {
    if (h.value == value && h.ino == ino && h.dev == dev) return true;
  }
  return false;
}

void forget(std::uint64_t dev, std::uint64_t ino, std::span<const entity> set) noexcept {
  auto& v = held_by_this_thread_now();
  // The common case: the set locked last, listed in its order at the end (guards nest like
  // scopes), cut off whole (one entity by one, a set of a million took hours).
  if (v.size() >= set.size()) {
    const std::size_t from = v.size() - set.size();
    bool last = true;
    for (std::size_t i = 0; i < set.size() && last; ++i) {
      last = v[from + i].value == set[i].value && v[from + i].ino == ino && v[from + i].dev == dev;
    }
    if (last) {
      v.resize(from);
      return;
    }
  }
  for (const entity e : set) {
    for (std::size_t i = v.size(); i-- > 0;) {
      if (v[i].value == e.value && v[i].ino == ino && v[i].dev == dev) {
        v[i] = v.back();
        v.pop_back();
        break;
      }
    }
  }
}

}  // namespace

entity entity::from_bytes(std::span<const std::byte> bytes, bool exclusive) noexcept {
  const std::uint64_t h = XXH3_64bits(bytes.data(), bytes.size()) & max_value;
  return entity(h > max_lockable ? h - (max_lockable + 1) : h, exclusive);
}

entity entity::from_string(std::string_view name, bool exclusive) noexcept {
  return from_bytes(std::as_bytes(std::span(name.data(), name.size())), exclusive);
}

entities_guard::entities_guard(entities_guard&& other) noexcept
    : mutex_(other.mutex_),
      size_(other.size_),
      heap_(std::move(other.heap_)),
      token_(other.token_),
      generation_(other.generation_) {
  // The whole inline array, used or not: a fixed-size copy the compiler inlines.
  if (!heap_) std::memcpy(inline_, other.inline_, sizeof inline_);
  other.mutex_ = nullptr;
  other.size_ = 0;
}

entities_guard& entities_guard::operator=(entities_guard&& other) noexcept {
  if (this != &other) {
    (void)unlock();
    mutex_ = other.mutex_;
    size_ = other.size_;
    token_ = other.token_;
    generation_ = other.generation_;
    heap_ = std::move(other.heap_);
    // The whole inline array, used or not: a fixed-size copy the compiler inlines.
    if (!heap_) std::memcpy(inline_, other.inline_, sizeof inline_);
    other.mutex_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

std::span<const entity> entities_guard::entities() const noexcept {
  return {heap_ ? heap_.get() : inline_data(), size_};
}

void entities_guard::assign(std::span<const entity> sorted) {
  size_ = sorted.size();
  if (size_ > inline_capacity) heap_ = std::make_unique<entity[]>(size_);
  std::copy(sorted.begin(), sorted.end(), data());
}

void entities_guard::reset() noexcept {
  mutex_ = nullptr;
  size_ = 0;
  heap_.reset();
}

result<void> entities_guard::unlock_held() noexcept {
  // Made before a fork and unlocked in the child: the locks are the parent's (they may share
  // the parent's descriptors and map, so unlocking here would unlock them for the parent).
  if (generation_ != base::fork_generation()) {
    reset();
    return {};
  }
  shared_fs_mutex* m = mutex_;
  const auto set = entities();
  forget(m->dev_, m->ino_, set);
  auto r = m->do_unlock(set, token_);
  reset();
  return r;
}

void entities_guard::release() noexcept {
  if (mutex_ != nullptr) forget(mutex_->dev_, mutex_->ino_, entities());
  reset();
}

shared_fs_mutex::shared_fs_mutex(std::uint64_t dev, std::uint64_t ino) noexcept
    : dev_(dev), ino_(ino) {}

shared_fs_mutex::~shared_fs_mutex() = default;

result<entities_guard> shared_fs_mutex::lock(std::span<const entity> set, deadline d,
                                             bool spin_not_sleep) noexcept {
  entities_guard g;
  if (set.empty()) return g;
  // Above max_lockable are the lock files' own bytes: no value is folded onto another's.
  if (std::ranges::any_of(set, [](entity e) { return e.value > entity::max_lockable; })) {
    return errc_error(std::errc::invalid_argument);
  }
  if (set.size() == 1) {
    g.size_ = 1;
    g.inline_data()[0] = set[0];
  } else {
    // (Memory running out in a noexcept call is an error, never a terminate.)
    try {
      g.assign(set);
    } catch (const std::bad_alloc&) {
      return errc_error(std::errc::not_enough_memory);
    }
    // Sort by value and merge duplicates (exclusive wins): every algorithm sees a canonical
    // set.
    entity* first = g.data();
    entity* last = first + g.size_;
    std::sort(first, last, [](entity a, entity b) { return a.value < b.value; });
    entity* out = first;
    for (entity* it = first + 1; it < last; ++it) {
      if (it->value == out->value) {
        out->exclusive |= it->exclusive;
      } else {
        *++out = *it;
      }
    }
    g.size_ = static_cast<std::size_t>(out - first) + 1;
  }
  const auto sorted = g.entities();
  auto& held_now = held_by_this_thread_now();
  if (!held_now.empty()) {
    for (const entity e : sorted) {
      if (held(held_now, dev_, ino_, e.value)) {
        return errc_error(std::errc::resource_deadlock_would_occur);
      }
    }
  }
  // Room in the thread's list for what it will hold, before anything is taken: once taken,
  // the set must be listed.
  try {
    // (Doubling, as push_back would: reserved to the exact size, nested locks one entity at
    // a time copied the list at each.)
    const std::size_t need = held_now.size() + sorted.size();
    if (need > held_now.capacity()) held_now.reserve(std::max(need, 2 * held_now.capacity()));
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  } catch (const std::length_error&) {
    return errc_error(std::errc::not_enough_memory);
  }
  const io::countdown cd = d.start();
  auto token = do_lock(sorted, cd, spin_not_sleep);
  if (!token) {
    g.reset();
    return std::unexpected(token.error());
  }
  for (const entity e : sorted)
    held_now.push_back({dev_, ino_, e.value});
  g.mutex_ = this;
  g.token_ = *token;
  g.generation_ = base::fork_generation();
  return g;
}

}  // namespace keel::lock
