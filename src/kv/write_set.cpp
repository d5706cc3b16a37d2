// A transaction's writes (write_set.hpp): an arena of keys and values, and a table over them.

#include "kv/write_set.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <new>

namespace keel::kv {

namespace {

// Up to this many writes, a search walks them (one or a few: the one-key calls).
constexpr std::size_t few = 8;
// The largest chunk the arena grows to.
constexpr std::size_t largest_chunk = std::size_t{1} << 20;
// A value with more room than this has memory of its own (not a chunk's: one that did not
// fit the chunk's rest left that rest unused, and its old copies could never be freed).
constexpr std::size_t large_value = 4096;

// Room for one more in `v`, doubling it when full (reserve(size() + 1) grows by one).
template <class T>
void grow(std::vector<T>& v) {
  if (v.size() == v.capacity()) v.reserve(std::max<std::size_t>(8, 2 * v.capacity()));
}

}  // namespace

std::size_t write_set::find_index(std::string_view key, const disk::key_hash& h) const noexcept {
  constexpr std::size_t none = std::numeric_limits<std::size_t>::max();
  if (table_.empty()) {
    for (std::size_t i = 0; i < writes_.size(); ++i) {
      if (writes_[i].h == h && writes_[i].key == key) return i;
    }
    return none;
  }
  const std::size_t mask = table_.size() - 1;
  for (std::size_t at = h.lo & mask;; at = (at + 1) & mask) {
    const std::uint32_t slot = table_[at];
    if (slot == 0) return none;
    const write& w = writes_[slot - 1];
    if (w.h == h && w.key == key) return slot - 1;
  }
}

const write_set::write* write_set::find(std::string_view key,
                                        const disk::key_hash& h) const noexcept {
  const std::size_t i = find_index(key, h);
  return i < writes_.size() ? &writes_[i] : nullptr;
}

void write_set::place(std::size_t index) noexcept {
  const std::size_t mask = table_.size() - 1;
  std::size_t at = writes_[index].h.lo & mask;
  while (table_[at] != 0)
    at = (at + 1) & mask;
  table_[at] = static_cast<std::uint32_t>(index + 1);
}

char* write_set::take(std::size_t size) {
  if (size == 0) return nullptr;
  if (size > left_) {
    const std::size_t chunk_size = std::max(size, next_chunk_);
    grow(chunks_);  // (so that the push below cannot throw)
    auto chunk = std::make_unique_for_overwrite<char[]>(chunk_size);
    free_ = chunk.get();
    left_ = chunk_size;
    chunks_.push_back(std::move(chunk));
    next_chunk_ = std::min(next_chunk_ * 2, largest_chunk);
  }
  char* out = free_;
  free_ += size;
  left_ -= size;
  return out;
}

write_set::write& write_set::at(std::string_view key, const disk::key_hash& h) {
  if (const std::size_t i = find_index(key, h); i < writes_.size()) return writes_[i];
  return add(key, h);
}

write_set::write& write_set::add(std::string_view key, const disk::key_hash& h) {
  if (writes_.size() >= std::numeric_limits<std::uint32_t>::max() - 1) throw std::bad_alloc();
  // Room first, in the table and the list, so that nothing below throws once the key is in.
  const std::size_t n = writes_.size() + 1;
  if (n > few && table_.size() < 2 * n) {
    std::vector<std::uint32_t> bigger(std::max<std::size_t>(64, std::bit_ceil(4 * n)));
    table_.swap(bigger);
    for (std::size_t i = 0; i < writes_.size(); ++i)
      place(i);
  }
  grow(writes_);
  write w;
  char* kept = take(key.size());
  std::memcpy(kept, key.data(), key.size());
  w.key = std::string_view(kept, key.size());
  w.h = h;
  w.erase = true;  // (a new write is counted as an erase until its caller says otherwise)
  writes_.push_back(std::move(w));
  ++erases_;
  if (!table_.empty()) place(writes_.size() - 1);
  return writes_.back();
}

void write_set::put(std::string_view key, const disk::key_hash& h, std::string_view value) {
  const write* old = find(key, h);
  if (old != nullptr && value.size() <= old->room) {
    write& w = writes_[static_cast<std::size_t>(old - writes_.data())];
    if (!value.empty()) std::memmove(const_cast<char*>(w.value.data()), value.data(), value.size());
    w.value = std::string_view(w.value.data(), value.size());
    if (w.erase) --erases_;
    w.erase = false;
    return;
  }
  const std::size_t room =
      old == nullptr ? value.size() : std::max(value.size(), old->room + old->room / 2);
  // The value copied before the key is entered (a failure leaves no key without its value),
  // and before its last copy is freed (`value` may be a view of it).
  std::unique_ptr<char[]> own;
  char* kept = nullptr;
  if (room > large_value) {
    own = std::make_unique_for_overwrite<char[]>(room);
    kept = own.get();
  } else {
    kept = take(room);
  }
  if (!value.empty()) std::memcpy(kept, value.data(), value.size());
  // (`old` still points into writes_: only the arena was taken from.)
  write& w = old != nullptr ? writes_[static_cast<std::size_t>(old - writes_.data())] : add(key, h);
  w.value = std::string_view(kept, value.size());
  w.room = room;
  w.own = std::move(own);
  if (w.erase) --erases_;
  w.erase = false;
}

void write_set::erase(std::string_view key, const disk::key_hash& h) {
  write& w = at(key, h);
  if (!w.erase) ++erases_;
  w.erase = true;
  w.value = std::string_view(w.value.data(), 0);
}

}  // namespace keel::kv
