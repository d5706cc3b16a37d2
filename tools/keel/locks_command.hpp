#pragma once

namespace keel::tools {

//! `keel locks`. argv[0] is "locks". Returns the exit status: 0, 2 on usage errors, 66 when
//! the path cannot be looked at.
int run_locks_command(int argc, char** argv);

inline constexpr const char* locks_command_summary =
    "Show who holds and who waits for a keel lock, for every algorithm";

}  // namespace keel::tools
