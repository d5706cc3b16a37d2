#pragma once

namespace keel::tools {

//! `keel-bench torture`. argv[0] is "torture". Returns the exit status: 0 when every cycle passed,
//! 1 when one failed, 2 on usage errors.
int run_torture_command(int argc, char** argv);

inline constexpr const char* torture_command_summary =
    "Crash, power-cut, fail and damage keel's files on purpose, and check nothing is lost";

}  // namespace keel::tools
