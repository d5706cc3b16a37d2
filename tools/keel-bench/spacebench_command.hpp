#pragma once

namespace keel::tools {

//! `keel-bench spacebench`. argv[0] is "spacebench". Exit status: 0, 1 on a failure (a half-way
//! failure, a death by signal, a store that could not be used), 2 on usage errors.
int run_spacebench_command(int argc, char** argv);

inline constexpr const char* spacebench_command_summary =
    "Fill a small volume with a keel::kv store: fill %, time to fail, deletes when full";

}  // namespace keel::tools
