#pragma once
// The keel::kv workload of the harness (see kv_workload.cpp): one writer's transactions,
// an oracle of what each one wrote and whether it was acknowledged, and the check that what
// the store answers after a kill, a power cut, failing I/O or damage is what it promised.

#include <cstdint>
#include <optional>
#include <string>

#include "torture.hpp"

namespace keel::torture::detail {

//! One cycle of the kv workload under `how`, in the fresh directory `dir` (its lock maps in
//! `map_dir`): nothing, or what went wrong.
[[nodiscard]] std::optional<std::string> kv_cycle(mode how, const std::string& dir,
                                                  const std::string& map_dir, std::uint64_t seed);

}  // namespace keel::torture::detail
