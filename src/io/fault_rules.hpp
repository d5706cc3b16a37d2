#pragma once
// The fault filesystem's rules (fault_filesystem.hpp, "Faults"): which operation fails, how,
// and the counts of what was seen. It owns the rules, the counts and the random generator
// that decides (seeded, so a test repeats): nothing else reads or changes them. It knows
// nothing of the durability model (durability_model.hpp).

#include <array>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string_view>
#include <vector>

#include "base/thread_safety.hpp"
#include "keel/io/fault_filesystem.hpp"

namespace keel::io {

class fault_rules {
 public:
  using fault = fault_filesystem::fault;

  explicit fault_rules(std::uint64_t seed) : rng_(seed) {}

  //! What to do with one operation.
  struct decision {
    int error = 0;
    bool partial = false;
    bool crash = false;
    [[nodiscard]] bool any() const noexcept { return error != 0 || partial || crash; }
  };

  void add(fault f);
  void clear();
  //! Counts `op` and returns what the first rule that fires on it says (none: nothing).
  [[nodiscard]] decision decide(fs_op op, std::string_view path);
  //! A random number below n (0 for n = 0), from the rules' generator: a partial transfer's
  //! length.
  [[nodiscard]] std::size_t random_below(std::size_t n);
  [[nodiscard]] std::uint64_t count(fs_ops ops) const;
  [[nodiscard]] std::uint64_t injected() const;

 private:
  struct rule {
    fault f;
    std::uint64_t seen = 0;
    bool done = false;
  };
  mutable base::mutex mutex_;  // everything below
  std::vector<rule> rules_ KEEL_GUARDED_BY(mutex_);
  std::array<std::uint64_t, fs_op_count> counts_ KEEL_GUARDED_BY(mutex_){};
  std::uint64_t injected_ KEEL_GUARDED_BY(mutex_) = 0;
  std::mt19937_64 rng_ KEEL_GUARDED_BY(mutex_);
};

}  // namespace keel::io
