// The fault filesystem's rules: see fault_rules.hpp.

#include "io/fault_rules.hpp"

#include <utility>

namespace keel::io {

void fault_rules::add(fault f) {
  const base::lock_guard lock(mutex_);
  rules_.push_back({std::move(f)});
}

void fault_rules::clear() {
  const base::lock_guard lock(mutex_);
  rules_.clear();
}

fault_rules::decision fault_rules::decide(fs_op op, std::string_view path) {
  const base::lock_guard lock(mutex_);
  ++counts_[static_cast<std::size_t>(op)];
  for (rule& r : rules_) {
    if (r.done || !r.f.on.has(op)) continue;
    if (!r.f.path_contains.empty() && path.find(r.f.path_contains) == std::string_view::npos) {
      continue;
    }
    if (++r.seen < r.f.nth) continue;
    bool hit = true;
    switch (r.f.repeat) {
      case fault::repeat::once:
        r.done = true;
        break;
      case fault::repeat::forever:
        break;
      case fault::repeat::randomly:
        hit = std::bernoulli_distribution(r.f.probability)(rng_);
        break;
    }
    if (!hit) continue;
    ++injected_;
    return {r.f.error, r.f.partial, r.f.crash};
  }
  return {};
}

std::size_t fault_rules::random_below(std::size_t n) {
  const base::lock_guard lock(mutex_);
  return n == 0 ? 0 : static_cast<std::size_t>(rng_() % n);
}

std::uint64_t fault_rules::count(fs_ops ops) const {
  const base::lock_guard lock(mutex_);
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < fs_op_count; ++i) {
    if (ops.has(static_cast<fs_op>(i))) n += counts_[i];
  }
  return n;
}

std::uint64_t fault_rules::injected() const {
  const base::lock_guard lock(mutex_);
  return injected_;
}

}  // namespace keel::io
