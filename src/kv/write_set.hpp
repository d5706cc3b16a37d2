#pragma once
// A transaction's writes, kept in memory until it commits: each key's last put or erase, in
// the order each key was first written, with the key's hash in the store (computed once, at
// the write). Keys and values are copied into chunks of an arena that only grows, so a
// transaction of 65 536 puts makes a few dozen allocations, not three per put, its commit
// reads them in the order they were written, and ending it frees the chunks, not 200 000
// nodes and strings (a std::unordered_map of std::string made a put in a transaction of 65 536
// cost twice what one in a transaction of 1 024 did). Owned by its transaction (one thread
// at a time).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "kv/format.hpp"

namespace keel::kv {

class write_set {
 public:
  struct write {
    std::string_view key;    // in the arena
    disk::key_hash h{};      // the key's hash in the store
    std::string_view value;  // in the arena or `own` (empty for an erase)
    std::size_t room = 0;    // bytes the value may take where it is
    //! A large value's memory, its own (freed when the key is written again larger).
    std::unique_ptr<char[]> own;
    bool erase = false;
  };

  //! The key's write, or null. `h` is the key's hash in the store.
  [[nodiscard]] const write* find(std::string_view key, const disk::key_hash& h) const noexcept;
  //! The key's value is `value` from now on (or, `erase`, it is erased). Throws
  //! std::bad_alloc, and the set is then as it was. A value written again goes where the
  //! last was if it fits (a view of the last then shows the new bytes), else anew, with room
  //! to grow by half again: a value that grows a little at a time is copied a logarithmic
  //! number of times, and its old copies take at most twice its size in the arena (a large
  //! value's are freed: a view of it is valid until the key is written again).
  void put(std::string_view key, const disk::key_hash& h, std::string_view value);
  void erase(std::string_view key, const disk::key_hash& h);

  [[nodiscard]] std::size_t size() const noexcept { return writes_.size(); }
  [[nodiscard]] bool empty() const noexcept { return writes_.empty(); }
  //! It erases and puts nothing.
  [[nodiscard]] bool only_erases() const noexcept {
    return !writes_.empty() && erases_ == writes_.size();
  }
  [[nodiscard]] auto begin() const noexcept { return writes_.cbegin(); }
  [[nodiscard]] auto end() const noexcept { return writes_.cend(); }

 private:
  //! The key's write, made (with its key kept) if it has none.
  write& at(std::string_view key, const disk::key_hash& h);
  //! A write made for a key that has none (with its key kept).
  write& add(std::string_view key, const disk::key_hash& h);
  //! `size` bytes of the arena.
  char* take(std::size_t size);
  [[nodiscard]] std::size_t find_index(std::string_view key,
                                       const disk::key_hash& h) const noexcept;
  void place(std::size_t index) noexcept;  // into table_, which has room

  std::vector<write> writes_;
  std::size_t erases_ = 0;
  //! Open addressing over writes_ (index + 1; 0: empty), by the hash's low word; a power of
  //! two at least twice the writes. Empty while there are few: they are searched in turn.
  std::vector<std::uint32_t> table_;
  std::vector<std::unique_ptr<char[]>> chunks_;
  char* free_ = nullptr;
  std::size_t left_ = 0;
  std::size_t next_chunk_ = 1024;
};

}  // namespace keel::kv
