#pragma once

namespace keel::tools {

//! `keel-bench lockcli`. argv[0] is "lockcli". Exit status: 0, 1 when a program could not be
//! run or failed, 2 on usage errors.
int run_lockcli_command(int argc, char** argv);

inline constexpr const char* lockcli_command_summary =
    "Measure what a `keel lock -n FILE -- true` costs beside `flock -n FILE true`";

}  // namespace keel::tools
