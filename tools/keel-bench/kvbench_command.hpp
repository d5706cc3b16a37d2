#pragma once

namespace keel::tools {

//! `keel-bench kvbench`. argv[0] is "kvbench". Exit status: 0, 1 on a failure, 2 on usage errors.
int run_kvbench_command(int argc, char** argv);

inline constexpr const char* kvbench_command_summary =
    "Measure keel::kv beside LMDB: inserts, fetches, threaded inserts (ratios)";

}  // namespace keel::tools
