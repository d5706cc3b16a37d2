#pragma once
// keel::kv::batch_writer: puts many keys into a store in commits small enough for any segment
// (a commit's block must fit in one: 1 MiB at the least; values kept as blobs only add a
// reference to it), as salvage, backup and `keel kv load` do. One thread; not a transaction:
// each batch is committed on its own, with durability::none until `finish`.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "keel/kv/store.hpp"

namespace keel::kv {

class batch_writer {
 public:
  explicit batch_writer(store& to) noexcept : to_(to) {}
  //! Stages a put, committing (durability::none) the batch before it when it is full.
  [[nodiscard]] result<void> put(std::string_view key, std::string_view value) noexcept;
  //! Commits what is staged with `d` (sync: every earlier batch is durable with it).
  [[nodiscard]] result<void> finish(durability d) noexcept;

 private:
  static constexpr std::size_t max_keys = 256;
  static constexpr std::uint64_t max_bytes = std::uint64_t{256} << 10;
  store& to_;
  std::optional<transaction> t_;
  std::size_t staged_ = 0;
  std::uint64_t bytes_ = 0;
};

}  // namespace keel::kv
