#pragma once

namespace keel::tools {

//! `keel-bench lockmatrix`. argv[0] is "lockmatrix". Returns 0, 1 on failure or broken exclusion,
//! 2 on usage errors.
int run_lockmatrix_command(int argc, char** argv);

inline constexpr const char* lockmatrix_command_summary =
    "Measure lock+unlock rates, waiters x entities, contended and uncontended";

}  // namespace keel::tools
