// batch_writer (include/keel/kv/batch_writer.hpp): puts gathered into transactions of at most
// max_keys keys and max_bytes bytes, each committed when the next would not fit. Owns only its
// open transaction and what it holds.

#include "keel/kv/batch_writer.hpp"

namespace keel::kv {

result<void> batch_writer::put(std::string_view key, std::string_view value) noexcept {
  if (t_ && staged_ > 0 &&
      (staged_ >= max_keys || bytes_ + key.size() + value.size() > max_bytes)) {
    auto c = t_->commit(durability::none);
    t_.reset();
    if (!c) return std::unexpected(c.error());
    staged_ = 0;
    bytes_ = 0;
  }
  if (!t_) {
    auto t = to_.begin();
    if (!t) return std::unexpected(t.error());
    t_.emplace(std::move(*t));
  }
  if (auto r = t_->put(key, value); !r) return r;
  ++staged_;
  bytes_ += key.size() + value.size();
  return {};
}

result<void> batch_writer::finish(durability d) noexcept {
  if (!t_) {
    auto t = to_.begin();
    if (!t) return std::unexpected(t.error());
    t_.emplace(std::move(*t));
  }
  auto c = t_->commit(d);
  t_.reset();
  staged_ = 0;
  bytes_ = 0;
  if (!c) return std::unexpected(c.error());
  return {};
}

}  // namespace keel::kv
