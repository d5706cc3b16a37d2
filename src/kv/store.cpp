// The store's public calls (include/keel/kv/store.hpp) that are not one part's own: the
// object itself and the check every key passes. Each other public call lives with the part
// it drives: opening in open.cpp, transactions and the one-key calls in commit.cpp, reading
// in read.cpp, compaction, checkpoints, backup, salvage and verify in theirs.

#include "kv/store_impl.hpp"

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

}  // namespace keel::kv
